"""GPU benchmarks of the fused kernels and of QOFT training (``bash benchmarks/gpu/run_all.sh`` runs this).

1. ``block_rotate``: Triton kernel vs the torch reference (einsum), forward and forward + backward.
2. ``nf4_rotate_matmul``: the fused kernel vs rotate + bitsandbytes ``Linear4bit`` (``bnb.matmul_4bit``) at
   out × in = 4096 × 4096 over a token sweep up to batch × seq = 4096, bf16; forward and forward + backward, with
   the backward's peak memory. The sweep shows where the fused kernel stops winning (what
   ``peftplug_kernels.dispatch_table.fused_nf4_max_tokens`` should say for the device).
   ``nf4_dequantize``: the Triton dequantize kernel (the fused backward's) vs bitsandbytes' and the torch reference.
3. End-to-end training step of a ~1.1B-parameter Llama-shaped model (TinyLlama shape, random weights, NF4 + double
   quant, bf16 compute): QOFT (ours, kernels by ``impl="auto"``) vs PEFT OFT on the same 4-bit base vs QLoRA
   r=16; median step time, tokens/s, peak GPU memory.

``--dry-run`` runs the same code paths at tiny sizes on CPU (the Triton kernels through the interpreter), so CI
can check this script without a GPU. Results go to ``<out>/gpu_results.json`` and ``<out>/gpu_results.md``;
``python -m benchmarks.kernels.gpu --merge-docs <out>/gpu_results.json`` (or the ``.md`` beside it) commits the raw
results as ``benchmarks/kernels/results/gpu.json`` and renders them into the ``qoft-gpu`` section of
docs/benchmarks/qoft.md; ``--report`` renders that section from the committed file alone.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common.llama import TARGETS, quantize_linears_
from benchmarks.common.pages import read_json, render_results, write_json, write_page, write_section
from benchmarks.common.paths import DOCS, REPO, results_dir
from benchmarks.common.provenance import run_provenance
from benchmarks.common.timing import lm_train_step

PAGE = DOCS / "qoft.md"
SECTION = "qoft-gpu"
RESULTS = results_dir("kernels") / "gpu.json"
FULL = {
    "tokens": 4096, "width": 4096, "out": 4096, "block": 32, "nf4_tokens": (16, 256, 1024, 4096),
    "llama": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
              "num_key_value_heads": 4, "vocab_size": 32000},
    "batch": 4, "seq": 1024, "steps": 10, "warmup": 3,
}
DRY = {
    "tokens": 48, "width": 128, "out": 96, "block": 32, "nf4_tokens": (48,),
    # Two blocks of 32 per layer: the Triton interpreter's cost grows with the model, the code paths do not.
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128},
    "batch": 2, "seq": 16, "steps": 1, "warmup": 0,  # one step exercises every path; a warm-up adds only time
}


def _timer(device: str):
    """``measure(fn, reps) -> median ms``: CUDA events on GPU, perf_counter on CPU."""
    import torch

    def measure(fn, reps: int = 20) -> float:
        for _ in range(3 if reps >= 10 else 1):  # warm-up (compilation, autotuning caches)
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return measure


def _peak_mib(fn, device: str) -> float:
    """Peak CUDA memory ``fn`` allocates above what was allocated before it (MiB); NaN on CPU."""
    import torch

    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_block_rotate(cfg: dict, device: str, dtype, reps: int) -> list[dict]:
    import torch

    from peftplug_kernels import ops

    measure = _timer(device)
    x = torch.randn(cfg["tokens"], cfg["width"], device=device, dtype=dtype, requires_grad=True)
    rot = torch.linalg.qr(torch.randn(cfg["width"] // cfg["block"], cfg["block"], cfg["block"], device=device))[0]
    rot.requires_grad_(True)
    grad = torch.randn_like(x)
    rows = []
    ref = ops.block_rotate(x, rot, impl="torch")
    for impl in ("torch", "triton"):
        out = ops.block_rotate(x, rot, impl=impl)
        err = float((out.detach().float() - ref.detach().float()).abs().max() / ref.detach().float().abs().max())

        def fwd(impl=impl):
            with torch.no_grad():
                ops.block_rotate(x, rot, impl=impl)

        def fwd_bwd(impl=impl):
            torch.autograd.grad(ops.block_rotate(x, rot, impl=impl), (x, rot), grad)

        rows.append({"op": "block_rotate", "impl": "torch einsum" if impl == "torch" else "triton",
                     "fwd_ms": measure(fwd, reps), "fwd_bwd_ms": measure(fwd_bwd, reps), "max_rel_err": err})
    return rows


def bench_cayley_neumann(cfg: dict, device: str, reps: int) -> list[dict]:
    """Triangle vectors -> rotation blocks for one ``width``-wide layer: the fused kernel vs the torch reference."""
    import torch

    from peftplug_kernels import ops

    measure = _timer(device)
    b = cfg["block"]
    q = (0.02 * torch.randn(cfg["width"] // b, b * (b - 1) // 2, device=device)).requires_grad_(True)
    ref = ops.cayley_neumann(q, b, impl="torch").detach()
    grad = torch.randn_like(ref)
    rows = []
    for impl in ("torch", "triton"):
        err = float((ops.cayley_neumann(q, b, impl=impl).detach() - ref).abs().max() / ref.abs().max())

        def fwd(impl=impl):
            with torch.no_grad():
                ops.cayley_neumann(q, b, impl=impl)

        def fwd_bwd(impl=impl):
            torch.autograd.grad(ops.cayley_neumann(q, b, impl=impl), (q,), grad)

        rows.append({"op": f"cayley_neumann, {cfg['width'] // b} blocks of {b}", "impl": impl,
                     "fwd_ms": measure(fwd, reps), "fwd_bwd_ms": measure(fwd_bwd, reps), "max_rel_err": err})
    return rows


def bench_nf4(cfg: dict, device: str, dtype, reps: int) -> list[dict]:
    import bitsandbytes as bnb
    import torch

    from peftplug_kernels import ops

    measure = _timer(device)
    layer = bnb.nn.Linear4bit(cfg["width"], cfg["out"], bias=False, compute_dtype=dtype, quant_type="nf4",
                              compress_statistics=True)
    layer.load_state_dict({"weight": torch.randn(cfg["out"], cfg["width"]) * 0.02})
    layer = layer.to(device)
    layer.support_avx512bf16_for_cpu = False  # keep the portable layout on CPU (see oftv2/bnb.py)
    layer.train()
    rot = torch.linalg.qr(torch.randn(cfg["width"] // cfg["block"], cfg["block"], cfg["block"], device=device))[0]
    rot.requires_grad_(True)
    state = layer.weight.quant_state
    rows = []
    # The fused kernel dequantizes each weight tile once per token tile: it should win most at few tokens
    # (decoding); the sweep shows where it stops winning against dequantize-once + cuBLAS.
    for tokens in cfg["nf4_tokens"]:
        x = torch.randn(tokens, cfg["width"], device=device, dtype=dtype, requires_grad=True)
        impls = {
            "rotate (torch) + bnb.matmul_4bit": lambda x=x: layer(ops.block_rotate(x, rot, impl="torch")),
            "rotate (triton) + bnb.matmul_4bit": lambda x=x: layer(ops.block_rotate(x, rot, impl="triton")),
            "fused nf4_rotate_matmul (triton)": lambda x=x: ops.nf4_rotate_matmul(x, rot, layer.weight, state,
                                                                                   impl="triton"),
        }
        with torch.no_grad():
            ref = impls["rotate (torch) + bnb.matmul_4bit"]().float()
        grad = torch.randn(tokens, cfg["out"], device=device, dtype=dtype)
        for name, fn in impls.items():
            with torch.no_grad():
                err = float((fn().float() - ref).abs().max() / ref.abs().max())

            def fwd(fn=fn):
                with torch.no_grad():
                    fn()

            def fwd_bwd(fn=fn, x=x, grad=grad):
                torch.autograd.grad(fn(), (x, rot), grad)

            rows.append({"op": f"nf4_rotate_matmul, {tokens} tokens", "impl": name, "fwd_ms": measure(fwd, reps),
                         "fwd_bwd_ms": measure(fwd_bwd, reps), "max_rel_err": err,
                         "fwd_bwd_peak_mib": _peak_mib(fwd_bwd, device)})
    return rows


def bench_dequantize(cfg: dict, device: str, dtype, reps: int) -> list[dict]:
    """deq(W) of an NF4 + double quant ``out × width`` weight: Triton kernel vs bitsandbytes vs torch reference."""
    import bitsandbytes.functional as bnbf
    import torch

    from peftplug_kernels import ops

    measure = _timer(device)
    packed, state = bnbf.quantize_4bit(torch.randn(cfg["out"], cfg["width"], device=device, dtype=dtype) * 0.02,
                                       blocksize=64, compress_statistics=True, quant_type="nf4")
    impls = {
        "bitsandbytes dequantize_4bit": lambda: bnbf.dequantize_4bit(packed, state),
        "torch reference": lambda: ops.dequantize_4bit(packed, state, impl="torch"),
        "triton": lambda: ops.dequantize_4bit(packed, state, impl="triton"),
    }
    ref = impls["bitsandbytes dequantize_4bit"]().float()
    rows = []
    for name, fn in impls.items():
        err = float((fn().float() - ref).abs().max() / ref.abs().max())
        rows.append({"op": f"nf4_dequantize {cfg['out']}×{cfg['width']}", "impl": name, "fwd_ms": measure(fn, reps),
                     "fwd_bwd_ms": float("nan"), "max_rel_err": err, "fwd_bwd_peak_mib": _peak_mib(fn, device)})
    return rows


def fused_crossover(rows: list[dict]) -> int | None:
    """The largest swept token count up to which the fused NF4 kernel's forward + backward beat rotate (triton) +
    bnb at every swept count (the last win before the first loss: a noisy later win does not extend it)."""
    by_tokens: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["op"].startswith("nf4_rotate_matmul, "):
            tokens = int(r["op"].split(", ")[1].split()[0])
            by_tokens.setdefault(tokens, {})[r["impl"]] = r["fwd_bwd_ms"]
    crossover = None
    for tokens in sorted(by_tokens):
        m = by_tokens[tokens]
        if not m.get("fused nf4_rotate_matmul (triton)", math.inf) < m.get("rotate (triton) + bnb.matmul_4bit", 0.0):
            break
        crossover = tokens
    return crossover


def _build_base(cfg: dict, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**cfg["llama"], max_position_embeddings=max(2048, cfg["seq"]))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.requires_grad_(False)
    quantize_linears_(model, dtype)
    return model


def _time_training(model, ids, cfg: dict, device: str) -> dict:
    """Median step time (ms), peak memory (GiB, CUDA only) and final loss of forward + backward + AdamW."""
    import torch

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-5)

    def step():
        return lm_train_step(model, optim, ids)

    for _ in range(cfg["warmup"]):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"step_ms": 1e3 * statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
            "trainable": sum(p.numel() for p in params), "loss": loss.item(),
            "params": sum(p.numel() for p in model.parameters())}


def bench_training(cfg: dict, device: str, dtype, dry_run: bool):
    """Yields one row per method (the caller saves after each, so a run cut short keeps the finished ones)."""
    import peft
    import torch

    import oftv2

    methods = {
        "QOFT (ours)": lambda m: peft.get_peft_model(m, oftv2.OFTv2Config(
            block_size=32, target_modules=TARGETS, kernel_impl="triton" if dry_run else "auto")),
        # The layer's "auto" fuses only up to the dispatch table's token count; this row keeps it at any size.
        "QOFT (ours, fused kernel forced)": lambda m: peft.get_peft_model(m, oftv2.OFTv2Config(
            block_size=32, target_modules=TARGETS, kernel_impl="triton")),
        "PEFT OFT (same 4-bit base)": lambda m: peft.get_peft_model(m, peft.OFTConfig(
            oft_block_size=32, r=0, target_modules=TARGETS, use_cayley_neumann=True)),
        "QLoRA r=16": lambda m: peft.get_peft_model(m, peft.LoraConfig(r=16, lora_alpha=32,
                                                                          target_modules=TARGETS)),
    }
    tokens = cfg["batch"] * cfg["seq"]
    ids = torch.randint(3, cfg["llama"]["vocab_size"], (cfg["batch"], cfg["seq"]), device=device)
    for name, build in methods.items():
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        row = _time_training(build(_build_base(cfg, device, dtype)), ids, cfg, device)
        if not math.isfinite(row["loss"]):
            raise RuntimeError(f"{name}: non-finite loss {row['loss']}")
        yield {"method": name, "tokens_per_s": tokens / (row["step_ms"] / 1e3), **row}


def render(results: dict) -> str:
    """The markdown section for docs/benchmarks/qoft.md; handles runs without bitsandbytes or training."""
    env, k = results["env"], results["config"]
    # Date, commit, CUDA and driver: recorded since 2026-12-08 (older files lack them).
    extra = "".join(f", {label} {env[key]}" for key, label in (("capability", "capability"), ("cuda", "CUDA"),
                                                                  ("driver", "driver"), ("commit", "commit"),
                                                                  ("date", "on")) if env.get(key))
    lines = ["## GPU", "", (f"Measured by `bash benchmarks/gpu/run_all.sh` on {env['device']} "
             f"(torch {env['torch']}, triton {env['triton']}, bitsandbytes {env['bitsandbytes']}{extra}); "
             f"{'DRY RUN at tiny sizes on CPU — not performance numbers' if env['dry_run'] else 'one run'}."), "",
             "| op | implementation | fwd ms | fwd+bwd ms | fwd+bwd peak MiB | max rel. error vs reference |",
             "|---|---|---|---|---|---|"]
    for r in results["kernels"]:
        lines.append(f"| {r['op']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                     f"{r.get('fwd_bwd_peak_mib', float('nan')):.1f} | {r['max_rel_err']:.2e} |")
    nf4 = ("" if "fused_crossover" not in results else
           f"; nf4_rotate_matmul and nf4_dequantize with an NF4 + double quant {k['out']} × {k['width']} weight at the "
           f"token counts in each row (errors relative to rotate (torch) + bnb, and to bitsandbytes' dequantize)")
    lines += ["", (f"Kernels: block_rotate on {k['tokens']} tokens × {k['width']}, cayley_neumann of that layer's "
                   f"blocks; rotation block {k['block']}; {env['dtype']}{nf4}. Errors are relative to the torch "
                   f"reference unless said. Peak MiB: memory allocated above the inputs during one call.")]
    if "fused_crossover" in results:
        crossover = results["fused_crossover"]
        lines += ["", (f"Fused NF4 forward + backward faster than rotate (triton) + bnb.matmul_4bit up to {crossover} "
                       f"tokens in this sweep" if crossover else
                       "The fused NF4 kernel was not faster than rotate (triton) + bnb.matmul_4bit at any swept token "
                       "count") + f"; when this run was taken, `auto` fused up to {results['fused_max_tokens']} tokens (today: "
                       "`peftplug_kernels.dispatch_table`)."]
    else:
        lines += ["", "bitsandbytes was not installed: no NF4 or training rows (carry its wheel in `.whl/`)."]
    if results["training"]:
        lines += ["", "| training step | step ms (median) | vs QLoRA | tokens/s | peak GiB | vs QLoRA | trainable |",
                  "|---|---|---|---|---|---|---|"]
        # A run cut short may lack the QLoRA row (it runs last): then there are no ratios, rather than wrong ones.
        qlora = next((r for r in results["training"] if r["method"].startswith("QLoRA")), None)

        def ratio(r, key):
            return "—" if qlora is None else f"{r[key] / qlora[key]:.3f}×"

        for r in results["training"]:
            lines.append(f"| {r['method']} | {r['step_ms']:.1f} | {ratio(r, 'step_ms')} | {r['tokens_per_s']:,.0f} | "
                         f"{r['peak_gib']:.2f} | {ratio(r, 'peak_gib')} | {r['trainable']:,} |")
        # numel of a 4-bit layer's packed weight is half its parameters: say "stored elements", not parameters.
        lines += ["", (f"Training: Llama-shaped (random weights, NF4 + double quant, {env['dtype']} compute; "
                  f"{results['training'][0]['params'] / 1e9:.2f}B stored parameter elements, where a 4-bit weight "
                  f"counts one per byte, i.e. half its parameters), batch {k['batch']}×{k['seq']}, "
                  f"median of {k['steps']} steps after {k['warmup']} warm-up steps.")]
    elif "fused_crossover" in results:  # run_all.sh passes --skip-training: the step table moved to gpu_step
        lines += ["", ("Training step (QOFT vs QLoRA r=16 on the same NF4 base): not in this run; `run_all.sh` times it "
                       "with `python -m benchmarks.oftv2.gpu_step` (docs/benchmarks/oftv2.md, GPU section).")]
    lines += ["", ("Targets (issue 41, timed by `python -m benchmarks.kernels.nf4_sweep`): fused NF4 forward ≤ 0.05 ms "
                   "at 16 tokens, forward ≤ 0.30 ms and forward + backward ≤ 1.0 ms at 4096 tokens (4096²); QOFT step "
                   "time ≤ 0.95× QLoRA's; QOFT peak memory ≤ 1.02× QLoRA's.")]
    return "\n".join(lines) + "\n"


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the ``qoft-gpu`` section of ``page`` from a committed GPU result file (the CPU section is kept). Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: A ``gpu_results.json``.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        write_section(page, SECTION, render(record), "# QOFT benchmarks (OFTv2 on bitsandbytes 4-bit bases)")

    return render_results(results, render_page)


def _nf4_rows(record: dict) -> int:
    return sum(1 for r in record.get("kernels", []) if r.get("op", "").startswith("nf4_"))


def merge_docs(path: Path) -> None:
    """Commits a GPU run's ``gpu_results.json`` as this study's result and renders its page section.

    Args:
        path: The run's ``gpu_results.json``, or the ``gpu_results.md`` beside it.

    Raises:
        ValueError: Before anything is written, for a missing or malformed file, a dry run (tiny sizes on CPU are
            no measurement), or a run without NF4 rows (bitsandbytes missing, or cut by its time limit before them)
            that would replace a committed run which has them: the page shows one run, so that table would vanish.
    """
    path = path.with_name("gpu_results.json") if path.suffix == ".md" else path
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("env"), dict) or "kernels" not in record:
        raise ValueError(f"{path} is not a gpu_results.json of benchmarks.kernels.gpu (missing, or no env / kernels)")
    if record["env"].get("dry_run"):
        raise ValueError(f"{path} is a dry run (tiny sizes on CPU): only a GPU run is merged into the docs")
    committed = read_json(RESULTS) or {}
    if _nf4_rows(committed) and not _nf4_rows(record):
        raise ValueError(f"{path} has no NF4 rows while the committed {RESULTS.name} "
                         f"({committed.get('env', {}).get('device')}) has {_nf4_rows(committed)}: merging it would drop "
                         "them from the page; rerun the kernel phase, or delete the committed file to replace it")
    write_json(RESULTS, record, indent=2)
    report(RESULTS, PAGE)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="GPU benchmarks of the QOFT kernels and training step")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (Triton interpreter)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/out"))
    parser.add_argument("--merge-docs", type=Path, default=None,
                        help="commit a run's gpu_results.json (or the .md beside it) and render the page; exit")
    parser.add_argument("--report", action="store_true", help="render the page from the committed results; exit")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-bnb", action="store_true",
                        help="without bitsandbytes: only the block_rotate and cayley_neumann kernels")
    args = parser.parse_args(argv)
    if args.merge_docs:
        try:
            merge_docs(args.merge_docs)
        except (OSError, ValueError) as err:  # a wrong file: one line, not a traceback
            raise SystemExit(f"--merge-docs: {err}") from None
        return {}
    if args.report:
        if not report(RESULTS, PAGE):
            raise SystemExit(f"no GPU result file at {RESULTS}: run benchmarks/gpu/run_all.sh on a GPU first")
        return {}
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1" and "peftplug_kernels.block_rotate.triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if args.dry_run:
        torch.set_num_threads(1)  # tiny tensors: extra threads only add hand-off latency on shared cores
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to exercise the code paths on CPU")
    cfg = DRY if args.dry_run else FULL
    # The fused NF4 kernels take fp16/bf16 only; on the CPU interpreter fp16 keeps more mantissa than bf16.
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    reps = 1 if args.dry_run else 50  # dry run: one warm-up call and one timed call run every path
    import triton

    if args.skip_bnb:
        bnb_version = "not installed"
    else:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    from peftplug_kernels.dispatch_table import fused_nf4_max_tokens

    results = {"env": {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU",
                       "torch": torch.__version__, "triton": triton.__version__,
                       "bitsandbytes": bnb_version, "dtype": str(dtype).replace("torch.", ""),
                       "dry_run": args.dry_run, **run_provenance(device)},
               "config": {k: v for k, v in cfg.items() if k != "llama"}}
    # Written after each stage, so a run cut short by its time limit still leaves what it measured.
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(args.out / "gpu_results.json", results, indent=2)

    results["kernels"] = bench_block_rotate(cfg, device, dtype, reps) + bench_cayley_neumann(cfg, device, reps)
    results["training"] = []
    save()
    if not args.skip_bnb:
        results["kernels"] += bench_nf4(cfg, device, dtype, reps) + bench_dequantize(cfg, device, dtype, reps)
        results["fused_crossover"] = fused_crossover(results["kernels"])
        results["fused_max_tokens"] = fused_nf4_max_tokens(device)
        save()
        if not args.skip_training:
            for row in bench_training(cfg, device, dtype, args.dry_run):
                results["training"].append(row)
                save()
    save()
    write_page(args.out / "gpu_results.md", render(results))
    print(render(results))
    return results


if __name__ == "__main__":
    main()
