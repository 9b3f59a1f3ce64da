"""``peftplug export``: the adapter (or the merged model) of a ``peftplug fit`` checkpoint, written as a folder.

The target is checked before anything is loaded or written: a file, a non-empty folder without ``--overwrite``,
and (with ``--overwrite``) a non-empty folder that is not an earlier export are refused in one line, untouched.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from peftplug.errors import ConfigError

# What a folder written by `peftplug export` (or save_pretrained) holds: only such a folder may be overwritten.
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
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"--output {str(target)!r} exists and is not empty; use --overwrite to replace an earlier "
                          "export, or another folder (nothing was touched)")
    if not any((target / name).is_file() for name in _EXPORT_MARKERS):
        raise ConfigError(f"--output {str(target)!r} holds files but is not an adapter or model folder (no "
                          f"{' or '.join(_EXPORT_MARKERS)}); --overwrite replaces only earlier exports "
                          "(nothing was touched)")


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
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output directory written by an earlier export")
    args = parser.parse_args(list(argv))
    check_export_target(args.output, args.overwrite)  # before the (slow) model load, and before anything is written
    from peftplug.checkpoints import load_checkpoint_module

    module = load_checkpoint_module(args.ckpt_path, map_location="cpu")
    path = module.export(args.output, merge=args.merge, overwrite=args.overwrite)
    print(f"wrote {'merged model' if args.merge else 'adapter'} to {path}")
    return 0
