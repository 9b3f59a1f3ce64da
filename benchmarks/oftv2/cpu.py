"""CPU step-time and memory benchmark: OFTv2 vs PEFT OFT vs LoRA vs weight-centric OFT vs full finetuning.

A Llama-shaped model (random init: only timing matters), every linear layer of the blocks targeted, the same batch
and sequence for every method. One training step = forward + backward + AdamW step. Methods are interleaved
round by round so that load changes on the (shared) cores hit all of them alike; the table reports medians and
ratios measured in this one run. By default torch runs one thread and the ratios use the process CPU time of a
step: on cores shared with other jobs, wall time mostly measures waiting for a core, CPU time the work done
(wall-clock medians are reported beside it).

Memory is the modelled peak of a step: parameters + gradients + AdamW state (two fp32 tensors per trainable
parameter) + the tensors autograd saves for backward (unique storages, counted through saved-tensor hooks).
CPU PyTorch has no allocator statistics, and this count is deterministic, which process RSS is not.

Weight-centric OFT is the original OFT formulation the paper compares against: each step materialises the dense
block-diagonal R and the rotated weight ``W Rᵀ`` (a dense ``out × in × in`` product) and runs the layer with it.

Run: ``python -m benchmarks.oftv2.cpu`` from the repository root measures (a few minutes of CPU time, 10–20 min
wall on busy shared cores), writes the raw results to ``benchmarks/oftv2/results/cpu.json`` and renders them into
the ``oftv2-cpu`` section of docs/benchmarks/oftv2.md (+ oftv2.png); ``--report`` renders the page from the
committed results alone; ``--quick`` (two small widths, a few steps, ~10 s of CPU) only prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common.llama import TARGETS, llama
from benchmarks.common.pages import (
    outputs,
    render_results,
    require_results,
    write_json,
    write_section,
)
from benchmarks.common.paths import DOCS, results_dir
from benchmarks.common.provenance import provenance, provenance_line
from benchmarks.common.timing import interleaved, lm_train_step

METHODS = ("OFTv2", "PEFT OFT", "LoRA r=8", "LoRA r=16", "weight-centric OFT", "full FT")
PAGE = DOCS / "oftv2.md"
TITLE = "# OFTv2 CPU benchmark"
SECTION = "oftv2-cpu"
RESULTS = results_dir("oftv2") / "cpu.json"


class WeightCentricOFT(nn.Module):
    """The weight-centric baseline: ``y = x (W Rᵀ)ᵀ`` with the dense block-diagonal R formed every forward.

    Args:
        base: The frozen ``nn.Linear``.
        block_size: b.
        terms: Neumann terms (same Cayley–Neumann map as OFTv2).
    """

    def __init__(self, base: nn.Linear, block_size: int, terms: int):
        super().__init__()
        self.base = base
        self.block_size, self.terms = block_size, terms
        n_blocks = base.in_features // block_size
        self.q = nn.Parameter(torch.zeros(n_blocks, block_size * (block_size - 1) // 2))

    def forward(self, x):
        from peftplug_kernels import ops

        blocks = ops.cayley_neumann(
            self.q, self.block_size, terms=self.terms, form="cayley_neumann", impl="torch"
        )
        dense = torch.block_diag(*blocks.unbind(0))
        return F.linear(x, self.base.weight @ dense.T, self.base.bias)


def build(method: str, width: int, layers: int, vocab: int, block: int, terms: int) -> nn.Module:
    """The model of one method, with only its trainable parameters requiring grad.

    Args:
        method: One of :data:`METHODS`.
        width: Hidden size.
        layers: Number of decoder layers.
        vocab: Vocabulary size.
        block: OFT block size.
        terms: Neumann terms.
    """
    import peft

    model = llama(width, layers, vocab)
    if method == "full FT":
        return model
    if method == "OFTv2":
        import oftv2

        cfg = oftv2.OFTv2Config(target_modules=TARGETS, block_size=block, neumann_terms=terms)
    elif method == "PEFT OFT":
        cfg = peft.OFTConfig(
            target_modules=TARGETS,
            oft_block_size=block,
            r=0,
            use_cayley_neumann=True,
            num_cayley_neumann_terms=terms,
        )
    elif method.startswith("LoRA"):
        rank = int(method.split("=")[1])
        cfg = peft.LoraConfig(target_modules=TARGETS, r=rank, lora_alpha=2 * rank)
    elif method == "weight-centric OFT":
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in TARGETS and isinstance(child, nn.Linear):
                    setattr(module, child_name, WeightCentricOFT(child, block, terms))
        return model
    else:
        raise ValueError(f"unknown method {method!r}")
    return peft.get_peft_model(model, cfg)


def modelled_peak_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    """Parameters + grads + AdamW state + autograd-saved tensors of one step (see module docstring).

    Args:
        model: The model.
        batch: Token ids.
    """
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    # Saved tensors that are the parameters themselves are not extra memory.
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = sum(n for ptr, n in seen.items() if ptr not in param_ptrs)
    return params + trainable + 2 * trainable + activations


def measure(widths, layers, vocab, batch, seq, block, terms, rounds, steps_per_round, warmup):
    """Runs every method at every width; returns ``{width: {method: stats}}``."""
    results = {}
    for width in widths:
        tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        models, optims = {}, {}
        for method in METHODS:
            model = build(method, width, layers, vocab, block, terms)
            model.train()
            trainable = [p for p in model.parameters() if p.requires_grad]
            models[method] = model
            optims[method] = torch.optim.AdamW(trainable, lr=1e-4)
            results.setdefault(width, {})[method] = {
                "trainable": sum(p.numel() for p in trainable),
                "memory": modelled_peak_bytes(model, tokens),
            }

        def step(method, models=models, optims=optims, tokens=tokens):
            model, opt = models[method], optims[method]
            start, start_cpu = time.perf_counter(), time.process_time()
            lm_train_step(model, opt, tokens)
            return time.process_time() - start_cpu, time.perf_counter() - start

        times = interleaved(METHODS, step, rounds, steps_per_round, warmup)
        for method in METHODS:
            cpu = [c for c, _ in times[method]]
            results[width][method]["median_s"] = statistics.median(cpu)
            results[width][method]["wall_s"] = statistics.median(w for _, w in times[method])
            qs = statistics.quantiles(cpu, n=4) if len(cpu) >= 4 else [math.nan] * 3
            results[width][method]["iqr_s"] = (qs[0], qs[2])
        del models, optims
    return results


def render(results: dict, args) -> str:
    """The page section of :func:`measure`'s results (widths as keys, as read back from JSON).

    Args:
        results: ``{width: {method: stats}}``.
        args: The run's settings (``quick``, ``layers``, ``vocab``, ``batch``, ``seq``, ``block``, ``terms``,
            ``rounds``, ``steps``, ``warmup``, ``torch``, ``threads``).
    """
    lines = [
        (f"Generated by `python -m benchmarks.oftv2.cpu{' --quick' if args.quick else ''}`. Llama-shaped model, "
         f"{args.layers} decoder layers, vocabulary {args.vocab}, batch {args.batch} × sequence {args.seq}, all "
         f"seven linear layers of every block targeted; OFT block size {args.block}, {args.terms} Neumann terms "
         f"(OFTv2 Taylor form, PEFT OFT its product form); step = forward + backward + AdamW; "
         f"{args.rounds} interleaved rounds × {args.steps} steps after {args.warmup} warm-up steps per method; "
         f"torch {args.torch}, {args.threads} threads."),
        "",
        ("The cores are shared with other jobs, so absolute times are noisy; the ratios compare methods measured "
         "round by round in the same run. Memory is the modelled step peak (parameters + gradients + AdamW state + "
         "autograd-saved tensors), see the module docstring."),
        "",
    ]
    for width, per in results.items():
        ref = per["OFTv2"]
        lines += [
            f"## width {width}",
            "",
            ("| method | trainable params | median step CPU (ms) | IQR (ms) | step × OFTv2 | wall (ms) "
             "| memory (MiB) | memory × OFTv2 |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, s in per.items():
            lo, hi = s["iqr_s"]
            lines.append(
                f"| {method} | {s['trainable']:,} | {1e3 * s['median_s']:.1f} | {1e3 * lo:.1f}–{1e3 * hi:.1f} | "
                f"{s['median_s'] / ref['median_s']:.2f} | {1e3 * s['wall_s']:.1f} | {s['memory'] / 2**20:.1f} | "
                f"{s['memory'] / ref['memory']:.2f} |"
            )
        lines.append("")
    lines += [
        "## targets",
        "",
        "| target | " + " | ".join(f"width {w}" for w in results) + " |",
        "|---|" + "---:|" * len(results),
    ]

    def row(name, fn, goal):
        vals = [fn(per) for per in results.values()]
        cells = [f"{v:.3f} {'✓' if goal(v) else '✗'}" for v in vals]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def t(per, m):
        return per[m]["median_s"]

    row("OFTv2 / PEFT OFT step time (≤ 1.00)", lambda p: t(p, "OFTv2") / t(p, "PEFT OFT"), lambda v: v <= 1.0)
    row(
        "OFTv2 / LoRA r=8 step time (≤ 1.05)", lambda p: t(p, "OFTv2") / t(p, "LoRA r=8"), lambda v: v <= 1.05
    )
    row(
        "OFTv2 / LoRA r=16 step time (≤ 1.05)",
        lambda p: t(p, "OFTv2") / t(p, "LoRA r=16"),
        lambda v: v <= 1.05,
    )
    row(
        "weight-centric / OFTv2 step time (> 1, growing)",
        lambda p: t(p, "weight-centric OFT") / t(p, "OFTv2"),
        lambda v: v > 1.0,
    )
    row(
        "weight-centric / OFTv2 memory (> 1)",
        lambda p: p["weight-centric OFT"]["memory"] / p["OFTv2"]["memory"],
        lambda v: v > 1.0,
    )
    lines.append("")
    return "\n".join(lines)


def plot(results, path: Path) -> None:
    """Grouped bars of step time relative to OFTv2, one group per width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    n = len(results)
    bar = 0.8 / n
    for i, (width, per) in enumerate(results.items()):
        ref = per["OFTv2"]["median_s"]
        xs = [j + i * bar for j in range(len(METHODS))]
        ax.bar(xs, [per[m]["median_s"] / ref for m in METHODS], bar, label=f"width {width}")
    ax.set_xticks([j + bar * (n - 1) / 2 for j in range(len(METHODS))], METHODS, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("median step CPU time / OFTv2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: The settings a result file records (and :func:`render` reads back).
SETTINGS = ("quick", "widths", "layers", "vocab", "batch", "seq", "block", "terms", "rounds", "steps", "warmup")


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the ``oftv2-cpu`` section of ``page`` (and its plot) from a result file. Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON that :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        prov = record["provenance"]
        args = SimpleNamespace(**record["settings"], torch=prov["torch"], threads=prov["threads"])
        body = (render(record["results"], args) + f"\n{provenance_line(prov)}\n\n"
                f"![step time relative to OFTv2]({page.stem}.png)\n")
        write_section(page, SECTION, body, TITLE)
        plot(record["results"], page.with_suffix(".png"))

    return render_results(results, render_page)


def main(argv=None) -> None:
    """Measures, writes the result file and renders the page (``--report``: renders only).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small widths, few steps (a smoke run)")
    parser.add_argument("--report", action="store_true", help="render the page from the result file; measure nothing")
    parser.add_argument("--widths", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--terms", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per method per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steadiest on shared cores)"
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="page to write, its result file beside it (default: docs/benchmarks/oftv2.md with "
             "benchmarks/oftv2/results/cpu.json; --quick only prints unless given)",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="unused: this benchmark needs no data")
    args = parser.parse_args(argv)
    page, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, page), results)
        return
    torch.set_num_threads(args.threads)
    if args.quick:
        args.widths = args.widths or [128, 256]
        args.rounds, args.steps, args.seq = args.rounds or 2, args.steps or 2, min(args.seq, 64)
    else:
        args.widths = args.widths or [512, 1024]
        args.rounds, args.steps = args.rounds or 4, args.steps or 3
    measured = measure(args.widths, args.layers, args.vocab, args.batch, args.seq, args.block, args.terms,
                       args.rounds, args.steps, args.warmup)
    # Through JSON and back: the page is rendered from exactly what the result file holds (int keys become str).
    record = json.loads(json.dumps({"settings": {k: getattr(args, k) for k in SETTINGS},
                                    "provenance": provenance(), "results": measured}))
    prov = record["provenance"]
    print(render(record["results"], SimpleNamespace(**record["settings"], torch=prov["torch"],
                                                     threads=prov["threads"])))
    if args.quick and args.out is None:
        return
    write_json(results, record)
    report(results, page)


if __name__ == "__main__":
    main()
