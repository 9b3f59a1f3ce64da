"""A signal after the last batch boundary, and a run whose every step was skipped for a non-finite loss.

Found by the fourth review of interrupted and failing runs:

- Ctrl-C during the final validation met no further batch boundary: ``peftplug fit`` exited with 130 and skipped
  ``evaluate_after_fit`` like a stopped run, but wrote no checkpoint (the message promised one), so with
  ``enable_checkpointing: false`` the finished training was lost.
- A run whose loss turned NaN skipped every later step and exited 0 without a word (the count was only logged).
"""

from __future__ import annotations

import os
import signal

import lightning
import torch
from test_interrupt_accumulation import _one_thread_and_sigint  # noqa: F401  (autouse: one thread, SIGINT default)
from test_resume import assert_same_adapter
from tiny_recipes import causal_recipe

from peftplug.cli import cli

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(24)]
LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "init_lora_weights": False}
MAX_STEPS = 4


class SignalInFinalValidation(lightning.Callback):
    """Sends a real SIGINT during the validation that runs after the run's last step."""

    def __init__(self) -> None:
        self.sent = False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.global_step == MAX_STEPS and not self.sent and not trainer.sanity_checking:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_in_the_final_validation_writes_the_announced_checkpoint(tmp_path, capsys):
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, data={"val_fraction": 0.5}, trainer={
        "max_steps": MAX_STEPS, "val_check_interval": MAX_STEPS, "enable_checkpointing": False})
    stop = SignalInFinalValidation()
    done = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [stop]})
    assert stop.sent and done.interrupted_by() == signal.SIGINT and done.trainer.global_step == MAX_STEPS
    path = tmp_path / "runs" / "checkpoints" / "last.ckpt"
    assert path.is_file(), "the run exits 130 as stopped: the checkpoint it announced must exist"
    assert "checkpoint written to" in capsys.readouterr().err
    assert torch.load(path, weights_only=True)["global_step"] == MAX_STEPS

    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    assert resumed.interrupted_by() is None and resumed.trainer.global_step == MAX_STEPS
    assert_same_adapter(done, resumed)


def test_a_run_with_skipped_nonfinite_steps_says_so_when_it_ends(tmp_path, capsys):
    # lr 1e38: the first update sends the adapter to inf, so every later loss is NaN and its step is skipped.
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, optimizer={"class_path": "torch.optim.SGD",
                                                                 "init_args": {"lr": 1e38}},
                           trainer={"max_steps": MAX_STEPS, "limit_val_batches": 0})
    done = cli(["fit", "--config", str(recipe)])
    assert done.model.nonfinite_steps == MAX_STEPS - 1
    err = capsys.readouterr().err
    assert f"warning: {MAX_STEPS - 1} optimizer step(s) had a non-finite loss" in err


def test_a_finite_run_prints_no_nonfinite_warning(tmp_path, capsys):
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, trainer={"max_steps": 2, "limit_val_batches": 0})
    done = cli(["fit", "--config", str(recipe)])
    assert done.model.nonfinite_steps == 0
    assert "non-finite" not in capsys.readouterr().err
