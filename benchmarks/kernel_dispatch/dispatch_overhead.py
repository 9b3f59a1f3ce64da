"""Per-call CPU cost of the ``torch.library`` dispatcher vs calling the autograd Function directly (eager mode).

unsloth measured ~20 µs per custom-op call and bypasses the dispatcher in eager mode. This measures our own
registration (:mod:`peftplug_kernels.library`) against the autograd Functions (``*/function.py``) on this CPU.
Triton's kernels run on CPU only in the (very slow) interpreter, so both paths get the same stand-in kernel module:
torch implementations of ``block_matmul`` / ``block_grad_rotation`` / ``cayley_neumann_forward`` / ``_backward`` on
tiny tensors, installed where ``load_kernel_module`` finds the Triton module. The stand-in costs the same in both
paths, so the difference of the medians is the dispatch. Also timed: the ops-level hot path with a resolved
``impl="triton"`` (``peftplug_kernels.ops``) against the full ``resolve_impl`` check the ops ran on every call
before (issue 40).

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.kernel_dispatch.dispatch_overhead`` (about a minute); prints a
Markdown table and writes ``benchmarks/kernel_dispatch/results/dispatch_overhead.json``. On a GPU,
``--device cuda`` runs the real Triton kernels instead of the stand-ins (launches are asynchronous, so the CPU
time per call is still the dispatch and launch overhead; written to ``dispatch_overhead_cuda.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import ModuleType

import torch

from benchmarks.common.pages import write_json
from benchmarks.common.paths import results_dir
from benchmarks.common.provenance import provenance, provenance_line
from benchmarks.common.timing import interleaved


def _install_stand_in_kernels() -> None:
    """Torch stand-ins for the Triton wrappers, where ``load_kernel_module`` looks (before any real import)."""
    from peftplug_kernels.block_rotate import reference as rotate_ref
    from peftplug_kernels.cayley_neumann import reference as cn_ref

    rotate = ModuleType("peftplug_kernels.block_rotate.triton")
    rotate.block_matmul = lambda x2, r, transpose=False: rotate_ref.block_rotate(x2, r.transpose(-1, -2) if transpose
                                                                                 else r)
    rotate.block_grad_rotation = lambda x2, g2, n, b: torch.einsum(
        "trk,trc->rkc", x2.reshape(x2.shape[0], -1, b), g2.reshape(g2.shape[0], -1, b)).float()
    rotate.block_rotate_backward = lambda x2, g2, r, need_x=True, need_r=True: (
        rotate.block_matmul(g2, r, transpose=True) if need_x else None,
        rotate.block_grad_rotation(x2, g2, r.shape[0], r.shape[-1]) if need_r else None)
    cn = ModuleType("peftplug_kernels.cayley_neumann.triton")
    cn.cayley_neumann_forward = lambda q, b, terms, form: cn_ref.cayley_neumann(q, b, terms, form)
    cn.cayley_neumann_backward = lambda q, g, terms, form: torch.zeros_like(q, dtype=torch.float32)
    rotate.INTERPRETED = cn.INTERPRETED = True  # what ops.resolve_impl checks for CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules[rotate.__name__], sys.modules[cn.__name__] = rotate, cn


def _cases(device: str = "cpu") -> dict:
    from peftplug_kernels import library, ops
    from peftplug_kernels.block_rotate.function import BlockRotateFunction
    from peftplug_kernels.cayley_neumann.function import CayleyNeumannFunction

    x = torch.randn(8, 64, device=device, requires_grad=True)
    rotation = torch.randn(2, 32, 32, device=device, requires_grad=True)
    grad = torch.randn(8, 64, device=device)
    q = (0.1 * torch.randn(2, 496, device=device)).requires_grad_(True)
    grad_r = torch.randn(2, 32, 32, device=device)

    def fwd_bwd(run, g):
        return lambda: run().backward(g)

    ops.resolve_impl("triton", x, rotation, op="block_rotate")  # verified once, as a layer's first forward does
    ops._TRITON_OK.add(("block_rotate", x.is_cuda))  # on CPU too: the hot path as on CUDA
    return {
        "block_rotate fwd: Function": lambda: BlockRotateFunction.apply(x, rotation),
        "block_rotate fwd: custom op": lambda: torch.ops.peftplug.block_rotate(x, rotation, False),
        "block_rotate fwd+bwd: Function": fwd_bwd(lambda: BlockRotateFunction.apply(x, rotation), grad),
        "block_rotate fwd+bwd: custom op": fwd_bwd(lambda: torch.ops.peftplug.block_rotate(x, rotation, False), grad),
        "cayley_neumann fwd: Function": lambda: CayleyNeumannFunction.apply(q, 32, 5, "cayley_neumann"),
        "cayley_neumann fwd: custom op": lambda: torch.ops.peftplug.cayley_neumann(q, 32, 5, "cayley_neumann"),
        "cayley_neumann fwd+bwd: Function": fwd_bwd(
            lambda: CayleyNeumannFunction.apply(q, 32, 5, "cayley_neumann"), grad_r),
        "cayley_neumann fwd+bwd: custom op": fwd_bwd(
            lambda: torch.ops.peftplug.cayley_neumann(q, 32, 5, "cayley_neumann"), grad_r),
        "ops.block_rotate fwd, impl resolved (hot path)": lambda: ops.block_rotate(x, rotation, impl="triton"),
        "library.block_rotate fwd (no ops wrapper)": lambda: library.block_rotate(x, rotation),
        "resolve_impl('triton') alone (was per call)": lambda: ops.resolve_impl("triton", x, rotation,
                                                                                 op="block_rotate"),
    }


def measure(rounds: int, calls: int, device: str = "cpu") -> dict:
    """Median CPU (thread) time per call of every case, interleaved round by round.

    Args:
        rounds: Interleaved rounds.
        calls: Calls per timed sample.
        device: ``"cpu"`` (stand-in kernels) or ``"cuda"`` (the real ones).
    """
    cases = _cases(device)

    def sample(name: str) -> float:
        run = cases[name]
        start = time.thread_time_ns()
        for _ in range(calls):
            run()
        return (time.thread_time_ns() - start) / calls / 1000.0

    times = interleaved(list(cases), sample, rounds=rounds, steps_per_round=1, warmup=2)
    return {name: statistics.median(values) for name, values in times.items()}


def table(us: dict) -> str:
    """Markdown table of the medians plus the dispatcher's extra cost per op and direction."""
    lines = ["| case | µs per call (CPU time, median) |", "|---|---|"]
    lines += [f"| {name} | {value:.1f} |" for name, value in us.items()]
    lines += ["", "| dispatcher cost (custom op − Function) | µs per call |", "|---|---|"]
    for op in ("block_rotate fwd", "block_rotate fwd+bwd", "cayley_neumann fwd", "cayley_neumann fwd+bwd"):
        lines.append(f"| {op} | {us[f'{op}: custom op'] - us[f'{op}: Function']:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="cuda: the real Triton kernels on the GPU")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "cpu":
        _install_stand_in_kernels()
    us = measure(args.rounds, args.calls, args.device)
    prov = provenance(("benchmarks/kernel_dispatch", "peftplug_kernels"))
    print(table(us))
    print(provenance_line(prov))
    if not args.no_write:
        name = "dispatch_overhead.json" if args.device == "cpu" else "dispatch_overhead_cuda.json"
        write_json(results_dir("kernel_dispatch") / name, {"us_per_call": us, "rounds": args.rounds,
                                                            "calls": args.calls, "device": args.device,
                                                            "provenance": prov})


if __name__ == "__main__":
    main()
