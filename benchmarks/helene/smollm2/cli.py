"""The commands of the SmolLM2 HELENE benchmark (``python -m benchmarks.helene.smollm2 COMMAND``): work through the
grid's queue, measure memory and speed, probe the renderings, write the page. The grid itself:
:mod:`benchmarks.helene.smollm2.grid`; one run: :mod:`benchmarks.helene.smollm2.runs`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.device import parse_shard
from benchmarks.common.pages import write_json
from benchmarks.common.paths import REPO, data_dir
from benchmarks.helene.smollm2 import runs
from benchmarks.helene.smollm2.grid import (
    PHASES,
    SWEEP_SEED,
    TASKS,
    queue,
    shard_members,
    unfinished_sweep_points,
)
from benchmarks.helene.smollm2.measure import MEMORY_MODES
from benchmarks.helene.smollm2.report import write_report
from benchmarks.helene.smollm2.runs import CACHE, RUNS, execute, load_result


def run_queue(limit: int | None, phase: str = "all", shard: tuple[int, int] = (0, 1), write_page: bool = True,
              poll_seconds: float = 30.0, max_wait: float = 3600.0) -> None:
    """Runs unfinished runs in priority order (re-reading the queue after each, as sweeps select lrs).

    Args:
        limit: Stop after this many runs (``None``: until nothing is left).
        phase: ``all``, ``first`` or ``main`` (see :func:`phase_specs`).
        shard: ``(I, N)``: this process's share of the phase (see :func:`shard_members`), so N processes (on one
            GPU, say) share the work without overlap.
        write_page: Rewrite the page after each run (off for shards: one page writer at the end).
        poll_seconds: With nothing of its own left while another shard's sweep runs (phases ``first`` and
            ``all``), how often a shard looks again for an edge extension that may fall to it.
        max_wait: How long it looks without any sweep finishing before it gives up (a crashed shard's run never
            finishes).
    """
    done = 0
    waited, unfinished = 0.0, None
    while limit is None or done < limit:
        pending = [s for s in shard_members(phase, shard) if load_result(s) is None]
        if not pending:
            left = unfinished_sweep_points() if phase in ("all", "first") and shard[1] > 1 else 0
            if left != unfinished:  # a sweep point finished (or appeared) elsewhere: the wait starts over
                waited, unfinished = 0.0, left
            if left and waited < max_wait:
                time.sleep(poll_seconds)
                waited += poll_seconds
                continue
            print("queue: nothing left that can run", flush=True)
            break
        spec = pending[0]
        print(f"{time.strftime('%H:%M:%S')} start {spec.run_id}", flush=True)
        result = execute(spec)
        print(f"{time.strftime('%H:%M:%S')} done  {spec.run_id}: test_acc {result['test_acc']:.4f} "
              f"({result['seconds']:.0f} s)", flush=True)
        done += 1
        if not write_page:
            continue
        try:
            report()
        except Exception as err:  # noqa: BLE001 - a broken page must not stop the queue: the runs are what cost hours
            print(f"report failed: {type(err).__name__}: {err}", flush=True)


def _subprocess(args: list[str]) -> None:
    # The repo first, then whatever the caller had on the path (a GPU machine's wheels, say).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "benchmarks.helene.smollm2.measure", *args, "--device", runs.DEVICE],
                   check=True, env=env)


def memory() -> None:
    """Peak RSS of each mode in a fresh process (the peak is per process)."""
    from peftplug.loading import resolve_model_path

    # A fresh checkout converts the packaged GGUF on first load, which would land in the first mode's peak (it
    # once put inference at 1.5x its steady value): convert here, outside every measured process.
    resolve_model_path(runs.MODEL)
    for mode in MEMORY_MODES:
        print(f"memory: {mode}", flush=True)
        _subprocess(["--memory", mode, "--out", str(CACHE / runs.measurement_file("memory", mode))])


def probe() -> None:
    """Zero-shot accuracy of both renderings on the seed-42 train+dev examples (64 per binary task)."""
    from itertools import chain

    from peftplug.loading import load_model, load_tokenizer
    from peftplug.prompt_cls import PromptClassificationData, predict_labels

    tokenizer = load_tokenizer(runs.MODEL)
    model = load_model(runs.MODEL, "prompt_cls").eval()
    rows = []
    for task in TASKS:
        for fmt in ("plain", "chat"):
            data = PromptClassificationData(task, data_dir=str(data_dir()), split_seed=SWEEP_SEED, format=fmt,
                                            batch_size=16, max_test=1)
            data.tokenizer = tokenizer
            data.setup()
            predicted, labels = predict_labels(
                model, chain(*(data._loader(split, shuffle=False) for split in ("train", "validation"))))
            correct, total = int((predicted == labels).sum()), len(labels)
            lengths = data.token_lengths()
            rows.append({"task": task, "format": fmt, "acc": correct / total, "n": total, "template": data.template,
                         "label_words": list(data.words), "mean_tokens": lengths["train"][0],
                         "max_tokens": lengths["train"][1]})
            print(rows[-1], flush=True)
    write_json(CACHE / "probe.json", rows)


def report(page: Path | None = None) -> bool:
    """Writes docs/benchmarks/helene_llm.md (and its plots) from whatever has finished.

    Args:
        page: Another page to write (default: the docs page).

    Returns:
        True (the grid's page always renders: what has not finished is listed as such).
    """
    write_report(queue(), page)
    return True


def main(argv: list[str] | None = None) -> None:
    """Runs one command (see :mod:`benchmarks.helene.smollm2.grid` for the list).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("run", "report", "memory", "speed", "probe", "queue"))
    parser.add_argument("--limit", type=int, default=None, help="run: stop after this many runs")
    parser.add_argument("--phase", choices=PHASES, default="all",
                        help="run: 'first' = zero-shot + lr sweeps, 'main' = the 300-step core grid (needs the "
                             "sweeps), 'followup' = the runs after it (FOLLOW_UPS)")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="run: this process's share of the phase (N processes, e.g. on one GPU)")
    parser.add_argument("--no-report", action="store_true", help="run/memory/speed: do not rewrite the page")
    parser.add_argument("--device", default=runs.DEVICE, help="cpu, cuda or auto (cuda when available)")
    args = parser.parse_args(argv)
    try:
        runs.set_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    RUNS.mkdir(parents=True, exist_ok=True)
    if args.command == "run":
        run_queue(args.limit, args.phase, args.shard, write_page=not args.no_report)
    elif args.command == "report":
        report()
    elif args.command == "memory":
        memory()
        if not args.no_report:
            report()
    elif args.command == "speed":
        _subprocess(["--speed", "--out", str(CACHE / runs.measurement_file("speed"))])
        if not args.no_report:
            report()
    elif args.command == "probe":
        probe()
    else:
        for spec, why in queue():
            state = "blocked: " + why if spec is None else ("done" if load_result(spec) else "pending")
            print(f"{'' if spec is None else spec.run_id:70s} {state}")


if __name__ == "__main__":
    main()
