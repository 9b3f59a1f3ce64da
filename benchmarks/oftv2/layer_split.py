"""Where an eager OFTv2 layer's CPU time goes, beside LoRA r16's, and how stacked rotations scale with depth.

The overhead study (:mod:`benchmarks.oftv2.overhead`) times forward + backward per adapted layer of a stack of 8 tiny
layers (width 64, 8 tokens: arithmetic negligible, so the time is calls and framework). This tool splits OFTv2's part
of that time and repeats it at more layers:

- ``base``, ``LoRA r16``, ``OFTv2 b32``, ``OFTv2 b32 stacked``: the overhead study's stacks (``overhead.build``), one
  forward + backward each;
- ``OFTv2 Function bodies``: the torch path's ``CayleyRotateFunction.forward`` and ``.backward`` run as plain calls
  with a stand-in context, once per layer, on the same shapes: the adapter's own kernel calls and the Python around
  them, without autograd's machinery or the layer's Python.

So ``OFTv2 b32 − base`` is what the adapter adds to a layer, of which the Function bodies are the part no cheaper
autograd or dispatch could remove; ``stacked`` moves the series to one batch per model forward, whose cost spreads
over the layers (hence the depths). Eager only, one torch thread, process CPU time, interleaved rounds, medians.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.oftv2.layer_split --label NAME`` writes
``benchmarks/oftv2/results/overhead/layer_split_NAME.json``; the overhead page's notes quote it. ``--quick``: tiny
counts (nothing written unless ``--out-dir``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.timing import interleaved
from benchmarks.oftv2.overhead import build, fwd_bwd
from benchmarks.oftv2.overhead_report import write_study
from peftplug_kernels.cayley_rotate.function import CayleyRotateFunction

STACKS = ("base", "LoRA r16", "OFTv2 b32", "OFTv2 b32 stacked")
BODIES = "OFTv2 Function bodies"
BLOCK = 32


class _Context:
    """What ``CayleyRotateFunction`` reads and writes on its ``ctx``, without autograd behind it."""

    needs_input_grad = (True, True, False, False, False)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def function_bodies(layers: int, width: int, tokens: int):
    """A callable running the OFTv2 Function's forward and backward bodies once per layer (``width / 32`` blocks of
    32, 5 series terms, no dropout) on ``tokens`` rows.

    Args:
        layers: Calls of each body.
        width: Input width (a multiple of 32).
        tokens: Rows of the input.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g)
    grad = torch.randn(tokens, width, generator=g)
    q_vec = 0.01 * torch.randn(width // BLOCK, BLOCK * (BLOCK - 1) // 2, generator=g)

    def run() -> None:
        # Without grad mode, as autograd runs a backward (its guard refuses create_graph=True otherwise).
        with torch.no_grad():
            for _ in range(layers):
                ctx = _Context()
                CayleyRotateFunction.forward(ctx, x, q_vec, BLOCK, 5, None)
                CayleyRotateFunction.backward(ctx, grad)

    return run


def measure_depth(layers: int, width: int, tokens: int, rounds: int, steps: int, iters: int, warmup: int) -> dict:
    """Per-layer CPU time of every configuration at one depth.

    Args:
        layers: Layers in each stack.
        width: Layer width.
        tokens: Rows of the input.
        rounds: Interleaved rounds.
        steps: Timed samples per configuration and round.
        iters: Calls per timed sample.
        warmup: Untimed samples per configuration before the first round.

    Returns:
        ``{"us_per_layer": {config: median}, "iqr": {config: (q1, q3)}, "added_over_lora": {config: ratio}}``
        (added: minus ``base``).
    """
    x = torch.randn(tokens, width, requires_grad=True)
    runs = {name: fwd_bwd(build(name, width, layers), x) for name in STACKS}
    runs[BODIES] = function_bodies(layers, width, tokens)

    def sample(name: str) -> float:
        start = time.process_time()
        for _ in range(iters):
            runs[name]()
        return (time.process_time() - start) / iters / layers * 1e6

    times = interleaved(list(runs), sample, rounds, steps, warmup)
    medians = {name: statistics.median(t) for name, t in times.items()}
    quartiles = {name: tuple(statistics.quantiles(t, n=4)[::2]) if len(t) > 1 else (t[0], t[0])
                 for name, t in times.items()}
    lora_added = medians["LoRA r16"] - medians["base"]
    added = {name: (medians[name] - (0.0 if name == BODIES else medians["base"])) / lora_added
             for name in medians if name != "base"}
    return {"us_per_layer": medians, "iqr": quartiles, "added_over_lora": added}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="run")
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 96], help="layers per stack")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layer-calls", type=int, default=400, help="layer forward + backwards per timed sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None, help="results folder (default: the committed one)")
    args = parser.parse_args(argv)
    if args.width % BLOCK:
        parser.error(f"--width must be a multiple of {BLOCK}, got {args.width}")
    if args.quick:
        args.depths, args.rounds, args.steps, args.layer_calls, args.warmup = [2, 4], 2, 1, 8, 1
    return args


def main(argv=None) -> int:
    """Measures every depth and writes the result file.

    Args:
        argv: Command-line arguments.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    depths = {}
    for layers in args.depths:
        iters = max(1, args.layer_calls // layers)
        rec = measure_depth(layers, args.width, args.tokens, args.rounds, args.steps, iters, args.warmup)
        depths[str(layers)] = rec
        cells = "; ".join(f"{name} {us:.1f}" for name, us in rec["us_per_layer"].items())
        ratios = "; ".join(f"{name} {r:.3f}" for name, r in rec["added_over_lora"].items())
        print(f"{layers} layers, µs / layer: {cells} | added / LoRA r16's: {ratios}", flush=True)
    settings = ("depths", "width", "tokens", "rounds", "steps", "layer_calls", "warmup", "threads", "quick")
    write_study("layer_split", args, settings, {"depths": depths})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
