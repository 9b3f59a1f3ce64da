"""``peftplug steering``: extract steering vectors from a JSONL of pairs, generate with steering adapters, convert.

Examples::

    peftplug steering extract --model stories260k --pairs pairs.jsonl --method caa --layers 2 --out happy/
    peftplug steering generate --model stories260k --adapter happy/:4 --adapter calm/:-2 \\
        --prompt "Once upon a time" --max-new-tokens 50
    peftplug steering export-easyedit --model stories260k --adapter happy/ --out happy_easyedit/
    peftplug steering import-easyedit --model stories260k --folder happy_easyedit/ --out happy2/

``--model`` is ``stories260k`` (or ``stories260k:<data dir>``; the real llama2.c model from the shared data
directory), ``tiny:<family>``, a local model directory or a Hub id (see ``peftplug.loading``). A pairs JSONL has
one object per line with ``positive`` and ``negative`` (or ``pos``/``neg``) strings, or a 2-element list.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from peftplug.errors import ConfigError, DataError, MissingFileError

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_model_and_tokenizer(spec: str):
    """Model (eval mode) and tokenizer of a ``--model`` spec.

    Args:
        spec: ``stories260k[:DATA_DIR]``, ``tiny:<family>``, a directory or a Hub id.
    """
    if spec == "stories260k" or spec.startswith("stories260k:"):
        from peftplug.stories260k import load_stories260k

        data_dir = spec.split(":", 1)[1] if ":" in spec else DEFAULT_DATA_DIR
        try:
            return load_stories260k(data_dir)
        except FileNotFoundError as err:
            raise MissingFileError(str(err)) from None
    from peftplug.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(spec)
    tokenizer.padding_side = "left"
    return load_model(spec).eval(), tokenizer


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """Reads contrastive pairs from a JSONL file.

    Args:
        path: JSONL path; each line ``{"positive": ..., "negative": ...}`` (or ``pos``/``neg``) or ``[pos, neg]``.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"pairs file {path} does not exist")
    pairs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not JSON ({err.msg})") from None
        if isinstance(obj, list) and len(obj) == 2:
            pos, neg = obj
        elif isinstance(obj, dict):
            pos = obj.get("positive", obj.get("pos"))
            neg = obj.get("negative", obj.get("neg"))
        else:
            pos = neg = None
        if not isinstance(pos, str) or not isinstance(neg, str):
            raise DataError(f"{path}:{lineno}: expected {{'positive': str, 'negative': str}} or [pos, neg]")
        pairs.append((pos, neg))
    if not pairs:
        raise DataError(f"{path} contains no pairs")
    return pairs


def _adapter_spec(spec: str) -> tuple[str, float | None]:
    """``DIR[:MULTIPLIER]`` -> (dir, multiplier or None)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, None


def _cmd_extract(args) -> int:
    import steering

    model, tokenizer = load_model_and_tokenizer(args.model)
    pairs = read_pairs(args.pairs)
    try:
        peft_model = steering.train_steering_vector(
            model, tokenizer, pairs, method=args.method, layers=args.layers, multiplier=args.multiplier,
            operator=args.operator, positions=args.positions, read=args.read, batch_size=args.batch_size,
            progress=not args.quiet, prompt=args.prompt, objective=args.objective, steps=args.steps, lr=args.lr,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    peft_model.save_pretrained(args.out)
    norms = {k: round(float(v.norm()), 4) for k, v in peft_model.base_model.get_vectors().items()}
    print(f"wrote steering adapter ({args.method}, {len(pairs)} pairs, layer norms {norms}) to {args.out}")
    return 0


def _load_adapters(model, specs: Sequence[str]):
    """Loads ``DIR[:MULT]`` adapters onto ``model`` (all active together); returns the PeftModel."""
    from peft import PeftModel

    import steering  # noqa: F401  (registers the PEFT type)
    from peftplug.checkpoints import check_adapter_dir

    peft_model, names = None, []
    for i, spec in enumerate(specs):
        path, mult = _adapter_spec(spec)
        check_adapter_dir(path)  # a missing adapter_config.json or truncated weights: one line naming the file
        name = f"steer{i}"
        try:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
            else:
                peft_model.load_adapter(path, adapter_name=name)
        except ValueError as err:
            raise ConfigError(f"cannot load steering adapter {path}: {err}") from None
        if mult is not None:
            peft_model.base_model.set_multiplier(mult, adapter_name=name)
        names.append(name)
    peft_model.base_model.set_adapter(names)
    return peft_model


def _cmd_generate(args) -> int:
    import torch

    model, tokenizer = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, args.adapter) if args.adapter else model
    prompts = args.prompt or [""]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0,
           "pad_token_id": tokenizer.pad_token_id}
    if args.temperature > 0:
        gen["temperature"] = args.temperature
        torch.manual_seed(args.seed)
    with torch.no_grad():
        out = peft_model.generate(**batch, **gen)
    for text in tokenizer.batch_decode(out, skip_special_tokens=True):
        print(text)
    return 0


def _cmd_export_easyedit(args) -> int:
    import steering

    model, _ = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, [args.adapter])
    paths = steering.export_easyedit(peft_model, args.out, adapter_name="steer0", scaled=args.scaled)
    print(f"wrote {len(paths)} EasyEdit2 vector files to {args.out}")
    return 0


def _cmd_import_easyedit(args) -> int:
    import steering

    model, _ = load_model_and_tokenizer(args.model)
    vectors = steering.import_easyedit(args.folder)
    try:
        peft_model = steering.steering_adapter(model, vectors, multiplier=args.multiplier, method="easyedit2")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    peft_model.save_pretrained(args.out)
    print(f"wrote steering adapter with layers {sorted(vectors)} to {args.out}")
    return 0


def _cmd_export_gguf(args) -> int:
    import steering

    model, _ = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, [args.adapter])
    try:
        path = steering.export_gguf(peft_model, args.out, adapter_name="steer0")
    except ImportError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote control-vector GGUF {path}")
    return 0


def _converter(sub, name: str, help_text: str, func):
    """A subcommand reading ``--model`` + ``--adapter`` and writing ``--out``."""
    parser = sub.add_parser(name, help=help_text)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--out", required=True)
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``peftplug steering``."""
    from steering.config import OPERATORS, POSITIONS
    from steering.generators import METHODS, OBJECTIVES, READ_POSITIONS

    parser = argparse.ArgumentParser(
        prog="peftplug steering",
        description="Extract steering vectors from a JSONL of pairs, generate with steering adapters, convert.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("extract", help="extract steering vectors from a JSONL of pairs and save the adapter")
    ex.add_argument("--model", required=True)
    ex.add_argument("--pairs", required=True, help="JSONL of {'positive': ..., 'negative': ...}")
    ex.add_argument("--out", required=True, help="adapter output directory")
    ex.add_argument("--method", default="caa", choices=METHODS)
    ex.add_argument("--layers", type=int, nargs="+", required=True)
    ex.add_argument("--multiplier", type=float, default=1.0)
    ex.add_argument("--operator", default="add", choices=OPERATORS)
    ex.add_argument("--positions", default="all", choices=POSITIONS)
    ex.add_argument("--read", default=None, choices=READ_POSITIONS)
    ex.add_argument("--batch-size", type=int, default=8)
    ex.add_argument("--prompt", default=None, help="steering prompt (method vector_prompt)")
    ex.add_argument("--objective", default="preference", choices=OBJECTIVES, help="method trainable")
    ex.add_argument("--steps", type=int, default=50, help="method trainable")
    ex.add_argument("--lr", type=float, default=0.05, help="method trainable")
    ex.add_argument("--quiet", action="store_true", help="no progress bars")
    ex.set_defaults(func=_cmd_extract)

    ge = sub.add_parser("generate", help="generate with one or more steering adapters (DIR[:MULTIPLIER])")
    ge.add_argument("--model", required=True)
    ge.add_argument("--adapter", action="append", default=[], help="adapter dir, optionally :multiplier")
    ge.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; batched)")
    ge.add_argument("--max-new-tokens", type=int, default=50)
    ge.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ge.add_argument("--seed", type=int, default=0)
    ge.set_defaults(func=_cmd_generate)

    ee = _converter(sub, "export-easyedit", "write an adapter as EasyEdit2 layer_{L}.pt files", _cmd_export_easyedit)
    ee.add_argument("--scaled", action="store_true", help="fold the multiplier into the vectors")

    ie = sub.add_parser("import-easyedit", help="turn an EasyEdit2 vector folder into a PEFT adapter")
    ie.add_argument("--model", required=True)
    ie.add_argument("--folder", required=True)
    ie.add_argument("--out", required=True)
    ie.add_argument("--multiplier", type=float, default=1.0)
    ie.set_defaults(func=_cmd_import_easyedit)

    _converter(sub, "export-gguf", "write a repeng/llama.cpp control-vector GGUF (needs `gguf`)", _cmd_export_gguf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``peftplug steering`` (``peftplug.cli`` delegates here).

    Args:
        argv: Arguments after ``steering``.

    Returns:
        Exit status (0 on success). User errors raise ``peftplug.errors.PeftplugError`` subclasses, which
        ``peftplug.cli.main`` prints as one line.
    """
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return int(args.func(args) or 0)
