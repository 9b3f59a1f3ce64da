"""Adapter-only ``peftplug fit`` checkpoints written before ``peftplug.adapter_params`` (parameter keys
``...oftv2_Q.default`` / ``...steer_vector.default``, now ``....default.weight``) still load: through
``load_checkpoint_module`` (``peftplug generate``/``export``) and as ``fit --ckpt_path`` (resume)."""

from __future__ import annotations

import pytest
import torch
from tiny_recipes import causal_recipe

from peftplug.adapter_params import PARAM_NAME
from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import cli

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(8)]
PEFT = {
    "oftv2": {"peft_type": "OFTV2", "block_size": 8, "target_modules": ["q_proj", "v_proj"]},
    "steering": {"peft_type": "STEERING", "layers": [0, 1]},
}


def _recipe(root, peft: dict, max_steps: int):
    return causal_recipe(root, ROWS, peft=peft, optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}},
                         trainer={"max_steps": max_steps, "limit_val_batches": 0}, data={"val_fraction": 0.25})


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
