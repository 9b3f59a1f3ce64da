"""``python -m peftplug.data.lmbff_cli TASK... --data-dir DIR``: LM-BFF's k-shot folders written from the hub copies
(:func:`peftplug.data.lmbff.write_kshot_folder`), once with network access, for ``data.source: folder`` offline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from peftplug.data.lmbff import HUB_SOURCES, LMBFF_SEEDS, write_kshot_folder
from peftplug.datadir import DATA_DIR_ENV, default_data_dir
from peftplug.errors import run_command
from peftplug.flags import underscore_flags


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m peftplug.data.lmbff_cli TASK... --data-dir DIR``: writes LM-BFF-layout k-shot folders from the hub.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
    """
    def command(args: list[str]) -> int:
        parser = argparse.ArgumentParser(prog="peftplug kshot", description=(
            "Sample LM-BFF's k-shot splits from the Hugging Face hub copies and write them in LM-BFF's folder "
            f"layout, for data.source: folder (offline). Tasks: {', '.join(HUB_SOURCES)} or catalogue names."))
        parser.add_argument("tasks", nargs="+", help="LM-BFF task folders (SST-2, RTE, ...) or catalogue tasks")
        parser.add_argument("--data-dir", required=True, help=(
            f"folder to write k-shot/ under; then use it as data.data_dir or ${DATA_DIR_ENV} (the default data "
            f"folder, {default_data_dir()}, is read-only data of this checkout: not a target)"))
        parser.add_argument("--k", type=int, default=16, help="rows per class (LM-BFF: 16; MeZO also 512)")
        parser.add_argument("--seeds", type=int, nargs="+", default=list(LMBFF_SEEDS), help="split seeds")
        ns = underscore_flags(parser).parse_args(args)
        for task in ns.tasks:
            print(f"wrote {write_kshot_folder(task, ns.data_dir, ns.k, ns.seeds)}", file=sys.stderr)
        return 0

    # Named as the user runs it (`peftplug kshot`, its usage line's name too), not by its module path.
    return run_command("peftplug kshot", command, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
