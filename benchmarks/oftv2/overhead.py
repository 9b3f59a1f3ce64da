"""A CPU proxy of launch-bound cost: forward + backward per adapted layer at tiny widths, OFTv2 vs LoRA r16 vs PEFT
OFT, eager and under ``torch.compile``; time and the ops dispatched per layer.

Why: on one H200 OFTv2's 1.1B step is launch-bound (its kernels keep the GPU busy 73.5 ms of a 140 ms step, LoRA's
116.6 of 128; ``../shared/gpu/2026-12-04-h200/``), while on this CPU whole-model step ratios hide that cost behind
arithmetic. At a width of 64 and 8 tokens the arithmetic of a layer is negligible, so the CPU time of its forward
+ backward is framework cost (Python, autograd, dispatcher, allocator), and the ops the profiler records are the
calls a GPU would launch (:mod:`benchmarks.oftv2.overhead_ops` says what counts).

The model: a stack of ``--layers`` frozen ``nn.Linear(width, width)``, each adapted (OFTv2 b32 with its defaults,
``kernel_impl="auto"``; PEFT's LoRA r16; PEFT's OFT b32 Cayley–Neumann), run as the adapted stack itself (PEFT's
model wrapper is a per-model cost, not a per-layer one). The input requires grad in every case, so the unadapted
stack ("base") runs a backward too: ``(method − base) / layers`` is what the adapter adds to a layer. All methods,
eager and compiled (Inductor, the default backend), are timed interleaved round by round in one process with one
torch thread, process CPU time, medians. Compiled kernels are counted on a second compile with Inductor's
``cpp.enable_kernel_profile`` (it puts a profiler record around each generated kernel, which would tax the timed
copy).

Run: ``python -m benchmarks.oftv2.overhead --label baseline`` measures the per-layer part and the SmolLM2 step part
(:mod:`benchmarks.oftv2.overhead_llm`; ``--part layers`` or ``--part smollm2`` for one), writes
``benchmarks/oftv2/results/overhead/<label>_{layers,smollm2}.json`` and renders docs/benchmarks/oftv2_overhead.md
from every committed label (:mod:`benchmarks.oftv2.overhead_report`); ``--report`` renders only; ``--quick`` runs the
same code at the tiniest size with dynamo's ``eager`` backend and prints the table (unless ``--out-dir`` is given).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.pages import write_json
from benchmarks.common.provenance import provenance
from benchmarks.common.timing import interleaved
from benchmarks.oftv2.overhead_ops import (
    count_ops,
    cpu_seconds,
    dynamo_stats,
    reset_dynamo_stats,
    top_kernels,
)
from benchmarks.oftv2.overhead_report import CODE

#: The unadapted stack first: every adapted method is read against it.
METHODS = ("base", "OFTv2 b32", "OFTv2 b32 stacked", "LoRA r16", "PEFT OFT b32")


def methods(extra_blocks: tuple[int, ...] = ()) -> tuple[str, ...]:
    """:data:`METHODS` plus OFTv2 (and stacked) at each extra block size (``--extra-blocks``).

    A smaller block shrinks the series' arithmetic (b² per input feature) while the calls stay the same, which
    separates what the block size costs from what the framework costs.

    Args:
        extra_blocks: Block sizes besides 32.
    """
    extra = tuple(f"OFTv2 b{b}{stacked}" for b in extra_blocks for stacked in ("", " stacked"))
    return METHODS[:3] + extra + METHODS[3:]
MODES = ("eager", "compiled")


class _Block(nn.Module):
    """One frozen linear layer under the name the adapters target (``proj``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)


class Stack(nn.Module):
    """``layers`` linear layers applied in turn (nothing between them: only the layers' own cost is timed).

    Args:
        width: Input and output width of every layer.
        layers: How many.
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.proj(x)
        return x


def build(method: str, width: int, layers: int, seed: int = 0) -> nn.Module:
    """The stack of one method with only its adapter parameters trainable.

    Args:
        method: One of :func:`methods`.
        width: Layer width (a multiple of 32, the OFT block size).
        layers: Number of layers.
        seed: Initialisation seed.

    Raises:
        ValueError: For an unknown method.
    """
    import peft

    torch.manual_seed(seed)
    stack = Stack(width, layers)
    if method == "base":
        return stack.requires_grad_(False)
    if method.startswith("OFTv2 b"):
        import oftv2

        config = oftv2.OFTv2Config(block_size=int(method.split()[1][1:]), target_modules=["proj"])
    elif method == "LoRA r16":
        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["proj"])
    elif method == "PEFT OFT b32":
        config = peft.OFTConfig(oft_block_size=32, r=0, target_modules=["proj"], use_cayley_neumann=True)
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)} or 'OFTv2 b<n>[ stacked]', got {method!r}")
    # The adapted stack itself, not PeftModel: PEFT's wrapper costs once per model call, not per layer.
    model = peft.get_peft_model(stack, config).base_model.model
    if method.endswith("stacked"):
        from oftv2.stacking import stack_rotations

        stack_rotations(model)  # one batched series per forward of the stack (its hooks stay with the model)
    return model


def fwd_bwd(model: nn.Module, x: torch.Tensor):
    """One forward + backward of ``model`` on ``x``, gradients dropped afterwards as ``zero_grad(set_to_none=True)``
    drops them, so that every call does the same work (the first backward of a step, not an accumulation)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        model(x).sum().backward()
        x.grad = None
        for p in params:
            p.grad = None

    return run


def measure_width(width: int, layers: int, tokens: int, backend: str, rounds: int, steps: int, iters: int,
                  warmup: int, dtype: torch.dtype = torch.float32, extra_blocks: tuple[int, ...] = ()) -> dict:
    """Times and counts every method, eager and compiled, at one width.

    Args:
        width: Layer width.
        layers: Layers in the stack.
        tokens: Rows of the input.
        backend: ``torch.compile`` backend (``inductor`` measures; ``eager`` is the cheap test path).
        rounds: Interleaved rounds.
        steps: Timed samples per method and mode and round.
        iters: Forward + backward calls per timed sample.
        warmup: Untimed samples per method and mode before the first round.
        dtype: The stack's dtype, weights, adapters and input alike (``--dtype``).
        extra_blocks: OFTv2 block sizes measured besides 32 (:func:`methods`).

    Returns:
        ``{mode: {method: record}}``; a record holds ``samples_us`` (CPU µs per call of the whole stack), the
        ``ops`` of one call and its ``top_kernels``; compiled records also ``compile_s`` and ``dynamo``.
    """
    import torch._dynamo

    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    out: dict = {mode: {} for mode in MODES}
    runs = {}
    torch._dynamo.reset()  # one width's models per dynamo cache: no method meets another's recompile limit
    for method in methods(extra_blocks):
        model = build(method, width, layers).to(dtype).train()
        runs[("eager", method)] = fwd_bwd(model, x)
        compiled = fwd_bwd(torch.compile(model, backend=backend), x)
        reset_dynamo_stats()
        start = time.perf_counter()
        compiled()  # compiles forward and backward
        out["compiled"][method] = {"compile_s": time.perf_counter() - start}
        compiled()
        out["compiled"][method]["dynamo"] = dynamo_stats()
        runs[("compiled", method)] = compiled
    for (mode, method), run in runs.items():
        out[mode].setdefault(method, {})
        if mode == "eager":
            run()  # counted warm: a first call also builds cached tables (skew indices, identity) once per process
            out[mode][method]["ops"] = count_ops(run)
            out[mode][method]["top_kernels"] = top_kernels(run)
    keys = list(runs)
    times = interleaved(keys, lambda key: 1e6 * cpu_seconds(runs[key], iters) / iters, rounds, steps, warmup)
    for (mode, method), samples in times.items():
        out[mode][method]["samples_us"] = samples
    _count_compiled(out["compiled"], width, layers, x, backend, extra_blocks)
    return out


def _count_compiled(records: dict, width: int, layers: int, x: torch.Tensor, backend: str,
                    extra_blocks: tuple[int, ...]) -> None:
    """Adds ``ops`` and ``top_kernels`` of each compiled method, from a fresh compile whose generated kernels the
    profiler records (Inductor's ``cpp.enable_kernel_profile``)."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()  # the timed copies are done with; new code objects of the same model would hit their cache
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        for method in methods(extra_blocks):
            run = fwd_bwd(torch.compile(build(method, width, layers).to(x.dtype).train(), backend=backend), x)
            run()
            run()
            records[method]["ops"] = count_ops(run)
            records[method]["top_kernels"] = top_kernels(run)
    torch._dynamo.reset()


def summarize(raw: dict, layers: int) -> dict:
    """Per-layer medians and op counts of :func:`measure_width`'s records, against the base stack.

    Args:
        raw: ``{mode: {method: record}}``.
        layers: Layers in the stack.

    Returns:
        ``{mode: {method: {"us_per_layer", "added_us_per_layer", "iqr_us_per_layer", "ops_per_layer",
        "added_ops_per_layer"}}}``: a layer's whole forward + backward, and what its adapter adds to the base layer.
    """
    out: dict = {}
    for mode, per in raw.items():
        base = per["base"]
        base_us = statistics.median(base["samples_us"]) / layers
        out[mode] = {}
        for method, rec in per.items():
            samples = rec["samples_us"]
            qs = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
            us = statistics.median(samples) / layers
            out[mode][method] = {
                "us_per_layer": us,
                "iqr_us_per_layer": [qs[0] / layers, qs[2] / layers],
                "added_us_per_layer": us - base_us,
                "ops_per_layer": {k: v / layers for k, v in rec["ops"].items()},
                "added_ops_per_layer": {k: (v - base["ops"][k]) / layers for k, v in rec["ops"].items()},
            }
    return out


def run_layers(args) -> dict:
    """The per-layer part: every width of ``args.widths``; returns the result record."""
    torch.set_num_threads(args.threads)
    widths = {}
    for width in args.widths:
        extra = tuple(args.extra_blocks)
        print(f"width {width}: {len(methods(extra))} methods x {len(MODES)} modes", flush=True)
        raw = measure_width(width, args.layers, args.tokens, args.backend, args.rounds, args.steps, args.iters,
                            args.warmup, getattr(torch, args.dtype), extra)
        widths[str(width)] = {"raw": raw, "summary": summarize(raw, args.layers)}
    settings = {k: getattr(args, k) for k in ("widths", "layers", "tokens", "backend", "rounds", "steps", "iters",
                                              "warmup", "threads", "quick", "dtype", "extra_blocks")}
    return {"label": args.label, "code": args.code or None, "settings": settings,
            "provenance": provenance(CODE), "widths": widths}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="run", help="names the result files: baseline, final, ...")
    parser.add_argument("--code", default="", help="what code ran, when not this checkout's HEAD (e.g. a snapshot)")
    parser.add_argument("--part", choices=("all", "layers", "smollm2"), default="all")
    parser.add_argument("--quick", action="store_true", help="tiniest sizes, dynamo's eager backend: a smoke run")
    parser.add_argument("--report", action="store_true", help="render the page from the result files; measure nothing")
    parser.add_argument("--out-dir", type=Path, default=None, help="results folder (default: the committed one)")
    parser.add_argument("--page", type=Path, default=None, help="page to render (default: docs/benchmarks/...)")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--extra-blocks", type=int, nargs="*", default=[],
                        help="OFTv2 block sizes to measure besides 32 (e.g. 8: less series arithmetic, same calls)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed samples per method, mode and round")
    parser.add_argument("--iters", type=int, default=40, help="forward + backward calls per timed sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the per-layer stack's dtype (bfloat16: what a GPU step runs, casts included)")
    parser.add_argument("--llm-batch", type=int, default=4)
    parser.add_argument("--llm-seq", type=int, default=64)
    parser.add_argument("--llm-rounds", type=int, default=4)
    parser.add_argument("--llm-steps", type=int, default=2, help="timed SmolLM2 steps per config and round")
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.layers, args.tokens, args.backend = [32], 2, 2, "eager"
        args.rounds, args.steps, args.iters, args.warmup = 1, 1, 1, 0
        args.llm_batch, args.llm_seq, args.llm_rounds, args.llm_steps = 1, 8, 1, 1
    return args


def main(argv=None) -> int:
    """Measures the selected parts, writes their result files and renders the page (``--report``: renders only).

    Args:
        argv: Command-line arguments.
    """
    from benchmarks.oftv2 import overhead_llm, overhead_report

    args = parse_args(argv)
    results = args.out_dir or overhead_report.RESULTS
    page = args.page or overhead_report.PAGE
    if args.report:
        if not overhead_report.report(results, page):
            raise SystemExit(f"no result files in {results}: run the benchmark first")
        return 0
    records = {}
    if args.part in ("all", "layers"):
        records["layers"] = run_layers(args)
    if args.part in ("all", "smollm2"):
        records["smollm2"] = overhead_llm.run(args, CODE)
    for part, record in records.items():
        print(overhead_report.render_part(part, record))
    if args.quick and args.out_dir is None:
        return 0
    for part, record in records.items():
        write_json(results / f"{args.label}_{part}.json", record)
    overhead_report.report(results, page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
