"""QOFT on CPU: merge drift into a 4-bit base (ours vs PEFT's OFT merge) and training-step time vs LoRA-on-4-bit.

1. Merge drift. One Llama-shaped model (random weights) is quantized by transformers' bitsandbytes integration;
   the same OFT adapter (PEFT's Cayley–Neumann polynomial, so both libraries apply the identical R) is put on it
   by OFTv2 and by PEFT 0.21's OFT. Each library merges into the 4-bit base (dequantize -> rotate -> requantize)
   and we compare the merged model's logits with the unmerged adapter's on a calibration batch
   (relative Frobenius distance; ``base`` = adapters disabled, for scale). Ours is reported with both
   requantizers: ``absmax`` (bitsandbytes' own, what PEFT uses) and ``mse`` (per-block MSE-optimal scales, the
   default). Calibration text: SST-2 sentences from ``--data-dir`` through the char tokenizer when present, else
   random token ids.
2. Step time. Forward + backward + AdamW step of QOFT (reference torch path, b=32), PEFT OFT and LoRA r=16, all on
   the same NF4 double-quant base; methods interleaved round by round, medians of process CPU time per step with
   one torch thread (on shared cores wall time mostly measures waiting; wall medians are reported beside it).

Run: ``python -m benchmarks.oftv2.qoft [--quick]`` from the repository root; writes the raw results to
``benchmarks/oftv2/results/qoft.json`` and renders them into the ``qoft-cpu`` section of docs/benchmarks/qoft.md
(``--report``: render only). The page's ``qoft-gpu`` section is written by ``benchmarks/gpu/run_all.sh`` when a
GPU is available (:mod:`benchmarks.kernels.gpu`).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common.llama import TARGETS, llama
from benchmarks.common.pages import (
    outputs,
    render_results,
    require_results,
    write_json,
    write_section,
)
from benchmarks.common.paths import DOCS, data_dir, results_dir
from benchmarks.common.provenance import provenance, provenance_line

PAGE = DOCS / "qoft.md"
TITLE = "# QOFT benchmarks (OFTv2 on bitsandbytes 4-bit bases)"
SECTION = "qoft-cpu"
RESULTS = results_dir("oftv2") / "qoft.json"


def load_4bit(path: Path, quant_type: str, double_quant: bool):
    """Loads a saved checkpoint as a bitsandbytes 4-bit model on CPU (fp32 compute)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                 bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig, device_map="cpu")


def calibration_batch(data_dir: Path, batch: int, seq: int, vocab: int) -> tuple[dict, str]:
    """Token ids of real sentences (SST-2 via the char tokenizer) when available, else random ids."""
    tsv = data_dir / "SST-2" / "dev.tsv"
    if tsv.is_file():
        from peftplug.tiny import char_tokenizer

        with tsv.open() as f:
            rows = [r[0] for r in csv.reader(f, delimiter="\t")][1 : batch + 1]
        enc = char_tokenizer()(rows, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, "SST-2 dev sentences"
    ids = torch.randint(4, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids}, "random token ids"


def oftv2_config(block_size: int):
    import oftv2

    return oftv2.OFTv2Config(block_size=block_size, target_modules=TARGETS, orthogonalization="peft_cn",
                             neumann_terms=5, kernel_impl="torch")


def drift_rows(ckpt: Path, batch: dict, block_size: int, q_std: float, seeds: int) -> list[dict]:
    """Merge drift of ours (mse, absmax) and PEFT's OFT for several quantization settings, mean over seeds."""
    import peft
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from oftv2 import bnb as qoft
    from oftv2.interop import oft_config_from_oftv2, state_dict_to_peft_oft

    rows = []
    for quant_type, double_quant in (("nf4", True), ("nf4", False), ("fp4", True)):
        acc: dict[str, list[float]] = {}
        for seed in range(seeds):
            config = oftv2_config(block_size)

            def make_ours(quant_type=quant_type, double_quant=double_quant, config=config, seed=seed):
                # A fresh base per measurement: a merge/unmerge round trip requantizes the base twice.
                model = peft.get_peft_model(load_4bit(ckpt, quant_type, double_quant), config)
                gen = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "oftv2_Q" in name:
                            p.copy_(torch.randn(p.shape, generator=gen) * q_std)
                return model

            results = {}
            for mode in ("absmax", "mse"):
                ours = make_ours()
                for m in ours.modules():
                    if isinstance(m, qoft.Linear4bit):
                        m.requantization = mode
                d = qoft.merge_drift(ours, batch)
                results[f"ours ({mode})"] = d["merged_vs_adapter"]
                results["base vs adapter"] = d["base_vs_adapter"]
                results[f"ours ({mode}) after unmerge"] = d["unmerged_vs_adapter"]
            for repack in (True, False):
                theirs = peft.get_peft_model(load_4bit(ckpt, quant_type, double_quant),
                                             oft_config_from_oftv2(config))
                set_peft_model_state_dict(theirs, state_dict_to_peft_oft(get_peft_model_state_dict(ours), config))
                if not repack:
                    # PEFT's merge math on the portable layout (bitsandbytes' CPU repacking off, as in our layers).
                    for m in theirs.modules():
                        if hasattr(m, "support_avx512bf16_for_cpu"):
                            m.support_avx512bf16_for_cpu = False
                    ours = make_ours()
                    with torch.no_grad():
                        ours.eval(), theirs.eval()
                        a, b = ours(**batch).logits, theirs(**batch).logits
                    results["adapter parity (ours vs PEFT, unmerged)"] = float((a - b).norm() / a.norm())
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    d = qoft.merge_drift(theirs, batch)
                if repack:
                    results["PEFT 0.21 OFT, CPU repack on"] = d["merged_vs_adapter"]
                else:
                    results["PEFT 0.21 OFT"] = d["merged_vs_adapter"]
                    results["PEFT 0.21 OFT after unmerge"] = d["unmerged_vs_adapter"]
            for k, v in results.items():
                acc.setdefault(k, []).append(v)
        rows.append({"setting": f"{quant_type}{' + double quant' if double_quant else ''}",
                     **{k: statistics.mean(v) for k, v in acc.items()}})
    return rows


def _step_fn(model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-4)
    labels = batch["input_ids"]

    def step():
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss

    return step, sum(p.numel() for p in params)


def step_rows(ckpt: Path, batch: dict, block_size: int, steps: int, warmup: int) -> list[dict]:
    """Median step time (process CPU and wall) of QOFT, PEFT OFT and QLoRA on the same NF4 base, interleaved."""
    import peft

    methods = {
        "QOFT (ours, torch path)": lambda m: peft.get_peft_model(m, oftv2_config(block_size)),
        "PEFT OFT on 4-bit": lambda m: peft.get_peft_model(m, peft.OFTConfig(
            oft_block_size=block_size, r=0, target_modules=TARGETS, use_cayley_neumann=True)),
        "LoRA r=16 on 4-bit (QLoRA)": lambda m: peft.get_peft_model(m, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS)),
    }
    runners = {}
    for name, build in methods.items():
        model = build(load_4bit(ckpt, "nf4", True))
        model.train()
        runners[name] = _step_fn(model, batch)
    cpu = {n: [] for n in methods}
    wall = {n: [] for n in methods}
    for i in range(warmup + steps):
        for name, (step, _) in runners.items():
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            if i >= warmup:
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    lora = statistics.median(cpu["LoRA r=16 on 4-bit (QLoRA)"])
    return [{"method": n, "trainable": runners[n][1], "cpu_ms": 1e3 * statistics.median(cpu[n]),
             "wall_ms": 1e3 * statistics.median(wall[n]), "vs_lora": statistics.median(cpu[n]) / lora}
            for n in methods]


def render(drift: list[dict], steps: list[dict], info: dict) -> str:
    """The ``qoft-cpu`` section.

    Args:
        drift: :func:`drift_rows`' rows.
        steps: :func:`step_rows`' rows.
        info: Setup, calibration, seeds, ``q_std``, batch and steps of the run.
    """
    cols = ["ours (mse)", "ours (absmax)", "PEFT 0.21 OFT", "PEFT 0.21 OFT, CPU repack on", "base vs adapter",
            "ours (mse) after unmerge", "PEFT 0.21 OFT after unmerge", "adapter parity (ours vs PEFT, unmerged)"]
    lines = [
        "Generated by `python -m benchmarks.oftv2.qoft` (CPU) and `bash benchmarks/gpu/run_all.sh` (GPU section).",
        f"Setup: {info['setup']}. Numbers come from one run on shared CPU cores; compare ratios, not absolutes.",
        "",
        "## Merge drift into a 4-bit base (CPU)",
        "",
        ("Relative Frobenius distance of the logits to the unmerged adapter's, on the calibration batch "
        f"({info['calibration']}); mean over {info['seeds']} random adapters with Q entries ~ N(0, {info['q_std']}²)."),
        "`base vs adapter` is how far the un-adapted model is (a merge that lost the rotation would sit there).",
        ("`PEFT 0.21 OFT, CPU repack on`: PEFT's merge after an eval forward with bitsandbytes' default CPU path, "
        "which repacks 4-bit weights in place (bitsandbytes 0.50, AVX512-BF16 CPUs); PEFT then dequantizes the "
        "repacked layout as if it were the portable one. Our adapted layers switch that repacking off; "
        "`PEFT 0.21 OFT` is PEFT's merge with it off too (the like-for-like comparison)."),
        "",
        "| quantization | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for r in drift:
        lines.append(f"| {r['setting']} | " + " | ".join(f"{r[c]:.4f}" for c in cols) + " |")
    lines += [
        "",
        ("`ours (absmax)` requantizes exactly like bitsandbytes (and PEFT); `ours (mse)` picks each block's scale "
        "from 0.70–1.00 × absmax to minimise the block's squared error — same storage format, readable by every "
        "bitsandbytes kernel. The default (`requantization=\"auto\"`) is `mse` for NF4 and `absmax` for FP4, "
        "chosen from these measurements."),
        "",
        "## Training step on a 4-bit base (CPU)",
        "",
        (f"Forward + backward + AdamW, NF4 + double quant base, batch {info['batch']}, median of {info['steps']} "
        "interleaved steps; process CPU time with one torch thread (wall time beside it)."),
        "",
        "| method | trainable params | CPU ms/step | wall ms/step | CPU time vs QLoRA |",
        "|---|---|---|---|---|",
    ]
    for r in steps:
        lines.append(f"| {r['method']} | {r['trainable']:,} | {r['cpu_ms']:.1f} | {r['wall_ms']:.1f} | "
                     f"{r['vs_lora']:.3f}× |")
    lines += ["", "Target: QOFT within 1.1× of LoRA-on-4-bit on this reference (non-fused) path.", ""]
    return "\n".join(lines)


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the ``qoft-cpu`` section of ``page`` from a result file (the GPU section is kept). Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON that :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        body = render(record["drift"], record["steps"], record["info"]) + f"\n{provenance_line(record['provenance'])}\n"
        write_section(page, SECTION, body, TITLE)

    return render_results(results, render_page)


def main(argv=None) -> None:
    """Measures, writes the result file and renders the page section (``--report``: renders only).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller model, fewer steps/seeds (~1 minute); prints only unless --out is given")
    parser.add_argument("--data-dir", type=Path, default=None, help="default: peftplug.datadir.default_data_dir()")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help="page to write, its result file beside it (default: docs/benchmarks/qoft.md with "
                             "benchmarks/oftv2/results/qoft.json)")
    parser.add_argument("--report", action="store_true", help="render the page from the result file; measure nothing")
    args = parser.parse_args(argv)
    page, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, page), results)
        return
    args.data_dir = args.data_dir or data_dir()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import oftv2  # noqa: F401  (registers the PEFT type)
    from peftplug.tiny import CHAR_VOCAB_SIZE

    width, layers, seq, bsz = (128, 2, 64, 4) if args.quick else (256, 4, 128, 4)
    block = 32
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        llama(width, layers, CHAR_VOCAB_SIZE, seed=0).save_pretrained(ckpt)
        batch, calibration = calibration_batch(args.data_dir, bsz, seq, CHAR_VOCAB_SIZE)
        drift = drift_rows(ckpt, batch, block, q_std=0.02, seeds=1 if args.quick else 3)
        steps = step_rows(ckpt, batch, block, steps=5 if args.quick else 20, warmup=2)
    info = {"setup": f"Llama-shaped random model (hidden {width}, {layers} layers, all 7 linear projections "
                     f"adapted, OFT block {block}, PEFT's Cayley–Neumann form, 5 terms), torch threads {args.threads}",
            "calibration": calibration, "seeds": 1 if args.quick else 3, "q_std": 0.02,
            "batch": f"{bsz}×{seq}", "steps": 5 if args.quick else 20}
    print(render(drift, steps, info))
    if args.quick and args.out is None:
        return
    write_json(results, {"info": info, "drift": drift, "steps": steps, "provenance": provenance()})
    report(results, page)


if __name__ == "__main__":
    main()
