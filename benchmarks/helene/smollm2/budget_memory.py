"""Peak RSS of the equal-forward-pass comparison's optimizers and of nf4 inference, one fresh process per mode.

    python -m benchmarks.helene.smollm2.budget_memory --mode MODE --out FILE

``python -m benchmarks.helene.smollm2.budget_cli memory`` starts one such process per mode (the peak is per
process; the queue's processes run many runs each, so their own ``peak_rss_mib`` is the largest so far) and writes
``benchmarks/helene/results/helene_budget/memory_<mode>.json``. Modes: ``inference`` (fp32, 3 test batches at the
training batch size, 16: the forward a zeroth-order step repeats, so the ratio is the optimizer's cost and not the
batch's), ``nf4_inference`` (the same on the nf4 base, the adapter-free model the ZO-on-nf4 runs are compared
against), or
a zeroth-order method of :data:`benchmarks.helene.smollm2.runs.OPTIMIZERS` (3 steps on SST-2 k=16 seed 42, batch 16;
full parameters, or OFTv2 on nf4 for the ``*_nf4`` methods). Same imports (Lightning + PeftModule) in every mode.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.common.device import lightning_device
from benchmarks.common.pages import write_json
from benchmarks.common.provenance import cpu_flags, current_rss_mib, peak_rss_mib
from benchmarks.helene.smollm2 import runs
from benchmarks.helene.smollm2.runs import RunSpec

INFERENCE_MODES = ("inference", "nf4_inference")


def modes() -> tuple[str, ...]:
    """Every mode this script measures: the two inference modes and each zeroth-order method."""
    return INFERENCE_MODES + runs.ZO_METHODS


def measure(mode: str, steps: int = 3) -> dict:
    """Peak RSS of this (fresh) process after ``mode`` (see the module docstring).

    Args:
        mode: One of :func:`modes`.
        steps: Optimizer steps of a training mode.

    Raises:
        ValueError: For an unknown mode.
    """
    import lightning as L

    from peftplug.lightning import PeftModule

    if mode not in modes():
        raise ValueError(f"mode must be one of {', '.join(modes())}, got {mode!r}")
    inference = mode in INFERENCE_MODES
    spec = RunSpec("sst2", 42, "zeroshot" if inference else mode, lr=1e-6, steps=steps, max_test=64)
    if mode == "nf4_inference":
        # The base alone (no adapter), loaded once: what ZO on nf4 is compared against.
        module = PeftModule(runs.MODEL, task="prompt_cls", quantization="nf4")
        data = runs.data_module(spec, module.tokenizer)
    else:
        module, data = runs.build(spec)
    if inference:
        # At the grid's evaluation batch (32) the logits alone take ~2× a training step's: compare equal batches.
        data.eval_batch_size = spec.batch_size
    data.setup()
    trainer = L.Trainer(**lightning_device(runs.DEVICE), max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, limit_test_batches=steps, default_root_dir=str(runs.SCRATCH / "lightning"))
    if inference:
        trainer.test(module, datamodule=data, verbose=False)
    else:
        trainer.fit(module, datamodule=data)
    params = list(module.model.parameters())
    quantization = {"inference": "none", "nf4_inference": "nf4"}.get(mode) or runs.OPTIMIZERS[mode].quantization
    return {"mode": mode, "peak_rss_mib": peak_rss_mib(), "rss_end_mib": current_rss_mib(), **runs.cuda_memory(), "device": runs.device_name(),
            "quantization": quantization,
            "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
            "steps": 0 if inference else steps, "batch_size": spec.batch_size,
            "eval_batch_size": data.eval_batch_size if inference else None, "cpu_flags": cpu_flags()}


def main() -> None:
    """Measures one mode (``--mode``) and writes it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=modes())
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default=runs.DEVICE, help="cpu, cuda or auto")
    args = parser.parse_args()
    runs.set_device(args.device)
    write_json(args.out, {**measure(args.mode), "commit": runs.git_commit(runs.CODE), "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
