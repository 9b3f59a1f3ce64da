"""Peak memory and zeroth-order step cost of the SmolLM2 grid's optimizers, one measurement per fresh process.

    python -m benchmarks.helene.smollm2.measure --memory MODE --out FILE   # peak RSS (CUDA memory on a GPU)
    python -m benchmarks.helene.smollm2.measure --speed --out FILE         # ZO step: forwards vs the rest

``python -m benchmarks.helene.smollm2 memory`` / ``speed`` start these processes (the peak is per process) and
write ``benchmarks/helene/results/helene_llm/memory_<mode>.json`` / ``speed.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common.device import lightning_device, to_device
from benchmarks.common.pages import write_json
from benchmarks.common.provenance import cpu_flags, peak_rss_mib
from benchmarks.helene.smollm2 import runs
from benchmarks.helene.smollm2.runs import RunSpec

MEMORY_MODES = ("imports", "inference", "mezo_full", "helene_full", "adamw_lora", "adamw_full")


def measure_memory(mode: str, steps: int = 3) -> dict:
    """Peak RSS of this (fresh) process after ``mode``: a few steps (or test batches) on SST-2 k=16 seed 42."""
    import lightning as L

    from peftplug.lightning import PeftModule

    if mode == "imports":
        return {"mode": mode, "peak_rss_mib": peak_rss_mib()}
    method = {"inference": "zeroshot", "mezo_full": "mezo", "helene_full": "helene",
              "adamw_lora": "adamw_lora", "adamw_full": "adamw_full"}[mode]
    spec = RunSpec("sst2", 42, method if method != "adamw_full" else "mezo", lr=1e-6, steps=steps, max_test=64)
    module, data = runs.build(spec)
    if mode == "adamw_full":
        module = PeftModule(runs.MODEL, task="prompt_cls", optimizer=partial(torch.optim.AdamW, lr=1e-6))
        data.tokenizer = module.tokenizer
    data.setup()
    trainer = L.Trainer(**lightning_device(runs.DEVICE), max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, limit_test_batches=2, default_root_dir=str(runs.SCRATCH / "lightning"))
    if mode == "inference":
        trainer.test(module, datamodule=data, verbose=False)
    else:
        trainer.fit(module, datamodule=data)
    params = sum(p.numel() for p in module.model.parameters())
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    return {"mode": mode, "peak_rss_mib": peak_rss_mib(), **runs.cuda_memory(), "device": runs.device_name(), "params": params,
            "trainable": trainable, "param_mib": sum(p.numel() * p.element_size() for p in module.model.parameters()) / 2**20,
            "steps": steps, "batch_size": spec.batch_size}


# ---------------------------------------------------------------------------------------------------- speed
def measure_speed(batches=(8, 16, 32, 64, 128), length: int = 48, steps: int = 3) -> dict:
    """ZO step breakdown on SmolLM2 full parameters: forward time vs perturbation/update time per step.

    Random token ids, ``length`` tokens, no padding (timing does not depend on content). For each method at batch
    16 it times ``steps`` optimizer steps and the closures inside them; for each batch size the forward alone.
    MeZO and HELENE are timed with Gaussian and with Rademacher z (``mezo_rademacher``, ``helene_rademacher``).
    """
    from helene import ZOSGD, Helene
    from peftplug.lightning import PeftModule
    from peftplug.prompt_cls import prompt_cls_forward

    device = torch.device(runs.DEVICE)
    module = PeftModule(runs.MODEL, task="prompt_cls")
    model = module.model.eval().to(device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    words = torch.tensor([1109, 13321])

    def clock() -> float:
        # CUDA runs asynchronously: a wall-clock reading means something only once the queued kernels have run.
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def batch_of(b):
        batch = {"input_ids": torch.randint(0, vocab, (b, length), generator=gen),
                 "attention_mask": torch.ones(b, length, dtype=torch.long), "label_word_ids": words,
                 "labels": torch.randint(0, 2, (b,), generator=gen)}
        return to_device(batch, device)

    out: dict = {"length": length, "threads": torch.get_num_threads(), "device": runs.device_name(),
                 "params": sum(p.numel() for p in model.parameters()), "forward": {}, "steps": {}}
    with torch.no_grad():
        for b in batches:
            batch = batch_of(b)
            prompt_cls_forward(model, batch)
            times = []
            for _ in range(2 if device.type == "cpu" else 10):
                t = clock()
                prompt_cls_forward(model, batch)
                times.append(clock() - t)
            out["forward"][b] = min(times)
    batch = batch_of(16)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Each optimizer with MeZO's Gaussian z (what the grid runs) and with Rademacher z (cheaper to draw).
    makers = {}
    for z in ("gaussian", "rademacher"):
        suffix = "" if z == "gaussian" else "_rademacher"
        makers["mezo" + suffix] = partial(ZOSGD, params, lr=1e-7, seed=0, perturbation=z)
        makers["helene" + suffix] = partial(Helene, params, lr=1e-7, layerwise="tensor", batch_size=16,
                                            anneal_horizon=30.0, seed=0, perturbation=z, preconditioner="hessian")
    for name, make in makers.items():
        opt = make()
        fwd: list[float] = []

        def closure(fwd=fwd):
            t = clock()
            loss = prompt_cls_forward(model, batch).loss
            fwd.append(clock() - t)
            return loss

        rows = []
        for _ in range(steps if device.type == "cpu" else 3 * steps):
            fwd.clear()
            t = clock()
            opt.step(closure)
            total = clock() - t
            rows.append({"step": total, "forward": sum(fwd), "overhead": total - sum(fwd)})
        out["steps"][name] = rows
        del opt
    return out


def main() -> None:
    """Runs one measurement (``--memory MODE`` or ``--speed``) and writes it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", choices=MEMORY_MODES)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default=runs.DEVICE, help="cpu, cuda or auto")
    args = parser.parse_args()
    runs.set_device(args.device)
    result = measure_memory(args.memory) if args.memory else measure_speed()
    write_json(args.out, record(result))


def record(result: dict) -> dict:
    """A measurement as its result file keeps it: with the commit, the load average and the CPU's flags (a CPU
    timing means little without them: bf16 and bitsandbytes' 4-bit paths depend on AVX512-BF16).

    Args:
        result: What :func:`measure_memory` or :func:`measure_speed` returned.
    """
    return {**result, "commit": runs.git_commit(runs.CODE), "loadavg": os.getloadavg(), "cpu_flags": cpu_flags()}


if __name__ == "__main__":
    main()
