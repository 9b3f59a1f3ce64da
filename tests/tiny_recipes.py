"""A ``peftplug fit`` recipe on ``tiny:llama`` with prompt/response rows, written to disk: the recipe the resume,
interrupt, checkpoint-layout, export and generate tests train, each with its own trainer, adapter and data settings."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

#: The optimizer these tests train with unless they name another.
ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}


def causal_recipe(root: Path, rows: list[dict], *, peft: dict, optimizer: dict | None = ADAMW,
                  lr_scheduler: dict | None = None, trainer: dict | None = None, data: dict | None = None) -> Path:
    """Writes ``root/train.jsonl`` (``rows``) and ``root/recipe.yaml`` (CPU, quiet, runs under ``root/runs``).

    Args:
        root: The run's folder (created).
        rows: ``{"prompt": ..., "response": ...}`` rows.
        peft: The recipe's ``model.peft``.
        optimizer: The recipe's ``model.optimizer`` (``None``: PeftModule's default).
        lr_scheduler: The recipe's ``model.lr_scheduler`` (none when ``None``).
        trainer: Further ``trainer`` settings (``max_steps``, validation limits, ...).
        data: Further ``CausalLMData`` arguments (``val_fraction``, ...).

    Returns:
        The recipe's path.
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    model = {"model": "tiny:llama", "peft": peft}
    if optimizer is not None:
        model["optimizer"] = optimizer
    if lr_scheduler is not None:
        model["lr_scheduler"] = lr_scheduler
    recipe = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "default_root_dir": str(root / "runs"),
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    **(trainer or {})},
        "model": model,
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(root / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 2, **(data or {})}},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def one_step_lora_checkpoint(root: Path) -> Path:
    """Runs a one-step LoRA ``peftplug fit`` of the tiny Llama under ``root`` and returns its checkpoint."""
    from peftplug.cli import main

    rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
    recipe = causal_recipe(root, rows, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           optimizer=None, trainer={"max_steps": 1, "limit_val_batches": 0}, data={"batch_size": 4})
    assert main(["fit", "--config", str(recipe)]) == 0
    (path,) = (root / "runs").rglob("*.ckpt")
    return path
