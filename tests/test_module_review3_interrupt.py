"""Ctrl-C does not wait for a validation pass that only the stop itself asked for.

Lightning validates before every early stop (``_should_check_val_fx`` is true once ``trainer.should_stop`` is set):
after the interrupt checkpoint was written, a user pressing Ctrl-C waited for the whole validation set. A validation
that was due after that batch anyway (``val_check_interval``) still runs: a resumed run skips the one due at its
checkpoint's batch, so it would never run otherwise.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning
from test_interrupt_accumulation import _one_thread_and_sigint  # noqa: F401  (autouse: one thread, SIGINT default)
from tiny_recipes import causal_recipe

from peftplug.cli import cli

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(24)]
VAL_CHECK = 4  # validation due after every 4th training batch
VAL_BATCHES = 6  # 12 held-out rows in batches of 2


class SignalAtBatch(lightning.Callback):
    """Sends a real SIGINT while batch ``batch`` (from 0) trains; counts the validation batches run after it."""

    def __init__(self, batch: int) -> None:
        self.batch, self.signalled, self.val_batches_after = batch, False, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGINT)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_batches_after += self.signalled




def _interrupted_fit(root: Path, batch: int) -> tuple[object, SignalAtBatch]:
    recipe = causal_recipe(root, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 10, "val_check_interval": VAL_CHECK}, data={"val_fraction": 0.5})
    stop = SignalAtBatch(batch)
    done = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [stop]})
    assert done.interrupted_by() == signal.SIGINT and done.trainer.global_step == batch + 1
    assert (root / "runs" / "checkpoints" / "last.ckpt").is_file()
    return done, stop


def test_ctrl_c_stops_without_a_validation_pass_of_its_own(tmp_path):
    _, stop = _interrupted_fit(tmp_path, batch=1)  # validation is next due after batch 3
    assert stop.val_batches_after == 0


def test_a_validation_due_at_the_interrupted_batch_still_runs(tmp_path):
    done, stop = _interrupted_fit(tmp_path, batch=VAL_CHECK - 1)
    assert stop.val_batches_after == VAL_BATCHES
    assert "val_loss" in done.trainer.callback_metrics
