"""Adapter-only ``peftplug fit`` checkpoints written before ``peftplug.adapter_params`` (parameter keys
``...oftv2_Q.default`` / ``...steer_vector.default``, now ``....default.weight``) still load: through
``load_checkpoint_module`` (``peftplug generate``/``export``) and as ``fit --ckpt_path`` (resume)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from peftplug.adapter_params import PARAM_NAME
from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import cli

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(8)]
PEFT = {
    "oftv2": {"peft_type": "OFTV2", "block_size": 8, "target_modules": ["q_proj", "v_proj"]},
    "steering": {"peft_type": "STEERING", "layers": [0, 1]},
}


def _recipe(root, peft: dict, max_steps: int):
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": max_steps, "accelerator": "cpu", "devices": 1, "logger": False,
                    "default_root_dir": str(root / "runs"), "enable_progress_bar": False,
                    "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0},
        "model": {"model": "tiny:llama", "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}},
                  "peft": peft},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(root / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 2, "val_fraction": 0.25}},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _to_old_layout(path) -> dict[str, torch.Tensor]:
    """Rewrites the checkpoint's adapter keys as the old layout saved them; returns the adapter tensors."""
    ckpt = torch.load(path, weights_only=False)
    suffix = f".default.{PARAM_NAME}"
    adapter = {k: v for k, v in ckpt["state_dict"].items() if k.endswith(suffix)}
    assert adapter, sorted(ckpt["state_dict"])[:5]
    ckpt["state_dict"] = {(k[: -len(PARAM_NAME) - 1] if k in adapter else k): v for k, v in ckpt["state_dict"].items()}
    torch.save(ckpt, path)
    return adapter


@pytest.mark.parametrize("method", list(PEFT))
def test_old_layout_checkpoint_loads_and_resumes(tmp_path, method):
    recipe = _recipe(tmp_path, PEFT[method], max_steps=2)
    cli(["fit", "--config", str(recipe)])
    (path,) = (tmp_path / "runs").rglob("*.ckpt")
    adapter = _to_old_layout(path)

    module = load_checkpoint_module(path)
    own = module.state_dict()
    for key, value in adapter.items():
        assert torch.equal(own[key], value), key

    resumed = cli(["fit", "--config", str(recipe), "--trainer.max_steps", "3", "--ckpt_path", str(path)])
    assert resumed.trainer.global_step == 3
