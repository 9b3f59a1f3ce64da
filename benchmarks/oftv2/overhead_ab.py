"""A/B of two code trees on the per-layer overhead stack, in alternating processes: is a change faster than noise?

Why: on the shared 2-core machines of this project one process's timings move ±5–10 % against another's (the base
stack alone: 34–38 ms for 60 calls in four processes within ten minutes), more than most changes to the OFTv2 forward
save. Ratios within one process are steadier, and alternating the two trees process by process spreads the
machine's drift over both. Each process builds the stack of :mod:`benchmarks.oftv2.overhead` (frozen
``nn.Linear(width, width)`` layers, each adapted) from *its own tree's* code, times forward + backward of every method
interleaved round by round (process CPU time, one torch thread, medians), and reports what each adapter adds to a
layer and its ratio to LoRA r16 in the same process.

Run (``B`` is usually this checkout, ``A`` a ``git worktree add /tmp/a <commit>`` of the code before a change)::

    python -m benchmarks.oftv2.overhead_ab --trees /tmp/a . --labels before after --name lookups

It prints a table and writes ``benchmarks/oftv2/results/overhead/ab_<name>.json``. A tree must hold the study's
``overhead.build`` / ``fwd_bwd``, ``overhead_ops.cpu_seconds`` and ``benchmarks.common.timing.interleaved`` (as every
commit since the lean run does); methods its ``build`` does not know are left out of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "oftv2" / "results" / "overhead"
#: The unadapted stack first (every method is read against it), LoRA r16 second (the ratios' anchor).
METHODS = ("base", "LoRA r16", "OFTv2 b32", "OFTv2 b32 stacked")


def worker(width: int, layers: int, tokens: int, rounds: int, iters: int) -> dict[str, float]:
    """Runs in a tree's process: µs each method adds to a layer (median over rounds), keyed by method.

    Args:
        width: Layer width.
        layers: Layers in the stack.
        tokens: Tokens of the input.
        rounds: Timed rounds, each timing every method once over ``iters`` calls.
        iters: Forward + backward calls per timed sample.
    """
    import torch

    # This tree's study code: what is timed is its build, through its own clocks.
    from benchmarks.common.timing import interleaved
    from benchmarks.oftv2.overhead import build, fwd_bwd
    from benchmarks.oftv2.overhead_ops import cpu_seconds

    torch.set_num_threads(1)
    x = torch.randn(tokens, width, requires_grad=True)
    runs = {}
    for method in METHODS:
        try:
            runs[method] = fwd_bwd(build(method, width, layers), x)
        except ValueError:  # a method this tree's build does not know
            continue
    samples = interleaved(list(runs), lambda m: cpu_seconds(runs[m], iters) / iters, rounds, 1, warmup=1)
    medians = {m: statistics.median(v) for m, v in samples.items()}
    return {m: (medians[m] - medians["base"]) / layers * 1e6 for m in runs if m != "base"}


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One process in ``tree`` (its code first on the path; this file's worker), its result.

    Args:
        tree: A checkout.
        args: The command line.
    """
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--width", str(args.width), "--layers",
               str(args.layers), "--tokens", str(args.tokens), "--rounds", str(args.rounds), "--iters", str(args.iters)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the run in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(labels: list[str], runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: per label and method, the median added µs per layer over processes and the ratio to LoRA r16
    (mean of the per-process ratios, min–max beside it).

    Args:
        labels: The trees' labels, in order.
        runs: ``{label: [per-process {method: added µs}]}``.
    """
    rows = ["| code | method | added µs / layer (median of processes) | × LoRA r16, mean (min–max) |",
            "|---|---|---:|---:|"]
    for label in labels:
        for method in [m for m in METHODS[1:] if all(m in r for r in runs[label])]:
            ratios = [r[method] / r["LoRA r16"] for r in runs[label]]
            added = statistics.median(r[method] for r in runs[label])
            rows.append(f"| `{label}` | {method} | {added:.0f} | {statistics.mean(ratios):.3f} "
                        f"({min(ratios):.3f}–{max(ratios):.3f}) |")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=Path, nargs=2, metavar=("A", "B"), help="two checkouts")
    parser.add_argument("--labels", nargs=2, default=["A", "B"])
    parser.add_argument("--name", default=None, help="writes results/overhead/ab_<name>.json (default: print only)")
    parser.add_argument("--processes", type=int, default=4, help="processes per tree, alternating A, B, A, B, ...")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and args.trees is None:
        parser.error("--trees A B is required")
    if min(args.processes, args.rounds, args.iters, args.layers, args.tokens) < 1:
        parser.error("--processes, --rounds, --iters, --layers and --tokens must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.width, args.layers, args.tokens, args.rounds, args.iters)))
        return 0
    from benchmarks.common.pages import write_json
    from benchmarks.common.provenance import cpu_flags, git_commit
    from benchmarks.oftv2.overhead import CODE

    trees = [t.resolve() for t in args.trees]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in args.labels}
    for _ in range(args.processes):
        for tree, label in zip(trees, args.labels):
            runs[label].append(run_tree(tree, args))
    rows = summarize(args.labels, runs)
    print("\n".join(rows))
    if args.name:
        record = {
            "name": args.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": {label: git_commit(CODE, root=tree) for tree, label in zip(trees, args.labels)},
            "settings": {k: getattr(args, k) for k in ("processes", "width", "layers", "tokens", "rounds", "iters")},
            "cpu_flags": cpu_flags(), "runs": runs, "table": rows,
        }
        print(f"wrote {write_json(RESULTS / f'ab_{args.name}.json', record)}")
    return 0


if __name__ == "__main__":
    # Run as a file (the workers are): its folder would come first on the path, ahead of the tree's packages.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
