"""CPU step time of OFTv2 vs PEFT OFT on a small UNet-like conv stack, and the per-layer choice between the
weight-centric and input-centric Conv2d evaluations.

Stack: conv_in 3×3 (4 → C), then at two resolutions a ResNet-style pair of 3×3 convs with GroupNorm + SiLU and a
1×1 shortcut, a stride-2 3×3 downsampling conv between them, and conv_out 3×3 (→ 4): every conv targeted, block
size 32 wherever it divides the filter width (``in·kh·kw``), else the largest divisor ≤ 32 (the same per-layer
block size for both libraries). One training step = forward + backward + AdamW. Methods are interleaved round by
round and timed in process CPU time on one thread (on shared cores wall time mostly measures waiting); the page
reports medians and ratios from this one run. PEFT 0.21.2's OFT Conv2d computes a different (wrong for k > 1)
function, see docs/oftv2.md, so this compares costs only.

The second table times one conv layer's forward + backward with input gradients (a middle layer) under the two
OFTv2 evaluations, to show where each is cheaper and what ``conv_evaluation="auto"`` picks.

Run: ``python -m benchmarks.oftv2.conv`` measures (about two minutes of CPU), writes the raw results to
``benchmarks/oftv2/results/conv.json`` and renders them into the ``oftv2-conv`` section of docs/benchmarks/oftv2.md
(the other sections of the page are kept); ``--report`` renders from the committed results; ``--quick`` only
prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.common.pages import (
    outputs,
    render_results,
    require_results,
    write_json,
    write_section,
)
from benchmarks.common.paths import DOCS, results_dir
from benchmarks.common.provenance import provenance, provenance_line
from benchmarks.common.timing import interleaved

PAGE = DOCS / "oftv2.md"
SECTION = "oftv2-conv"
RESULTS = results_dir("oftv2") / "conv.json"
METHODS = ("OFTv2 (auto)", "OFTv2 (weight-centric)", "OFTv2 (input-centric)", "PEFT OFT")
EVALUATIONS = {"OFTv2 (auto)": "auto", "OFTv2 (weight-centric)": "weight", "OFTv2 (input-centric)": "input"}


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        return self.shortcut(x) + self.conv2(nn.functional.silu(self.norm2(h)))


def conv_stack(channels: int, seed: int = 0) -> nn.Sequential:
    """The UNet-like stack (random init: only timing matters).

    Args:
        channels: Width C of the first resolution (2C at the second).
        seed: Initialisation seed.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(4, channels, 3, padding=1),
        _ResBlock(channels, channels),
        nn.Conv2d(channels, channels, 3, stride=2, padding=1),
        _ResBlock(channels, 2 * channels),
        nn.Conv2d(2 * channels, 4, 3, padding=1),
    )


def _conv_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def _block_size(model: nn.Module, name: str, block: int) -> int:
    conv = model.get_submodule(name)
    width = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    return max(b for b in range(2, block + 1) if width % b == 0)


def build(method: str, channels: int, block: int, terms: int) -> nn.Module:
    """The conv stack with one method's adapter on every conv.

    Args:
        method: One of :data:`METHODS`.
        channels: Stack width.
        block: Largest block size.
        terms: Neumann terms.
    """
    import peft

    import oftv2

    model = conv_stack(channels)
    names = _conv_names(model)
    # Per-layer block sizes through one config per distinct size (both libraries take a single size per config).
    sizes = {name: _block_size(model, name, block) for name in names}
    configs = []
    for size in sorted(set(sizes.values())):
        targets = [n for n in names if sizes[n] == size]
        if method == "PEFT OFT":
            configs.append(
                peft.OFTConfig(
                    target_modules=targets, oft_block_size=size, r=0, num_cayley_neumann_terms=terms
                )
            )
        else:
            evaluation = EVALUATIONS[method]
            configs.append(
                oftv2.OFTv2Config(
                    target_modules=targets, block_size=size, neumann_terms=terms, conv_evaluation=evaluation
                )
            )
    # Separate adapters on disjoint layers, all active: one adapter per layer, as with a single config.
    peft_model = peft.get_peft_model(model, configs[0], adapter_name="a0")
    for i, config in enumerate(configs[1:], start=1):
        peft_model.add_adapter(f"a{i}", config)
    peft_model.base_model.set_adapter([f"a{i}" for i in range(len(configs))])
    return peft_model


def measure_stack(channels, size, batch, block, terms, rounds, steps, warmup) -> dict:
    """Interleaved step times of every method on the stack; ``{method: {median_s, iqr_s, trainable}}``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, size, size, generator=gen)
    target = torch.randn(batch, 4, size // 2, size // 2, generator=gen)
    models = {m: build(m, channels, block, terms).train() for m in METHODS}
    optims = {
        m: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for m, model in models.items()
    }

    def step(method):
        start = time.process_time()
        loss = nn.functional.mse_loss(models[method](x), target)
        loss.backward()
        optims[method].step()
        optims[method].zero_grad(set_to_none=True)
        return time.process_time() - start

    times = interleaved(METHODS, step, rounds, steps, warmup)
    out = {}
    for method in METHODS:
        qs = statistics.quantiles(times[method], n=4)
        out[method] = {
            "median_s": statistics.median(times[method]),
            "iqr_s": (qs[0], qs[2]),
            "trainable": sum(p.numel() for p in models[method].parameters() if p.requires_grad),
        }
    return out


def measure_layers(shapes, batch, block, terms, repeats) -> list[dict]:
    """One conv layer (3×3, padding 1, input requiring grad) under both evaluations, interleaved.

    Args:
        shapes: ``(in_channels, out_channels, spatial)`` triples.
        batch: Batch size.
        block: Block size.
        terms: Neumann terms.
        repeats: Timed forward + backward passes per evaluation.
    """
    import peft

    import oftv2

    rows = []
    for cin, cout, size in shapes:
        x = torch.randn(batch, cin, size, size, requires_grad=True)
        layers = {}
        for evaluation in ("weight", "input", "auto"):
            torch.manual_seed(0)
            config = oftv2.OFTv2Config(
                target_modules=["0"], block_size=block, neumann_terms=terms, conv_evaluation=evaluation
            )
            layers[evaluation] = peft.get_peft_model(
                nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1)), config
            )
        times = {e: [] for e in layers}
        for i in range(repeats + 1):
            for evaluation, model in layers.items():
                start = time.process_time()
                model(x).square().mean().backward()
                if i:  # the first pass is a warm-up
                    times[evaluation].append(time.process_time() - start)
                x.grad = None
        weight, inp, auto = (statistics.median(times[e]) for e in ("weight", "input", "auto"))
        pick = layers["auto"].base_model.model[0].evaluation_for(x)
        rows.append(
            {"shape": (cin, cout, size), "weight_s": weight, "input_s": inp, "auto_s": auto, "pick": pick}
        )
    return rows


def render(stack: dict, layers: list[dict], args) -> str:
    """The markdown section.

    Args:
        stack: :func:`measure_stack`'s result.
        layers: :func:`measure_layers`' rows.
        args: The run's settings (see :data:`SETTINGS`, plus ``torch`` and ``threads``).
    """
    ours = stack[METHODS[0]]["median_s"]
    peft_time = stack["PEFT OFT"]["median_s"]
    lines = [
        "## Conv2d: UNet-like conv stack",
        "",
        (
            f"Generated by `python -m benchmarks.oftv2.conv`. Stack of {len(_conv_names(conv_stack(args.channels)))} "
            f"convs (3×3 and 1×1, one stride-2), width {args.channels}/{2 * args.channels}, input "
            f"{args.batch} × 4 × {args.size} × {args.size}, every conv targeted, block size ≤ {args.block}, "
            f"{args.terms} Neumann terms; step = forward + backward + AdamW; {args.rounds} interleaved rounds × "
            f"{args.steps} steps after {args.warmup} warm-up steps per method; process CPU time, "
            f"torch {args.torch}, {args.threads} thread(s). PEFT 0.21.2's OFT Conv2d computes a "
            "different function for k > 1 (see docs/oftv2.md): this row compares cost only."
        ),
        "",
        "| method | trainable params | median step CPU (ms) | IQR (ms) | step × PEFT OFT |",
        "|---|---:|---:|---:|---:|",
    ]
    for method in METHODS:
        s = stack[method]
        lines.append(
            f"| {method} | {s['trainable']:,} | {s['median_s'] * 1e3:.1f} | "
            f"{s['iqr_s'][0] * 1e3:.1f}–{s['iqr_s'][1] * 1e3:.1f} | {s['median_s'] / peft_time:.3f} |"
        )
    ratio = ours / peft_time
    verdict = "meets" if ratio <= 1.0 else "misses"
    lines += [
        "",
        (
            f"OFTv2 (default `conv_evaluation='auto'`) / PEFT OFT step time: **{ratio:.3f}** in this run "
            f"({verdict} the ≤ 1.0 target); forcing the weight-centric evaluation gives "
            f"{stack[METHODS[1]]['median_s'] / peft_time:.3f}, the input-centric one "
            f"{stack[METHODS[2]]['median_s'] / peft_time:.3f}."
        ),
        "",
        (
            f"Single 3×3 conv layer, forward + backward with input gradients, batch {args.batch}, block {args.block} "
            f"(median of {args.repeats}):"
        ),
        "",
        (
            "| in → out channels | spatial | pixels (batch·H·W) | weight-centric (ms) | input-centric (ms) | "
            "input / weight | auto picks | auto (ms) |"
        ),
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in layers:
        cin, cout, size = row["shape"]
        lines.append(
            f"| {cin} → {cout} | {size}×{size} | {args.batch * size * size} | {row['weight_s'] * 1e3:.1f} | "
            f"{row['input_s'] * 1e3:.1f} | {row['input_s'] / row['weight_s']:.2f} | {row['pick']} | "
            f"{row['auto_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n"


#: The settings a result file records (and :func:`render` reads back).
SETTINGS = ("quick", "channels", "size", "batch", "block", "terms", "rounds", "steps", "warmup", "repeats")


def _render_record(record: dict) -> str:
    prov = record["provenance"]
    args = SimpleNamespace(**record["settings"], torch=prov["torch"], threads=prov["threads"])
    return render(record["stack"], record["layers"], args) + f"\n{provenance_line(prov)}\n"


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the ``oftv2-conv`` section of ``page`` from a result file. Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON that :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        write_section(page, SECTION, _render_record(record), "# OFTv2 CPU benchmark")

    return render_results(results, render_page)


def main(argv=None) -> None:
    """Measures, prints the section and (for a full run) writes it into docs/benchmarks/oftv2.md.

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, few steps (a smoke run; prints only)"
    )
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--terms", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=None,
        help="page to update, its result file beside it (default: docs/benchmarks/oftv2.md with "
             "benchmarks/oftv2/results/conv.json; --quick only prints unless given)"
    )
    parser.add_argument("--report", action="store_true", help="render the page from the result file; measure nothing")
    args = parser.parse_args(argv)
    page, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, page), results)
        return
    torch.set_num_threads(args.threads)
    shapes = [
        (64, 64, 32),
        (128, 128, 16),
        (128, 128, 8),
        (256, 256, 8),
        (320, 320, 8),
        (640, 640, 8),
        (640, 640, 4),
    ]
    if args.quick:
        args.channels, args.size, args.rounds, args.steps, args.warmup, args.repeats = 16, 16, 2, 2, 1, 2
        shapes = [(32, 32, 8)]
    stack = measure_stack(
        args.channels, args.size, args.batch, args.block, args.terms, args.rounds, args.steps, args.warmup
    )
    layers = measure_layers(shapes, args.batch, args.block, args.terms, args.repeats)
    record = json.loads(json.dumps({"settings": {k: getattr(args, k) for k in SETTINGS}, "provenance": provenance(),
                                    "stack": stack, "layers": layers}))
    print(_render_record(record))
    if args.quick and args.out is None:
        return
    write_json(results, record)
    report(results, page)


if __name__ == "__main__":
    main()
