"""The count of steps skipped for a non-finite loss survives a resume.

``PeftModule.nonfinite_steps`` is logged and said at the end of the run; after ``peftplug fit ... --ckpt_path last``
it started again from 0, so a run whose loss had turned NaN before the interrupt reported only the resumed part's
skips. The count is now part of the checkpoint; checkpoints written before that still resume (counting from 0).
"""

from __future__ import annotations

import signal

import torch
from test_interrupt_accumulation import _one_thread_and_sigint  # noqa: F401  (autouse: one thread, SIGINT default)
from test_resume import SignalAtStep
from tiny_recipes import causal_recipe

from peftplug.cli import cli
from peftplug.nonfinite_steps import NONFINITE_KEY

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(24)]
LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "init_lora_weights": False}
MAX_STEPS = 6
STOP_AT = 2  # the signal arrives during step 2: steps 1 and 2 were skipped when the run stops after it


def _interrupted(tmp_path):
    # lr 1e38: the first update sends the adapter to inf, so every later loss is NaN and its step is skipped.
    recipe = causal_recipe(tmp_path, ROWS, peft=LORA, optimizer={"class_path": "torch.optim.SGD",
                                                                 "init_args": {"lr": 1e38}},
                           trainer={"max_steps": MAX_STEPS, "limit_val_batches": 0})
    cut = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtStep(STOP_AT)]})
    assert cut.interrupted_by() == signal.SIGINT and cut.trainer.global_step == STOP_AT + 1
    assert cut.model.nonfinite_steps == STOP_AT
    return recipe, tmp_path / "runs" / "checkpoints" / "last.ckpt"


def test_a_resumed_run_counts_the_steps_skipped_before_the_interrupt(tmp_path, capsys):
    recipe, _ = _interrupted(tmp_path)
    capsys.readouterr()
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == MAX_STEPS
    # As the uninterrupted run: every step after the first (tests/test_interrupt_review4_end.py).
    assert resumed.model.nonfinite_steps == MAX_STEPS - 1
    assert float(resumed.trainer.callback_metrics["nonfinite_steps"]) == MAX_STEPS - 1
    assert f"warning: {MAX_STEPS - 1} optimizer step(s) had a non-finite loss" in capsys.readouterr().err


def test_a_checkpoint_without_the_count_still_resumes(tmp_path):
    recipe, last = _interrupted(tmp_path)
    saved = torch.load(last, weights_only=True)
    saved.pop(NONFINITE_KEY, None)  # as written before the count was saved
    old = tmp_path / "old.ckpt"
    torch.save(saved, old)
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", str(old)])
    assert resumed.trainer.global_step == MAX_STEPS
    assert resumed.model.nonfinite_steps == MAX_STEPS - 1 - STOP_AT  # this run's skips only, as before
