"""Commands of the equal-forward-pass comparison (``python -m benchmarks.helene.smollm2.budget_cli COMMAND``).

    run [--phase P] [--shard I/N] [--limit K]   work through the queue (resumable), rewriting the page after each run
    queue [--phase P] [--shard I/N]             every item: done, pending (with its shard) or waiting (and why)
    report                                      docs/benchmarks/helene_budget.md (+ its plots) and docs/helene.md's
                                                "Beating MeZO" section from the results
    memory [--modes ...]                        peak RSS per optimizer and of nf4 inference, a fresh process each
    replay RUN_ID                               run a recorded result again from its closure values; exit 1 on a
                                                difference

Background runs, one process per core (the queue: :mod:`benchmarks.helene.smollm2.budget`)::

    for i in 0 1; do OMP_NUM_THREADS=1 setsid nohup .venv/bin/python -m benchmarks.helene.smollm2.budget_cli run \\
        --shard $i/2 --no-report > runs/helene_budget/shard$i.log 2>&1 & done
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.device import parse_shard
from benchmarks.common.pages import read_json
from benchmarks.common.paths import REPO
from benchmarks.helene.smollm2 import budget, budget_run, runs
from benchmarks.helene.smollm2.budget import PHASES, load_result, queue, shard_members, waiting
from benchmarks.helene.smollm2.budget_memory import modes
from benchmarks.helene.smollm2.budget_report import HELENE_DOC, write_report


def _finished() -> int:
    return len(list(budget.RUNS.glob("*.json"))) if budget.RUNS.is_dir() else 0


def run_queue(limit: int | None, phase: str = "all", shard: tuple[int, int] = (0, 1), write_page: bool = True,
              poll_seconds: float = 60.0, max_wait: float = 3 * 3600.0) -> int:
    """Runs this shard's unfinished runs in queue order, re-reading the queue after each (sweeps select lrs, main
    runs pick the best optimizers). Returns the number of runs made.

    Args:
        limit: Stop after this many runs (``None``: until nothing is left).
        phase: One of :data:`benchmarks.helene.smollm2.budget.PHASES`.
        shard: ``(I, N)``: this process's share (see :func:`benchmarks.helene.smollm2.budget.shard_members`).
        write_page: Rewrite the page after each run (the shards of a background launch leave it to ``report``).
        poll_seconds: With nothing of its own runnable while items wait for runs elsewhere, how often to look again.
        max_wait: How long to look without any run finishing anywhere before giving up (a crashed shard's runs
            never finish).
    """
    done, waited, seen = 0, 0.0, None
    while limit is None or done < limit:
        pending = [s for s in shard_members(phase, shard) if load_result(s) is None]
        if not pending:
            count = _finished()
            if count != seen:  # something finished elsewhere: the wait starts over
                waited, seen = 0.0, count
            if waiting(phase) and waited < max_wait:
                time.sleep(poll_seconds)
                waited += poll_seconds
                continue
            print("queue: nothing left that can run", flush=True)
            break
        spec = pending[0]
        print(f"{time.strftime('%H:%M:%S')} start {spec.run_id}", flush=True)
        result = budget_run.execute(spec)
        points = ", ".join(f"{t['budget']}: {t['acc']:.4f}" for t in result["tests"])
        print(f"{time.strftime('%H:%M:%S')} done  {spec.run_id}: test {points} ({result['seconds']:.0f} s)", flush=True)
        done += 1
        if write_page:
            try:
                write_report(doc=HELENE_DOC)
            except Exception as err:  # noqa: BLE001 - a broken page must not stop the queue: the runs cost hours
                print(f"report failed: {type(err).__name__}: {err}", flush=True)
    return done


def print_queue(phase: str = "all", shards: int = 2) -> None:
    """Prints every item of ``phase`` with its state (and, for runnable ones, the shard of ``shards`` it is in)."""
    owner = {s.run_id: i for i in range(shards) for s in shard_members(phase, (i, shards))}
    for name, spec, why in queue():
        if not budget.in_phase(name, phase):
            continue
        if spec is None:
            print(f"{name:30s} {'':70s} waiting: {why}")
            continue
        state = "done" if load_result(spec) else f"pending (shard {owner.get(spec.run_id, '?')}/{shards})"
        print(f"{name:30s} {spec.run_id:70s} {state}")


def memory(selected: list[str]) -> None:
    """Peak RSS of each mode in a fresh process (``memory_<mode>.json`` beside the runs)."""
    from peftplug.loading import resolve_model_path

    resolve_model_path(runs.MODEL)  # a fresh checkout converts the GGUF once, outside every measured process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for mode in selected:
        print(f"memory: {mode}", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.helene.smollm2.budget_memory", "--mode", mode, "--out",
                        str(budget.CACHE / f"memory_{mode}.json"), "--device", runs.DEVICE], check=True, env=env)


#: The memory modes measured by default: inference, each optimizer of the comparison, and ZO on nf4.
DEFAULT_MEMORY = ("inference", "nf4_inference", "mezo", "mezo_rademacher", "zoadam", "fzoo4", "fzoo8",
                  "helene_scalar", "hizoo", "mezo_nf4", "fzoo4_nf4", "helene_scalar_nf4")


def replay_command(run_id: str) -> int:
    """Replays a committed result (``run_id`` or a path to its JSON) and prints what differs; 0 when nothing."""
    path = Path(run_id) if run_id.endswith(".json") else budget.RUNS / f"{run_id}.json"
    recorded = read_json(path)
    if recorded is None:
        raise SystemExit(f"replay: no result at {path}")
    with tempfile.TemporaryDirectory() as scratch:
        report = budget_run.replay(recorded, Path(scratch))
    print(f"replay of {report['run_id']}: {'identical' if report['same'] else 'DIFFERS'} "
          f"({report['seconds']:.0f} s)")
    for line in report["differences"]:
        print("  " + line)
    return 0 if report["same"] else 1


def main(argv: list[str] | None = None) -> int:
    """Runs one command (see the module docstring).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "queue", "report", "memory", "replay"))
    parser.add_argument("run_id", nargs="?", help="replay: the run (its id or the path of its JSON)")
    parser.add_argument("--phase", choices=PHASES, default="all")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N")
    parser.add_argument("--limit", type=int, default=None, help="run: stop after this many runs")
    parser.add_argument("--no-report", action="store_true", help="run: do not rewrite the page after each run")
    parser.add_argument("--modes", nargs="+", choices=modes(), default=list(DEFAULT_MEMORY), help="memory: modes")
    parser.add_argument("--device", default=runs.DEVICE, help="cpu, cuda or auto (cuda when available)")
    args = parser.parse_args(argv)
    try:
        runs.set_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    if args.command == "run":
        budget.RUNS.mkdir(parents=True, exist_ok=True)
        run_queue(args.limit, args.phase, args.shard, write_page=not args.no_report)
    elif args.command == "queue":
        print_queue(args.phase, args.shard[1] if args.shard[1] > 1 else 2)
    elif args.command == "report":
        write_report(doc=HELENE_DOC)
    elif args.command == "memory":
        memory(args.modes)
        write_report()
    else:
        if not args.run_id:
            parser.error("replay needs a RUN_ID")
        return replay_command(args.run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
