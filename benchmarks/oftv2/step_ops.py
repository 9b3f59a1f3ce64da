"""Where a SmolLM2-135M training step spends its CPU time, op by op: OFTv2 b32 against LoRA r16, each run alone.

The overhead study's whole-model part (:mod:`benchmarks.oftv2.overhead_llm`) times the step ratio with every
configuration alive in one process, interleaved; its compiled ratio stays 1–6 % above 1.00 run after run, inside its
noise. This tool asks the same question another way. Each adapter's model (``overhead_llm.adapted_model``, every
linear layer adapted, batch × seq random tokens, step = forward + backward + AdamW) is built, compiled or not, warmed
up, timed for ``--steps`` steps and profiled for one more, then dropped before the next adapter's is built. The
result splits the profiled step by ATen op (self CPU time): the base model's matrix products are the same work in both
models, so the difference in ``aten::mm`` plus OFTv2's ``bmm`` / ``baddbmm`` is what the adapters' products cost.
``--order`` runs the adapters in the given order (run both orders: the adapter measured second can be a few percent
slower or faster for reasons of the process, not the adapter).

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.oftv2.step_ops --label NAME [--order "LoRA r16" "OFTv2 b32"]`` writes
``benchmarks/oftv2/results/overhead/step_ops_NAME.json``; the overhead page's notes quote it. ``--quick``: a tiny
random Llama and dynamo's eager backend (a smoke run, nothing written unless ``--out-dir``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.timing import lm_train_step
from benchmarks.oftv2.overhead_llm import ADAPTERS, OTHER_ADAPTERS, adapted_model
from benchmarks.oftv2.overhead_report import write_study

#: The ops the page's notes compare: the matrix products (the base model's and the adapters').
PRODUCTS = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm")


def measure(adapter: str, args) -> dict:
    """Builds, warms up, times and profiles one adapter's step.

    Args:
        adapter: One of ``overhead_llm.ADAPTERS`` or ``OTHER_ADAPTERS`` (stacked ones included).
        args: The command line (:func:`parse_args`).

    Returns:
        ``{"step_cpu_s": [...], "median_step_cpu_s", "ops": {name: {"self_cpu_ms", "calls"}}}`` (ops: the profiled
        step's ``--top`` ops by self CPU time, plus every op of :data:`PRODUCTS`).
    """
    model = adapted_model(adapter, args.quick)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    run = torch.compile(model, backend="eager" if args.quick else "inductor") if args.compiled else model
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for _ in range(args.warmup):
        lm_train_step(run, opt, ids)
    times = []
    for _ in range(args.steps):
        start = time.process_time()
        lm_train_step(run, opt, ids)
        times.append(time.process_time() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lm_train_step(run, opt, ids)
    averages = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = {e.key: {"self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
           for i, e in enumerate(averages) if i < args.top or e.key in PRODUCTS}
    del run, model, opt
    gc.collect()
    torch._dynamo.reset()
    return {"step_cpu_s": times, "median_step_cpu_s": statistics.median(times), "ops": ops}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).

    Raises:
        SystemExit: For an unknown adapter in ``--order``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="run")
    parser.add_argument("--order", nargs="+", default=["OFTv2 b32", "LoRA r16"], choices=ADAPTERS + OTHER_ADAPTERS)
    parser.add_argument("--eager", dest="compiled", action="store_false", help="eager steps (default: compiled)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=12, help="ops kept besides the products, by self CPU time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None, help="results folder (default: the committed one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.warmup, args.steps = 1, 8, 1, 1
    return args


def main(argv=None) -> int:
    """Measures every adapter of ``--order`` in turn and writes the result file.

    Args:
        argv: Command-line arguments.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    adapters = {adapter: measure(adapter, args) for adapter in args.order}
    for adapter, rec in adapters.items():
        products = {k: round(v["self_cpu_ms"], 1) for k, v in rec["ops"].items() if k in PRODUCTS}
        print(f"{adapter}: median step {rec['median_step_cpu_s']:.3f} s; products (ms): {products}", flush=True)
    write_study("step_ops", args, ("order", "compiled", "batch", "seq", "warmup", "steps", "threads", "quick"),
                {"adapters": adapters})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
