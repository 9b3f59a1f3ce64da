"""Third review of resuming: checkpoints that cannot resume, and optimizer settings a resume replaces silently.

- ``ModelCheckpoint(save_weights_only=True)`` writes no optimizer state; ``fit --ckpt_path`` of such a file was a
  ``KeyError`` traceback from Lightning after the model had loaded. :func:`peftplug.checkpoints.check_resumable`
  refuses it in one line (``peftplug fit`` calls it on ``--ckpt_path``).
- ``Optimizer.load_state_dict`` restores the checkpoint's param groups: a resume with another ``lr`` or
  ``weight_decay`` trained with the checkpoint's values without a word. :mod:`peftplug.resume` names them
  (``optimizer_settings`` before the restore, ``replaced_optimizer_settings`` after), as ``peftplug fit`` names the
  model settings that a checkpoint replaces — and names nothing when only a scheduler moved the learning rate.
"""

from __future__ import annotations

import lightning
import pytest
from tiny_recipes import causal_recipe

from peftplug.cli import cli
from peftplug.errors import CheckpointError

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]


def _recipe(root, **kwargs):
    return causal_recipe(root, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                         trainer={"max_steps": 2, "limit_val_batches": 0}, data={"val_fraction": 0.1}, **kwargs)


def test_a_weights_only_checkpoint_cannot_resume_fit_but_a_full_one_can(tmp_path):
    from peftplug.checkpoints import check_resumable, read_checkpoint

    weights_only = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
                    '"init_args": {"save_weights_only": true}}]')
    cli(["fit", "--config", str(_recipe(tmp_path / "weights")), weights_only])
    (adapter_only,) = (tmp_path / "weights" / "runs").rglob("*.ckpt")
    with pytest.raises(CheckpointError, match="cannot resume fit: it holds the adapter but no optimizer"):
        check_resumable(read_checkpoint(adapter_only, mmap=True), adapter_only)
    # (peftplug fit --ckpt_path refuses it in one line before loading: tests/test_ckpt_review3_lightning.py; Lightning
    # alone ended in a KeyError after the model had loaded.)

    cli(["fit", "--config", str(_recipe(tmp_path / "full"))])
    (full,) = (tmp_path / "full" / "runs").rglob("*.ckpt")
    check_resumable(read_checkpoint(full, mmap=True), full)  # no error


class RecordLearningRate(lightning.Callback):
    """The learning rate the resumed run starts with (after PeftModule's on_train_start has noted the settings)."""

    def on_train_start(self, trainer, pl_module):
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def test_a_resume_names_the_optimizer_settings_the_checkpoint_keeps(tmp_path, capsys):
    step_lr = {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 1, "gamma": 0.5}}
    recipe = _recipe(tmp_path, lr_scheduler=step_lr)
    cli(["fit", "--config", str(recipe)])
    assert "optimizer state keeps" not in capsys.readouterr().err  # not a resume
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")

    same = RecordLearningRate()
    cli(["fit", "--config", str(recipe), "--ckpt_path", str(ckpt), "--trainer.max_steps", "3"],
        trainer_defaults={"callbacks": [same]})
    # StepLR halved the lr twice: the param group's lr is not the config's, and that is no replaced setting.
    assert same.lr == pytest.approx(0.0025)

    assert "optimizer state keeps" not in capsys.readouterr().err
    changed = RecordLearningRate()
    cli(["fit", "--config", str(recipe), "--ckpt_path", str(ckpt), "--trainer.max_steps", "3",
         "--model.optimizer.init_args.lr", "0.5", "--model.optimizer.init_args.weight_decay", "0.3"],
        trainer_defaults={"callbacks": [changed]})
    assert changed.lr == pytest.approx(0.0025)  # the checkpoint's schedule from the checkpoint's lr, not 0.5's
    notes = [line for line in capsys.readouterr().err.splitlines() if "optimizer state keeps" in line]
    assert notes == [("peftplug: --ckpt_path: the checkpoint's optimizer state keeps its own settings, not the "
                      "config's: model.optimizer.init_args.lr: 0.5 -> 0.01; model.optimizer.init_args.weight_decay: "
                      "0.3 -> 0.01 (to train with new settings, start a new run from the checkpoint's adapter)")]

