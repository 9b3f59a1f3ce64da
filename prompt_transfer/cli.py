"""Command line for PCT's stages: training the source prompts, decomposition and file-to-file export.

    python -m prompt_transfer.cli train-sources --config recipes/prompt_transfer/minilm_sources.yaml
    python -m prompt_transfer.cli decompose runs/src_sst2/adapter runs/src_bbc/adapter --names SST-2 bbc \\
        --out runs/pct/decomposition --explained-variance 0.95
    python -m prompt_transfer.cli export runs/pct_target/adapter runs/pct_target/prompt_tuning

``train-sources`` trains one PEFT prompt-tuning adapter per source task of a multi-source recipe, in sequence,
each through ``peftplug``'s Lightning trainer (:class:`peftplug.lightning.PeftModule`, parsed and checked exactly
like a ``peftplug fit`` recipe), and optionally decomposes them at the end. The PCT target stage goes through
``peftplug fit`` with ``recipes/prompt_transfer/minilm_target_rte_pct.yaml`` or through
:func:`prompt_transfer.train_prompt` in Python.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping


def load_recipe(path: str) -> dict:
    """Reads a multi-source recipe YAML.

    Args:
        path: The YAML file.

    Raises:
        ValueError: If the file is missing, is not valid UTF-8 YAML, is not a YAML mapping, or is a
            ``peftplug fit`` recipe (``data:`` and no ``sources:``).
    """
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"--config: recipe file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f)
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path!r} is not a text file (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); expected a YAML recipe") from None
    except yaml.YAMLError as err:  # a traceback before: yaml's error is no ValueError
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ValueError(f"--config {path!r} is not valid YAML{where} ({problem})") from None
    if not isinstance(recipe, Mapping):
        kind = type(recipe).__name__
        raise ValueError(f"{path}: a multi-source recipe must be a YAML mapping, got {kind}")  # noqa: TRY004
    if "data" in recipe and "sources" not in recipe:
        # The other way round from `peftplug fit`'s refusal of a multi-source recipe.
        raise ValueError(f"--config {path!r} is a `peftplug fit` recipe (it has `data:`, no `sources:`); "
                         "train-sources takes a multi-source recipe (e.g. recipes/prompt_transfer/minilm_sources.yaml); "
                         f"run this one with `peftplug fit --config {path}`")
    return dict(recipe)


def source_cli(config: Mapping, run: bool = False):
    """Builds one source's run with peftplug's LightningCLI, from its ``peftplug fit`` config.

    The config is written to ``<trainer.default_root_dir>/source_config.yaml`` first (``peftplug fit --config``
    on that file reproduces this source alone) and parsed from there, so every key is checked as in
    ``peftplug fit``. ``peftplug.cli`` is imported here, lazily: the trainer depends on the method packages,
    never the other way round.

    Args:
        config: The dict from :func:`prompt_transfer.source.source_run_config`.
        run: Passed to ``peftplug.cli.cli`` (``False``: build model, data module and trainer, run nothing).
    """
    import yaml

    from peftplug.cli import cli
    from peftplug.fileio import atomic_write_text

    root = config["trainer"]["default_root_dir"]
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "source_config.yaml")
    header = "# One source of a multi-source recipe (python -m prompt_transfer.cli train-sources).\n"
    atomic_write_text(path, header + yaml.safe_dump(dict(config), sort_keys=False))
    return cli(["--config", path], run=run)


def train_sources(recipe: Mapping, out_dir: str | None = None, decompose: bool = True) -> dict:
    """Trains every source of a multi-source recipe in sequence and saves each as a PEFT prompt-tuning adapter.

    For source ``k`` the shared ``trainer``/``model`` sections are merged with its overrides, seeded with
    ``seed_everything + k``, built by peftplug's LightningCLI (:class:`peftplug.lightning.PeftModule` + a Lightning
    ``Trainer``), fitted, optionally tested (``evaluate_after_fit``), and exported with ``PeftModule.export`` to
    ``<out_dir>/<name>/`` (``adapter_config.json`` with ``PROMPT_TUNING``, ``adapter_model.safetensors``, the
    tokenizer), atomically. A summary goes to ``<out_dir>/sources.json``.

    Args:
        recipe: A multi-source recipe (validated here with :func:`prompt_transfer.source.validate_sources_recipe`).
        out_dir: Overrides the recipe's ``out_dir``.
        decompose: Run the recipe's ``decompose`` section, if any, after the last source.

    Returns:
        ``{"sources": {name: {"adapter", "global_step", "prompt_change", ["test_acc"], ["zero_shot_acc"]}},
        ["decomposition"]}``.
        ``prompt_change`` is the largest absolute change of a prompt entry during training (0 means the prompt
        did not train).
    """
    import torch

    import prompt_transfer as pt
    from peftplug.fileio import atomic_write_text
    from prompt_transfer.source import source_base_model, source_run_config, validate_sources_recipe

    recipe = dict(recipe)
    if out_dir is not None:
        recipe["out_dir"] = out_dir
    recipe = validate_sources_recipe(recipe)
    check_recipe_outputs(recipe)
    out = recipe["out_dir"]
    log_root = recipe["trainer"].get("default_root_dir") or os.path.join("runs", "pct_sources")
    summary: dict = {"sources": {}}
    for k, source in enumerate(recipe["sources"]):
        name = source["name"]
        run = source_cli(source_run_config(recipe, k, log_root))
        module, trainer = run.model, run.trainer
        encoders = getattr(module.model, "prompt_encoder", None)
        if encoders is None or module.peft_config.peft_type.value != "PROMPT_TUNING":
            raise ValueError(f"model.peft must be a PROMPT_TUNING config for the source stage, got "
                             f"{module.peft_config.peft_type.value}")
        weight = encoders[module.model.active_adapter].embedding.weight
        before = weight.detach().clone()
        zero_shot = {}
        if recipe.get("zero_shot"):
            # The base model alone (PEFT swaps in the base forward for prompt learning): what the prompt must beat.
            with module.model.disable_adapter():
                metrics = trainer.test(module, datamodule=run.datamodule, verbose=False)
            if metrics and "test_acc" in metrics[0]:
                zero_shot["zero_shot_acc"] = float(metrics[0]["test_acc"])
        trainer.fit(module, datamodule=run.datamodule)
        result = {"global_step": int(trainer.global_step),
                  "prompt_change": float((weight.detach() - before).abs().max()), **zero_shot}
        if not torch.isfinite(weight).all():
            raise ValueError(f"source {name!r}: the trained prompt is not finite; lower the learning rate")
        if recipe.get("evaluate_after_fit"):
            metrics = trainer.test(module, datamodule=run.datamodule, verbose=False)
            if metrics and "test_acc" in metrics[0]:
                result["test_acc"] = float(metrics[0]["test_acc"])
        result["adapter"] = str(module.export(os.path.join(out, name), overwrite=True))
        summary["sources"][name] = result
        print(json.dumps({"source": name, **result}), flush=True)
        del run, module, trainer  # one base model in memory at a time
    dec_settings = recipe.get("decompose")
    if decompose and dec_settings:
        adapters = {n: r["adapter"] for n, r in summary["sources"].items()}
        prompts = {n: pt.load_source_prompt(path) for n, path in adapters.items()}
        kwargs = {k: v for k, v in dec_settings.items() if k != "out" and v is not None}
        kwargs["base_model"] = source_base_model(adapters)
        dec = pt.decompose(prompts, **kwargs)
        pt.save_decomposition(dec, dec_settings["out"])
        summary["decomposition"] = {"out": dec_settings["out"], "rank": dec.rank}
    atomic_write_text(os.path.join(out, "sources.json"), json.dumps(summary, indent=2) + "\n")
    return summary


def check_recipe_outputs(recipe: Mapping) -> None:
    """Refuses, before the first source trains, an ``out_dir`` or ``decompose.out`` that cannot be a folder.

    Otherwise the export of the first source, or the decomposition after the last one, ended the run with a
    ``NotADirectoryError`` traceback after minutes of training.

    Args:
        recipe: A validated multi-source recipe.

    Raises:
        ConfigError: Naming the field and the file in the way.
    """
    check_out_dir(recipe["out_dir"], "out_dir")
    if recipe.get("decompose"):
        check_out_dir(recipe["decompose"]["out"], "decompose.out")


def default_source_names(adapters: list[str]) -> list[str]:
    """Distinct source names for adapter folders given without ``--names``.

    A folder's name is its own directory name when no other folder shares it. Folders that share it (the usual
    ``runs/src_sst2/adapter runs/src_bbc/adapter`` layout) are named by the nearest parent component that tells
    them apart (``src_sst2``, ``src_bbc``); if those short names still clash with another source's name, by the
    whole distinguishing path suffix (``src_sst2/adapter``). Names key the decomposition's sources, so two
    folders must never end up under one name.

    Args:
        adapters: The adapter folders, in command-line order.

    Returns:
        One distinct name per folder.

    Raises:
        ValueError: If the folders cannot be told apart by their paths (one folder given twice).
    """
    # Absolute paths: '.' or 'runs/../x' still yield real directory names.
    parts = [os.path.abspath(p).strip(os.sep).split(os.sep) for p in adapters]

    def depth(i: int) -> int:  # components of the shortest path suffix no other folder ends with
        for n in range(1, len(parts[i]) + 1):
            if all(parts[j][-n:] != parts[i][-n:] for j in range(len(parts)) if j != i):
                return n
        return len(parts[i])

    depths = [depth(i) for i in range(len(parts))]
    short = [parts[i][-n] for i, n in enumerate(depths)]
    if len(set(short)) == len(short):
        return short
    full = ["/".join(parts[i][-n:]) for i, n in enumerate(depths)]
    if len(set(full)) != len(full):
        raise ValueError("the adapter folders cannot be told apart by their paths; name the sources with --names")
    return full


def check_sources(adapters: list[str], names: list[str] | None) -> None:
    """Refuses a folder or a name given to two sources (a decomposition keys its sources by name: one would be
    lost; one prompt twice would only count that source double).

    Args:
        adapters: The adapter folders.
        names: The ``--names`` values, or ``None``.

    Raises:
        ValueError: Naming the first duplicate.
    """
    seen: dict[str, str] = {}
    for path in adapters:
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"adapter folder {path!r} is given twice (also as {seen[real]!r}); "
                             "give each source once")
        seen[real] = path
    names = names or []
    for i, name in enumerate(names):
        if not name.strip():  # saved as is, the target stage (PCTConfig.source_names) refused it only later
            raise ValueError(f"--names: source {i + 1} has an empty name; give each source a non-empty name")
        if name in names[:i]:
            raise ValueError(f"--names: {name!r} is given to sources {names.index(name) + 1} and {i + 1}; "
                             "each source needs its own name")


def check_out_dir(out: str, what: str) -> None:
    """Refuses, before any work, an output folder that is a file or lies under a file.

    ``os.makedirs`` would otherwise end the command with a ``FileExistsError``/``NotADirectoryError`` traceback.

    Args:
        out: The output folder as given.
        what: How the command line names it (``--out``, ``out``), for the message.

    Raises:
        ConfigError: Naming the path and the file in the way.
    """
    from peftplug.errors import ConfigError
    from peftplug.fileio import nearest_existing

    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{what} {out!r} is a file; give a folder to write (nothing was touched)")
    parent = nearest_existing(os.path.dirname(path))
    if not parent.is_dir():
        raise ConfigError(f"{what} {out!r}: {str(parent)!r} is a file, not a folder (nothing was touched)")


PROG = "peftplug pct"  # also runs as python -m prompt_transfer.cli


def main(argv: list[str] | None = None) -> int:
    """Entry point, inside peftplug's error boundary: an input error (bad recipe value, adapter folder, data file)
    prints ``python -m prompt_transfer.cli: error: <one line>`` and returns 2; ``--debug`` or ``PEFTPLUG_DEBUG=1``
    adds its traceback.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
    """
    from peftplug.errors import run_command

    return run_command(PROG, _run, sys.argv[1:] if argv is None else argv)


def _load_source_prompts(names: list[str], adapters: list[str]) -> dict:
    """The prompt of each source adapter folder, each folder checked first (a missing or damaged file, an adapter
    of the wrong type: one line naming the folder)."""
    import prompt_transfer as pt
    from peftplug.checkpoints import check_adapter_dir
    from peftplug.errors import CheckpointError

    prompts = {}
    for name, path in zip(names, adapters):
        check_adapter_dir(path)
        try:
            prompts[name] = pt.load_source_prompt(path)
        except ValueError as err:  # e.g. "holds a 'LORA' adapter, not PROMPT_TUNING/PCT"
            raise CheckpointError(f"source adapter {path!r}: {err}") from err
    return prompts


def _run(argv: list[str]) -> int:
    """Parses and runs one command (see :func:`main`).

    Args:
        argv: Arguments without the program name.
    """
    import prompt_transfer as pt
    from peftplug.errors import CheckpointError, ConfigError

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train-sources", help="train one PEFT prompt-tuning adapter per source task of a recipe")
    t.add_argument("--config", required=True,
                   help="multi-source recipe, e.g. recipes/prompt_transfer/minilm_sources.yaml")
    t.add_argument("--out-dir", help="overrides the recipe's out_dir")
    t.add_argument("--no-decompose", action="store_true", help="skip the recipe's decompose section")
    d = sub.add_parser("decompose", help="SVD + contrastive decomposition of saved source prompt adapters")
    d.add_argument("adapters", nargs="+", help="PEFT prompt-tuning adapter directories, one per source task")
    d.add_argument("--names", nargs="+", help="distinct source task names, one per adapter (default: the directory "
                   "names; where two are alike, the parent folders that tell them apart)")
    d.add_argument("--out", required=True)
    group = d.add_mutually_exclusive_group()
    group.add_argument("--rank", type=int)
    group.add_argument("--explained-variance", type=float)
    d.add_argument("--contrastive-weight", type=float, default=0.1)
    d.add_argument("--contrastive-steps", type=int, default=200)
    e = sub.add_parser("export", help="collapse a saved PCT adapter into a plain PEFT prompt-tuning adapter")
    e.add_argument("pct_adapter")
    e.add_argument("out")
    from peftplug.flags import underscore_flags  # one flag spelling across peftplug: --out_dir (or --out-dir)

    args = underscore_flags(parser).parse_args(argv)

    if args.command == "train-sources":
        from prompt_transfer.source import validate_sources_recipe

        try:  # a bad recipe is a usage error: one line and exit status 2, before any model loads
            recipe = load_recipe(args.config)
            check_recipe_outputs(validate_sources_recipe({**recipe,
                                                          **({"out_dir": args.out_dir} if args.out_dir else {})}))
        except ValueError as err:
            parser.error(str(err))
        summary = train_sources(recipe, out_dir=args.out_dir, decompose=not args.no_decompose)
        print(json.dumps(summary))
    elif args.command == "decompose":
        if args.names and len(args.names) != len(args.adapters):
            parser.error(f"--names has {len(args.names)} names for {len(args.adapters)} adapters")
        try:  # a name shared by two sources would silently keep only one of them
            check_sources(args.adapters, args.names)
            names = args.names or default_source_names(args.adapters)
        except ValueError as err:
            parser.error(str(err))
        check_out_dir(args.out, "--out")
        prompts = _load_source_prompts(names, args.adapters)
        try:  # decompose checks its arguments and the prompts' shapes before computing anything
            base_model = pt.source_base_model(dict(zip(names, args.adapters)))
            dec = pt.decompose(prompts, rank=args.rank, explained_variance=args.explained_variance,
                               contrastive_weight=args.contrastive_weight, contrastive_steps=args.contrastive_steps,
                               base_model=base_model)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        pt.save_decomposition(dec, args.out)
        print(json.dumps({"out": args.out, "rank": dec.rank, "sources": names,
                          "explained_variance_kept": dec.settings["explained_variance_kept"]}))
    else:
        from peftplug.checkpoints import check_adapter_dir

        check_adapter_dir(args.pct_adapter)
        check_out_dir(args.out, "out")
        try:
            print(pt.export_adapter_dir(args.pct_adapter, args.out))
        except ValueError as err:  # "holds a LORA adapter, not PCT"
            raise CheckpointError(f"PCT adapter {args.pct_adapter!r}: {err}") from err
    return 0


if __name__ == "__main__":
    sys.exit(main())
