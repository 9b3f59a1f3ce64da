"""Ctrl-C during gradient accumulation still resumes bit for bit (docs/cli.md, "Interrupted runs"): a checkpoint
holds no accumulated gradients, so the interrupt checkpoint is written only at an optimizer-step boundary — the
signal arrives during the first micro-batch of a window, the window finishes, then the run stops."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning
import pytest
import torch
from test_resume import assert_same_adapter
from tiny_recipes import causal_recipe

from peftplug.cli import cli

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(20)]
MAX_STEPS = 6
ACCUMULATE = 2


class SignalAtBatch(lightning.Callback):
    """Sends a real SIGINT while micro-batch ``batch`` (counted from 0 over the whole run) runs."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.epoch_loop.total_batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGINT)


def _recipe(root: Path, **trainer) -> Path:
    return causal_recipe(
        root, ROWS, peft={"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False},
        trainer={"max_steps": MAX_STEPS, "accumulate_grad_batches": ACCUMULATE, "limit_val_batches": 0, **trainer},
        data={"val_fraction": 0.1})


@pytest.fixture(autouse=True)
def _one_thread_and_sigint():
    """One thread (bit-for-bit sums) and SIGINT as an interactive shell leaves it (a background shell starts its
    jobs with it ignored, and an ignored SIGINT stays ignored during a fit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
    torch.set_num_threads(threads)


def test_signal_in_the_first_micro_batch_of_a_window_resumes_bit_for_bit(tmp_path):
    full = cli(["fit", "--config", str(_recipe(tmp_path / "full"))])
    assert full.trainer.global_step == MAX_STEPS

    recipe = _recipe(tmp_path / "cut")
    # Micro-batch 4 is the first of the third window (steps count windows): the window finishes, step 3 is taken.
    cut = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtBatch(2 * ACCUMULATE)]})
    assert cut.interrupted_by() == signal.SIGINT and cut.trainer.global_step == 3
    saved = torch.load(tmp_path / "cut" / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3

    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == MAX_STEPS
    assert_same_adapter(full, resumed)


def test_signal_stops_a_run_whose_recipe_sets_min_steps(tmp_path):
    """Lightning ignores ``should_stop`` until ``min_steps`` is met; the run went on to ``max_steps`` after announcing
    "stopped at step 3; checkpoint written"."""
    recipe = _recipe(tmp_path / "cut", min_steps=MAX_STEPS)
    cut = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtBatch(2 * ACCUMULATE)]})
    assert cut.interrupted_by() == signal.SIGINT
    assert cut.trainer.global_step == 3
    saved = torch.load(tmp_path / "cut" / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
