"""Does one batched Cayley–Neumann over every adapted layer pay, against one call per layer?

The 1.1B Llama of the first GPU run has 154 adapted linear layers of input width 2048 → 64 blocks of 32 each; every
forward computes each layer's rotation with its own ``ops.cayley_neumann`` call (one Triton launch forward and one
backward on GPU, about a dozen ATen ops forward and twice that backward on the torch path). Batching would
concatenate the 154 triangle tensors, run one call and split the result: one launch instead of 154, at the price of
a concatenation forward and one backward, and a model-level pre-forward step that hands each layer its slice.

Measured here on CPU with the torch path (``impl="torch"``), forward + backward of all layers (the gradient of
``Σ_l <R_l, G_l>`` for fixed random G_l): CPU time per model step (median of interleaved rounds), and the ops
dispatched below autograd (a ``TorchDispatchMode`` count: each non-view op is one kernel launch on a GPU). The
Triton path's launch count follows from the structure (one per call per direction, plus the concatenations).

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.kernel_dispatch.batched_cayley`` (under a minute of CPU);
``--layers 8 --rounds 3`` for a quick look. Prints a Markdown table and writes
``benchmarks/kernel_dispatch/results/batched_cayley.json``. On a GPU, ``--device cuda --impl triton`` times the
Triton path the same way (wall time between synchronisations; written to ``batched_cayley_cuda.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common.pages import write_json
from benchmarks.common.paths import results_dir
from benchmarks.common.provenance import provenance, provenance_line
from benchmarks.common.timing import interleaved
from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann.reference import triangle_size

METHODS = ("per layer", "batched")
# View-like ops: no kernel launch on a GPU.
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze", "slice",
          "select", "split", "split_with_sizes", "alias", "detach", "as_strided", "unbind", "chunk", "narrow"}


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched below autograd (forward and backward), split into views and the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        """Non-view ops: what would each launch a kernel on a GPU."""
        return sum(n for name, n in self.ops.items() if name not in _VIEWS)


def _step(method: str, qs: list[torch.Tensor], grads: list[torch.Tensor], block: int, terms: int, impl: str) -> None:
    """One model step's rotations, forward and backward, per layer or batched."""
    if method == "per layer":
        rotations = [ops.cayley_neumann(q, block, terms=terms, impl=impl) for q in qs]
    else:
        batched = ops.cayley_neumann(torch.cat(qs), block, terms=terms, impl=impl)
        rotations = batched.split([q.shape[0] for q in qs])
    torch.autograd.backward(rotations, grads)


def measure(layers: int, blocks: int, block: int, terms: int, rounds: int, device: str = "cpu",
            impl: str = "torch") -> dict:
    """Time per step (CPU time on CPU, synchronised wall time on CUDA) and op counts for both methods.

    Args:
        layers: Adapted layers (154 in the 1.1B model).
        blocks: Rotation blocks per layer (2048 / 32 = 64).
        block: Block size b.
        terms: Neumann terms.
        rounds: Interleaved timing rounds.
        device: ``"cpu"`` or ``"cuda"``.
        impl: ``ops.cayley_neumann``'s ``impl``.
    """
    torch.manual_seed(0)
    qs = [(0.05 * torch.randn(blocks, triangle_size(block), device=device)).requires_grad_(True)
          for _ in range(layers)]
    grads = [torch.randn(blocks, block, block, device=device) for _ in range(layers)]
    cuda = device.startswith("cuda")
    clock = time.perf_counter if cuda else time.thread_time

    def timed(method: str) -> float:
        for q in qs:
            q.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        _step(method, qs, grads, block, terms, impl)
        if cuda:
            torch.cuda.synchronize()
        return (clock() - start) * 1000.0

    times = interleaved(METHODS, timed, rounds=rounds, steps_per_round=1, warmup=1)
    result = {"layers": layers, "blocks": blocks, "block": block, "terms": terms, "rounds": rounds,
              "device": device, "impl": impl, "clock": "wall (synchronised)" if cuda else "CPU time (thread)"}
    reference = None
    for method in METHODS:
        for q in qs:
            q.grad = None
        counter = _OpCounter()
        with counter:
            _step(method, qs, grads, block, terms, impl)
        grads_now = torch.cat([q.grad for q in qs])
        if reference is None:
            reference = grads_now
        result[method] = {"cpu_ms": statistics.median(times[method]), "ops": sum(counter.ops.values()),
                          "launches": counter.launches(), "max_grad_diff": (grads_now - reference).abs().max().item()}
    # The Triton path: one launch per call and direction; batching adds two copies: the concatenation of the
    # triangles (forward) and that of the per-layer rotation gradients (the backward of the split). The gradient of
    # the concatenation hands each layer a view.
    result["triton_launches"] = {"per layer": 2 * layers, "batched": 2 + 2}
    return result


def table(r: dict) -> str:
    """Markdown table of one measurement."""
    per, bat = r["per layer"], r["batched"]
    title = (f"{r['layers']} layers × {r['blocks']} blocks of {r['block']}, {r['terms']} terms, impl={r['impl']} on "
             f"{r['device']}, forward + backward, {r['clock']} per step (median of {r['rounds']} interleaved rounds)")
    header = ("| method | ms per step | ATen ops (fwd+bwd) | of them non-view (GPU launches, torch path) "
              "| Triton launches | max grad diff vs per layer |")
    lines = [title, "", header, "|---|---|---|---|---|---|"]
    for name, m in (("per layer", per), ("batched", bat)):
        lines.append(f"| {name} | {m['cpu_ms']:.1f} | {m['ops']} | {m['launches']} | "
                     f"{r['triton_launches'][name]} | {m['max_grad_diff']:.1e} |")
    lines.append(f"| batched / per layer | {bat['cpu_ms'] / per['cpu_ms']:.2f} | {bat['ops'] / per['ops']:.3f} | "
                 f"{bat['launches'] / per['launches']:.3f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=154)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--terms", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impl", default="torch", choices=("torch", "triton", "auto"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.layers, args.blocks, args.block, args.terms, args.rounds, args.device, args.impl)
    result["provenance"] = provenance(("benchmarks/kernel_dispatch", "peftplug_kernels"))
    print(table(result))
    print(provenance_line(result["provenance"]))
    if not args.no_write:
        name = "batched_cayley.json" if args.device == "cpu" else "batched_cayley_cuda.json"
        write_json(results_dir("kernel_dispatch") / name, result)


if __name__ == "__main__":
    main()
