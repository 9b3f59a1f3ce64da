"""``peftplug steering``: extract steering vectors from a JSONL of pairs, generate with steering adapters, convert.

Examples::

    peftplug steering extract --model stories260k --pairs pairs.jsonl --method caa --layers 2 --out happy/
    peftplug steering generate --model stories260k --adapter happy/:4 --adapter calm/:-2 \\
        --prompt "Once upon a time" --max-new-tokens 50
    peftplug steering export-easyedit --model stories260k --adapter happy/ --out happy_easyedit/
    peftplug steering import-easyedit --model stories260k --folder happy_easyedit/ --out happy2/
    peftplug steering evaluate --model smollm2-135m-instruct --adapter happy/:4 --prompts prompts.txt \
        --scorer runs/sst2_classifier --questions facts.jsonl --out eval.json

``--model`` is any name ``peftplug.loading`` knows: ``stories260k`` (or ``stories260k:<data dir>``; the real llama2.c
model from the shared data directory), ``tiny:<family>``, ``smollm2-135m-instruct``, a local model directory or a
Hub id. A pairs JSONL has
one object per line with ``positive`` and ``negative`` (or ``pos``/``neg``) strings, or a 2-element list, or
EasyEdit2's rows ``{"question", "matching", "not_matching"}`` (then the vector is EasyEdit2's CAA exactly) or
``{"input", "output", "prompt"?}`` (its vector prompt). Adapter ``--out`` folders are written beside their place and
renamed onto it (an earlier adapter folder is replaced; a folder of other files is refused).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from peftplug.errors import ConfigError, DataError, MissingFileError, one_line


def load_model_and_tokenizer(spec: str):
    """Model (eval mode) and left-padding tokenizer of a ``--model`` spec, through :mod:`peftplug.loading` (the one
    loader, so ``peftplug fit`` and ``peftplug steering`` know the same names).

    Args:
        spec: ``stories260k[:DATA_DIR]``, ``tiny:<family>``, ``smollm2-135m-instruct``, a directory or a Hub id.
    """
    from peftplug.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(spec)
    tokenizer.padding_side = "left"
    return load_model(spec).eval(), tokenizer


def _lines(path: Path, what: str, parse_json: bool):
    """``(line number, JSON value or text)`` of the non-empty lines of ``path``; one-line errors naming the line."""
    if path.is_dir():
        raise ConfigError(f"{what} file {path} is a folder; expected a text file (one entry per line)")
    if not path.is_file():
        raise MissingFileError(f"{what} file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}); expected a UTF-8 {what} file") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not parse_json:
            yield lineno, line
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not JSON ({err.msg})") from None


def read_pairs(path: str | Path) -> list:
    """Reads contrastive pairs (or EasyEdit2 rows) from a JSONL file.

    Args:
        path: JSONL path; each line ``{"positive": ..., "negative": ...}`` (or ``pos``/``neg``), ``[pos, neg]``,
            or an EasyEdit2 row: ``{"question": ..., "matching": ..., "not_matching": ...}`` (CAA) or
            ``{"input": ..., "output": ..., "prompt"?: ...}`` (``--method vector_prompt``); all lines alike.
    """
    path = Path(path)
    pairs = []
    for lineno, obj in _lines(path, "pairs", parse_json=True):
        if isinstance(obj, dict) and ("matching" in obj or "output" in obj):
            # An EasyEdit2 row (CAA's question/matching/not_matching or vector_prompt's input/output);
            # steering.easyedit_data checks its fields.
            pairs.append(obj)
            continue
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
    if len({isinstance(p, dict) for p in pairs}) > 1:
        raise DataError(f"{path} mixes EasyEdit2 rows (question/matching/not_matching) with positive/negative pairs")
    return pairs


def _check_finite(flag: str, value: float, minimum: float | None = None) -> None:
    """One-line ConfigError for a non-finite float flag (or one below ``minimum``), before any model is loaded.

    Args:
        flag: The flag as the user spells it (``--temperature``).
        value: Its value.
        minimum: The smallest accepted value, if any.
    """
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        accepted = f"a finite number >= {minimum:g}" if minimum is not None else "a finite number"
        raise ConfigError(f"{flag} must be {accepted}, got {value}")


def _check_adapter_out(out: str) -> None:
    """Refuses, before the model loads, an adapter ``--out`` that is a file or a folder of other things.

    The adapter is written into a staging folder beside ``--out`` and renamed onto it (a failure midway leaves no
    half-written adapter), so an earlier adapter folder there is replaced; a non-empty folder without
    ``adapter_config.json`` is refused rather than replaced.

    Args:
        out: The ``--out`` folder.
    """
    from peftplug.fileio import nearest_existing

    target = Path(out).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {out}: is a file; give a folder for the adapter (nothing was touched)")
    above = nearest_existing(target.parent)
    if not above.is_dir():
        raise ConfigError(f"--out {out}: {above} is a file, not a folder (nothing was touched)")
    if target.is_dir() and os.path.ismount(target):
        raise ConfigError(f"--out {out}: is a mount point; the adapter is written beside its folder and renamed onto "
                          "it, so give a folder inside it")
    if target.is_dir() and any(target.iterdir()) and not (target / "adapter_config.json").is_file():
        raise ConfigError(f"--out {out}: holds files but no adapter_config.json; an earlier adapter folder is "
                          "replaced, any other folder must be new or empty (nothing was touched)")


def _save_adapter(peft_model, out: str) -> None:
    """``save_pretrained`` into a staging folder beside ``out``, then renamed onto it (see :func:`_check_adapter_out`).

    Args:
        peft_model: The PeftModel to save.
        out: The ``--out`` folder.
    """
    from peftplug.fileio import atomic_directory

    with atomic_directory(os.path.abspath(Path(out).expanduser()), overwrite=True) as staging:
        peft_model.save_pretrained(staging)


def _check_file_out(flag: str, out: str) -> None:
    """Refuses, before the model loads, an output file path that is a folder or lies under a file.

    Args:
        flag: The flag (``--out``).
        out: Its value.
    """
    from peftplug.fileio import nearest_existing

    target = Path(out).expanduser()
    if target.is_dir():
        raise ConfigError(f"{flag} {out}: is a folder; give a file path")
    above = nearest_existing(target.parent)
    if not above.is_dir():
        raise ConfigError(f"{flag} {out}: {above} is a file, not a folder")


def _adapter_spec(spec: str) -> tuple[str, float | None]:
    """``DIR[:MULTIPLIER]`` -> (dir, multiplier or None); a non-finite multiplier is a one-line ConfigError."""
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            mult = float(tail)
        except ValueError:
            return spec, None
        if not math.isfinite(mult):
            raise ConfigError(f"--adapter {spec}: the multiplier after ':' must be a finite number, got {tail!r}")
        return head, mult
    return spec, None


def _require_positive(args, *names: str) -> None:
    """One-line ConfigError for an integer flag below 1, before any model is loaded.

    Args:
        args: Parsed arguments.
        names: Attribute names of the flags (``max_new_tokens`` is reported as ``--max-new-tokens``).
    """
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _prompts_or_bos(tokenizer, prompts: list[str]) -> list[str]:
    """The prompts, with an empty one started from the BOS token when the tokenizer adds none.

    Generation needs at least one token per row; ``--prompt`` is optional (unconditional generation), which
    a tokenizer that prepends BOS gives for free.
    """
    if all(prompts) or tokenizer("", add_special_tokens=True)["input_ids"]:
        return prompts
    if tokenizer.bos_token is None:
        raise ConfigError(
            "--prompt: an empty prompt needs a BOS token to start from and this model's tokenizer has none; "
            "pass --prompt TEXT"
        )
    return [p or tokenizer.bos_token for p in prompts]


def _cmd_extract(args) -> int:
    import steering

    _check_adapter_out(args.out)
    _require_positive(args, "batch_size", *(("steps",) if args.method == "trainable" else ()))
    _check_finite("--multiplier", args.multiplier)
    if args.method == "trainable" and not (math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {args.lr}")
    if args.method == "trainable" and args.operator == "ablate":  # zero gradient at the zero start: nothing trains
        raise ConfigError("--operator ablate cannot be trained from zero vectors; use --operator ablate_then_add or "
                          "add, or extract an ablation direction with --method caa or pca")
    if min(args.layers) < 0:
        raise ConfigError(f"--layers must be block indices >= 0 (block L's output), got {args.layers}")
    pairs = read_pairs(args.pairs)
    model, tokenizer = load_model_and_tokenizer(args.model)
    try:
        peft_model = steering.train_steering_vector(
            model, tokenizer, pairs, method=args.method, layers=args.layers, multiplier=args.multiplier,
            operator=args.operator, positions=args.positions, read=args.read, batch_size=args.batch_size,
            progress=not args.quiet, prompt=args.prompt, objective=args.objective, steps=args.steps, lr=args.lr,
            use_chat_template=args.use_chat_template, system_prompt=args.system_prompt,
            multiple_choice=args.multiple_choice,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _save_adapter(peft_model, args.out)
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
        folder = check_adapter_dir(path)  # a missing adapter_config.json or truncated weights: one line naming it
        # Another PEFT type would load (or fail) deep inside PEFT, and a LoRA one would even generate unsteered
        # under `steering generate`: every command here needs steering adapters, so say so in one line.
        peft_type = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))["peft_type"]
        if peft_type != "STEERING":
            raise ConfigError(f"--adapter {path}: holds a {peft_type} adapter, not a steering adapter (STEERING)")
        name = f"steer{i}"
        try:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
            else:
                peft_model.load_adapter(path, adapter_name=name)
        except ValueError as err:
            raise ConfigError(f"cannot load steering adapter {path}: {err}") from None
        if mult is not None:
            try:
                peft_model.base_model.set_multiplier(mult, adapter_name=name)
            except ValueError as err:
                raise ConfigError(f"--adapter {spec}: {err}") from None
        names.append(name)
    peft_model.base_model.set_adapter(names)
    return peft_model


def _cmd_generate(args) -> int:
    import torch

    _require_positive(args, "max_new_tokens")
    _check_finite("--temperature", args.temperature, minimum=0)
    for spec in args.adapter:
        _adapter_spec(spec)  # a bad multiplier is reported before the model loads
    model, tokenizer = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, args.adapter) if args.adapter else model
    prompts = _prompts_or_bos(tokenizer, args.prompt or [""])
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

    if Path(args.out).expanduser().is_file():
        raise ConfigError(f"--out {args.out}: is a file; give a folder for the EasyEdit2 vectors")
    model, _ = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, [args.adapter])
    paths = steering.export_easyedit(peft_model, args.out, adapter_name="steer0", scaled=args.scaled,
                                     dataset=args.dataset, method=args.method)
    print(f"wrote {len(paths)} EasyEdit2 vector files to {paths[0].parent}")
    return 0


def _cmd_import_easyedit(args) -> int:
    import steering

    _check_adapter_out(args.out)
    _check_finite("--multiplier", args.multiplier)
    model, _ = load_model_and_tokenizer(args.model)
    try:
        peft_model = steering.load_easyedit(model, args.folder, multiplier=args.multiplier,
                                            steer_from_end_position=args.steer_from_end_position)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _save_adapter(peft_model, args.out)
    layers = peft_model.base_model.peft_config["default"].layers
    print(f"wrote steering adapter with layers {layers} to {args.out}")
    return 0


def _cmd_export_gguf(args) -> int:
    import steering

    _check_file_out("--out", args.out)
    model, _ = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, [args.adapter])
    layers = peft_model.base_model.peft_config["steer0"].layers
    if 0 in layers:
        # llama.cpp refuses a control vector holding direction.0 as a whole (it never steers block 0's output).
        raise ConfigError(f"--adapter {args.adapter}: steers layer 0 (layers {layers}); llama.cpp refuses a control "
                          "vector with direction.0, so the file would not load: extract without layer 0")
    try:
        path = steering.export_gguf(peft_model, args.out, adapter_name="steer0")
    except ImportError as err:
        raise ConfigError(str(err)) from None
    print(f"wrote control-vector GGUF {path}")
    return 0


def _read_lines(path: str | Path, what: str, keys: tuple[str, ...]) -> list[dict]:
    """A JSONL file of objects with ``keys`` (or a plain text file, one ``keys[0]`` per line)."""
    path = Path(path)
    rows = []
    for lineno, obj in _lines(path, what, parse_json=path.suffix == ".jsonl"):
        if isinstance(obj, str):
            rows.append({keys[0]: obj.strip()})
            continue
        if not isinstance(obj, dict) or any(k not in obj for k in keys):
            raise DataError(f"{path}:{lineno}: expected an object with {', '.join(keys)}")
        rows.append(obj)
    if not rows:
        raise DataError(f"{path} is empty")
    return rows


def _load_scorer(folder: str):
    """The sequence classifier and tokenizer of ``--scorer``; a folder that holds none is a one-line error.

    Args:
        folder: The ``--scorer`` folder.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(folder)
    if not (path / "config.json").is_file():
        what = ("a PEFT adapter folder (adapter_config.json)" if (path / "adapter_config.json").is_file()
                else "no config.json")
        raise ConfigError(
            f"--scorer {folder}: {what}; expected a saved sequence-classification model folder "
            "(save_pretrained of an AutoModelForSequenceClassification, with its tokenizer)"
        )
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--scorer {folder}: cannot load a sequence classifier: {one_line(str(err))}") from None
    if info.get("missing_keys"):
        # A causal LM (or bare encoder) folder loads as a classifier with a freshly initialised head: its
        # "concept score" would be noise.
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"--scorer {folder}: not a trained sequence classifier (weights {', '.join(missing[:3])} are missing "
            "and would be random); expected save_pretrained of an AutoModelForSequenceClassification"
        )
    return model, tokenizer


def _answers(path: str, rows: list[dict]) -> list[list[str]]:
    """The accepted answers of ``--questions`` rows: a string or a non-empty list of strings each.

    Args:
        path: The ``--questions`` file (for the message).
        rows: Its rows.
    """
    out = []
    for i, row in enumerate(rows, 1):
        value = row["answers"]
        answers = [value] if isinstance(value, str) else value
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise DataError(f"{path}: entry {i}: 'answers' must be a non-empty string or a non-empty list of "
                            f"non-empty strings, got {value!r}")
        out.append(answers)
    return out


def _json_ready(value):
    """``value`` with non-finite floats as ``None`` (strict JSON has no NaN, e.g. ``instruction_kept`` when no
    question was answered right unsteered).

    Args:
        value: Metrics (nested dicts/lists of numbers and strings).
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def _cmd_evaluate(args) -> int:
    from steering import evaluate as ev

    _require_positive(args, "max_new_tokens", "batch_size")
    _check_finite("--temperature", args.temperature, minimum=0)
    if args.out:
        _check_file_out("--out", args.out)
    for spec in args.adapter:
        _adapter_spec(spec)
    if args.scorer and not Path(args.scorer).is_dir():
        raise MissingFileError(f"--scorer {args.scorer} is not a sequence-classification model folder")
    model, tokenizer = load_model_and_tokenizer(args.model)
    peft_model = _load_adapters(model, args.adapter) if args.adapter else model
    requests = [r["prompt"] for r in _read_lines(args.prompts, "prompts", ("prompt",))]
    if args.raw_prompts:
        prompts, reference = requests, None
        if args.instruction:
            prompts = [f"{args.instruction} {r}" for r in requests]
            reference = requests
    else:
        try:
            prompts = ev.chat_prompts(tokenizer, requests, args.system_prompt, args.instruction)
            reference = ev.chat_prompts(tokenizer, requests, args.system_prompt) if args.instruction else None
        except ValueError as err:
            raise ConfigError(f"{err} (pass --raw-prompts for a model without one)") from None
    scorer = None
    if args.scorer:
        classifier, scorer_tokenizer = _load_scorer(args.scorer)
        try:
            scorer = ev.classifier_scorer(classifier, scorer_tokenizer, positive_label=args.positive_label)
        except ValueError as err:
            raise ConfigError(f"--positive-label: {err}") from None
    questions = answers = steered_questions = None
    if args.questions:
        rows = _read_lines(args.questions, "questions", ("question", "answers"))
        texts = [r["question"] for r in rows]
        answers = _answers(args.questions, rows)
        questions = texts if args.raw_prompts else ev.chat_prompts(tokenizer, texts, args.system_prompt)
        if args.instruction:
            steered_questions = ([f"{args.instruction} {t}" for t in texts] if args.raw_prompts
                                 else ev.chat_prompts(tokenizer, texts, args.system_prompt, args.instruction))
    result = ev.evaluate_steering(
        peft_model, tokenizer, prompts, scorer, reference_prompts=reference, questions=questions, answers=answers,
        steered_questions=steered_questions, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        do_sample=args.temperature > 0, seed=args.seed, temperature=args.temperature or 1.0,
        # Raw prompts are encoded as `generate` (and EasyEdit2) encode them: with the tokenizer's BOS; a chat
        # template writes its own special tokens.
        add_special_tokens=args.raw_prompts,
    )
    result["requests"] = requests
    summary = {k: round(v, 4) for k, v in result.items() if isinstance(v, float)}
    print(json.dumps(_json_ready(summary), allow_nan=False))
    if args.out:
        from peftplug.fileio import atomic_write_text

        Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(_json_ready(result), indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.out}")
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
    from steering.io import EASYEDIT_FOLDERS

    parser = argparse.ArgumentParser(
        prog="peftplug steering",
        description="Extract steering vectors from a JSONL of pairs, generate with steering adapters, convert.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("extract", help="extract steering vectors from a JSONL of pairs and save the adapter")
    ex.add_argument("--model", required=True)
    ex.add_argument("--pairs", required=True, help="JSONL of {'positive': ..., 'negative': ...} or EasyEdit2 rows")
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
    ex.add_argument("--use-chat-template", action="store_true", help="EasyEdit2 rows: chat-format the questions")
    ex.add_argument("--system-prompt", default=None, help="EasyEdit2 rows: system prompt")
    ex.add_argument("--multiple-choice", action="store_true", help="EasyEdit2 rows: multiple-choice CAA")
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
    ee.add_argument("--dataset", default=None, help="write OUT/<dataset>/<method>_vector/ (EasyEdit2's tree)")
    ee.add_argument("--method", default=None, choices=sorted(EASYEDIT_FOLDERS),
                    help="EasyEdit2 method folder (default: from the adapter's provenance)")

    ie = sub.add_parser("import-easyedit", help="turn an EasyEdit2 vector folder into a PEFT adapter")
    ie.add_argument("--model", required=True)
    ie.add_argument("--folder", required=True)
    ie.add_argument("--out", required=True)
    ie.add_argument("--multiplier", type=float, default=1.0)
    ie.add_argument("--steer-from-end-position", action="store_true",
                    help="EasyEdit2's option: steer from the last prompt token on (positions=from_last_prompt)")
    ie.set_defaults(func=_cmd_import_easyedit)

    ev = sub.add_parser("evaluate", help="generate on held-out prompts and score: concept, perplexity, fluency, "
                                         "distinct-n, instruction following (EasyEdit2's metrics)")
    ev.add_argument("--model", required=True)
    ev.add_argument("--adapter", action="append", default=[], help="adapter dir, optionally :multiplier")
    ev.add_argument("--prompts", required=True, help="text file (one request per line) or JSONL {'prompt': ...}")
    ev.add_argument("--raw-prompts", action="store_true", help="use the prompts as they are (no chat template)")
    ev.add_argument("--system-prompt", default=None)
    ev.add_argument("--instruction", default=None, help="prompt baseline: prepended to every user message")
    ev.add_argument("--scorer", default=None, help="sequence-classification model folder (concept score)")
    ev.add_argument("--positive-label", type=int, default=1, help="the concept's class index in --scorer")
    ev.add_argument("--questions", default=None, help="JSONL {'question': ..., 'answers': [...]} (instruction check)")
    ev.add_argument("--max-new-tokens", type=int, default=40)
    ev.add_argument("--batch-size", type=int, default=20)
    ev.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = seeded sampling")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default=None, help="JSON file for the metrics and generations")
    ev.set_defaults(func=_cmd_evaluate)

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
    from peftplug.flags import underscore_flags  # one flag spelling across peftplug: --max_new_tokens (or -)

    args = underscore_flags(build_parser()).parse_args(list(argv) if argv is not None else None)
    return int(args.func(args) or 0)
