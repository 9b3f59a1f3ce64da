"""``peftplug export``: the adapter (or the merged model) of a ``peftplug fit`` checkpoint, written as a folder.

``--as_lora --rank R`` writes an OFTv2 (or QOFT) adapter as a standard PEFT LoRA adapter instead
(:func:`oftv2.export_lora`), for servers that load LoRA only (vLLM, SGLang, TGI): ``R`` a positive integer (clipped
per layer to its full rank) or ``full`` (reproduces the adapter to rounding). A QOFT checkpoint's update is taken
from its dequantized 4-bit (or 8-bit) base weights, so the LoRA reproduces the adapter on that same quantized base.

The target and the arguments are checked before anything is loaded or written: a file, a non-empty folder without
``--overwrite``, (with ``--overwrite``) a non-empty folder that is not an earlier export, and a bad ``--rank`` are
refused in one line, untouched.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peftplug.adapter_export import write_module_base_record
from peftplug.errors import ConfigError, PeftplugError
from peftplug.fileio import nearest_existing
from peftplug.flags import underscore_flags

# What a folder written by `peftplug export` (or save_pretrained) holds: only such a folder may be overwritten.
# (peftplug_base.json is not a marker: an export always has adapter_config.json or config.json beside it.)
_EXPORT_MARKERS = ("adapter_config.json", "config.json")


def check_export_target(output: str, overwrite: bool) -> None:
    """Refuses an export target that would lose data: a file, a non-empty folder without ``--overwrite``, or (with
    ``--overwrite``) a non-empty folder that is not an earlier export.

    Args:
        output: The ``--output`` folder.
        overwrite: Whether ``--overwrite`` was given.

    Raises:
        ConfigError: If the target is refused; nothing has been touched then.
    """
    target = Path(output).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--output {str(target)!r} is a file; give a folder to write (nothing was touched)")
    check_writable_parent(target)
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"--output {str(target)!r} exists and is not empty; use --overwrite to replace an earlier "
                          "export, or another folder (nothing was touched)")
    if not any((target / name).is_file() for name in _EXPORT_MARKERS):
        raise ConfigError(f"--output {str(target)!r} holds files but is not an adapter or model folder (no "
                          f"{' or '.join(_EXPORT_MARKERS)}); --overwrite replaces only earlier exports "
                          "(nothing was touched)")


def check_writable_parent(target: Path) -> None:
    """Refuses, before the model is loaded, an ``--output`` whose folder cannot be created or replaced there.

    The export is written into a staging folder beside ``target`` and renamed onto it, so it needs to write in
    ``target``'s parent (or the nearest folder above it that exists), and ``target`` must not be a mount point
    (a mount point cannot be renamed).

    Args:
        target: The ``--output`` folder.

    Raises:
        ConfigError: If a path component is a file, the folder to write in is not writable (permissions, a read-only
            file system), or ``target`` is a mount point.
    """
    absolute = Path(os.path.abspath(target))
    if absolute.is_dir() and os.path.ismount(absolute):
        raise ConfigError(f"--output {str(target)!r} is a mount point, which an export cannot replace (it is written "
                          "beside its target and renamed onto it); give a folder inside it (nothing was touched)")
    parent = nearest_existing(absolute.parent)
    if not parent.is_dir():
        raise ConfigError(f"--output {str(target)!r}: {str(parent)!r} is a file, not a folder (nothing was touched)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {str(target)!r}: cannot write in {str(parent)!r} (not writable: permissions or a "
                          "read-only file system); the export is written beside its target, so give a folder in a "
                          "writable place (nothing was touched)")


def parse_rank(rank: str | None, as_lora: bool, merge: bool) -> int | str | None:
    """The ``--rank`` of ``--as_lora``: a positive integer or ``"full"``; ``None`` without ``--as_lora``.

    Args:
        rank: The ``--rank`` text, or ``None`` when not given.
        as_lora: Whether ``--as_lora`` was given.
        merge: Whether ``--merge`` was given.

    Raises:
        ConfigError: For a rank without ``--as_lora``, ``--as_lora`` without a rank or with ``--merge``, or a rank
            that is not a positive integer or ``full``.
    """
    if not as_lora:
        if rank is not None:
            raise ConfigError("--rank is the LoRA rank of --as_lora; add --as_lora (or drop --rank)")
        return None
    if merge:
        raise ConfigError("--as_lora and --merge exclude each other: --as_lora writes a LoRA adapter, --merge a full "
                          "model")
    if rank is None:
        raise ConfigError("--as_lora needs --rank R: a positive integer (clipped per layer to its full rank) or "
                          "'full' (exact, largest); docs/oftv2.md 'Serving as LoRA' has the trade-off")
    if rank == "full":
        return rank
    if not rank.isdigit() or int(rank) < 1:
        raise ConfigError(f"--rank must be a positive integer or 'full'; got {rank!r}")
    return int(rank)


def export_as_lora(module: Any, output: str, rank: int | str) -> Path:
    """Writes the OFTv2 adapter of a loaded checkpoint as a PEFT LoRA adapter folder, plus the tokenizer and
    ``peftplug_base.json`` (the LoRA reproduces the adapter on the same base, quantization and compute dtype
    included, so ``peftplug.load_adapter`` defaults to that base as for a plain export).

    The folder appears atomically (written beside ``output``, then renamed onto it, replacing an earlier export).

    Args:
        module: The :class:`peftplug.lightning.PeftModule` of the checkpoint.
        output: Target folder (already checked by :func:`check_export_target`).
        rank: From :func:`parse_rank`.

    Raises:
        ConfigError: If the adapter is not OFTv2, or one :func:`oftv2.export_lora` cannot serve as LoRA (biases,
            modules_to_save, trainable tokens).
    """
    import oftv2
    from peftplug.fileio import atomic_directory

    configs = getattr(module.model, "peft_config", {})
    config = configs.get("default")
    if not isinstance(config, oftv2.OFTv2Config):
        kind = getattr(getattr(config, "peft_type", None), "value", None) or "no adapter"
        raise ConfigError(f"--as_lora converts OFTv2 adapters only; this checkpoint's adapter is {kind} (export it "
                          "without --as_lora: it is a PEFT adapter already)")
    target = Path(output).expanduser().resolve()
    with atomic_directory(target, overwrite=True) as staging:
        try:
            oftv2.export_lora(module.model, staging, rank=rank)  # it fills the empty staging folder
        except ValueError as err:
            raise ConfigError(f"--as_lora: {err}") from None
        write_module_base_record(staging, module)
        if module.tokenizer is not None:
            module.tokenizer.save_pretrained(staging)
    return target


def export_main(argv: Sequence[str]) -> int:
    """``peftplug export``: writes the adapter (or the merged model) of a peftplug checkpoint.

    Args:
        argv: Arguments after ``export``.
    """
    parser = argparse.ArgumentParser(
        prog="peftplug export",
        description="Write a PEFT adapter directory (default) or a merged full model from a peftplug checkpoint.",
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by `peftplug fit`")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base (merge_and_unload)")
    parser.add_argument("--as_lora", action="store_true",
                        help="write an OFTv2/QOFT adapter as a standard PEFT LoRA adapter (for vLLM, SGLang, TGI)")
    parser.add_argument("--rank", default=None,
                        help="LoRA rank of --as_lora: a positive integer (clipped per layer) or 'full' (exact)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output directory written by an earlier export")
    args = underscore_flags(parser).parse_args(list(argv))
    rank = parse_rank(args.rank, args.as_lora, args.merge)
    check_export_target(args.output, args.overwrite)  # before the (slow) model load, and before anything is written
    from peftplug.checkpoints import load_checkpoint_module

    module = load_checkpoint_module(args.ckpt_path, map_location="cpu")
    with warnings.catch_warnings():
        # The adapter records the base model by a name that resolves elsewhere (peftplug.loading.recorded_model_name),
        # not by a local folder, so PEFT's check whether the vocabulary was resized cannot read the base's config
        # offline and warns that it assumes it was not. peftplug fit never resizes it: the assumption is right.
        warnings.filterwarnings("ignore", message="Could not find a config file in .* vocabulary was not modified")
        try:
            if rank is not None:
                print(f"wrote LoRA adapter (rank {rank}) to {export_as_lora(module, args.output, rank)}")
                return 0
            path = module.export(args.output, merge=args.merge, overwrite=args.overwrite)
        except OSError as err:
            if isinstance(err, PeftplugError):  # MissingFileError is a FileNotFoundError: already one line
                raise
            # Checked up front, but the disk can fill up, or permissions change, during the write: the staging folder
            # is removed and an earlier export left as it was (peftplug.fileio.atomic_directory).
            where = f" ({err.filename})" if err.filename else ""
            raise ConfigError(f"--output {args.output!r}: the export could not be written: {err.strerror or err}"
                              f"{where}; an earlier export there is unchanged") from err
    print(f"wrote {'merged model' if args.merge else 'adapter'} to {path}")
    return 0
