"""Runs every CPU benchmark in turn (``make bench``); each commits its raw results and writes its page.

Usage: ``python -m benchmarks.run_all [--quick] [--only NAME ...]`` (NAME: a module under ``benchmarks/``, e.g.
``oftv2.cpu``). Re-rendering the pages from the committed results without measuring: ``python -m benchmarks.report``. A failing benchmark is reported and the
others still run; the exit status is non-zero if any failed. The GPU benchmarks are separate:
``bash benchmarks/gpu/run_all.sh`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

# The SmolLM2 benchmarks of HELENE (helene.smollm2), PCT (prompt_transfer.llm) and steering (steering.llm) are
# resumable queues of hours of CPU with their own commands (see their docstrings); they are not part of this sweep.
BENCHMARKS = ("oftv2.cpu", "oftv2.conv", "oftv2.qoft", "oftv2.llm_sft", "helene.minilm.bench",
              "prompt_transfer.minilm", "steering.stories260k")


def main(argv: list[str] | None = None) -> int:
    """Runs the selected benchmarks.

    Args:
        argv: Command-line arguments (``--quick``, ``--only``).

    Returns:
        0 if every benchmark finished, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    args = parser.parse_args(argv)
    failed = []
    for name in args.only:
        start = time.perf_counter()
        print(f"=== benchmarks.{name}", flush=True)
        try:
            result = importlib.import_module(f"benchmarks.{name}").main(["--quick"] if args.quick else [])
            if isinstance(result, int) and result != 0:
                failed.append(name)
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others' results
            traceback.print_exc()
            failed.append(name)
        print(f"=== benchmarks.{name}: {time.perf_counter() - start:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
