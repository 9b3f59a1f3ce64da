"""A first-order ``ReduceLROnPlateau`` that Lightning would step before ``val_loss`` exists is refused before training.

Lightning steps the plateau scheduler on ``val_loss`` at each of its scheduler steps and raised
``MisconfigurationException: ReduceLROnPlateau conditioned on metric val_loss which is not available ... set using
`monitor` key in lr scheduler dict`` — a key no recipe can set — after the first training step
(``lr_scheduler_interval: step``, the default) or after a whole epoch (a run that does not validate).
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from peft import LoraConfig

from peftplug.data import CausalLMData
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule

LR = 1e-2


def plateau(optimizer):
    # threshold=inf in "max" mode: no validation counts as an improvement, so each one halves the rate.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0,
                                                      threshold=float("inf"), threshold_mode="abs")


def _fit(tmp_path, interval, **trainer_args):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q{i}?", "response": f" {i}"}) for i in range(12)))
    data = CausalLMData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=4,
                        val_fraction=0.25)
    module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"]),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=LR), lr_scheduler=plateau,
                        lr_scheduler_interval=interval)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        num_sanity_val_steps=0, max_epochs=2, **trainer_args)
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.parametrize("interval, trainer_args, match", [
    ("step", {}, (r"^model\.lr_scheduler_interval: step steps model\.lr_scheduler \(ReduceLROnPlateau\) .* "
                  r"--model\.lr_scheduler_interval epoch")),
    ("epoch", {"limit_val_batches": 0}, r"^trainer\.limit_val_batches: 0 runs no validation"),
])
def test_a_plateau_scheduler_without_val_loss_is_refused_before_training(tmp_path, interval, trainer_args, match):
    steps = []

    class Count(L.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(ConfigError, match=match):
        _fit(tmp_path, interval, callbacks=[Count()], **trainer_args)
    assert not steps  # refused before the first training step


def test_a_plateau_scheduler_stepped_per_epoch_on_val_loss_still_runs(tmp_path):
    trainer = _fit(tmp_path, "epoch")
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 4)  # two validations, two halvings
