"""Resuming runs sized by epochs, interrupts next to ``ModelCheckpoint(save_last=True)``, and ``ckpt_path: best``.

- A run sized by ``max_epochs`` with an LR schedule loads its training loader inside ``configure_optimizers``
  (``trainer.estimated_stepping_batches``), before the checkpoint is restored: the saved position was never applied
  and the resumed run trained the epoch's first batches again (adapter different from the uninterrupted run's).
- With the documented periodic-checkpoint line (``every_n_train_steps`` + ``save_last: true``), an interrupt before
  the first periodic save let ``ModelCheckpoint.on_train_end`` write ``last-v1.ckpt`` after the stopped epoch had
  been counted as finished; ``--ckpt_path last`` took that newer file and the resumed run stopped an epoch early.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from test_interrupt_accumulation import SignalAtBatch, _one_thread_and_sigint  # noqa: F401 (autouse here too)
from test_resume import assert_same_adapter
from tiny_recipes import causal_recipe

from peftplug.checkpoints import find_best_checkpoint
from peftplug.cli import cli, main
from peftplug.errors import ConfigError

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(20)]
EPOCHS = 2
STEPS = 18  # 18 training rows in batches of 2: 9 batches per epoch
PERIODIC = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
            '"init_args": {"every_n_train_steps": 200, "save_last": true}}]')


def _recipe(root):
    return causal_recipe(
        root, ROWS,
        peft={"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1,
              "init_lora_weights": False},
        lr_scheduler={"class_path": "torch.optim.lr_scheduler.LinearLR",
                      "init_args": {"start_factor": 1.0, "end_factor": 0.2, "total_iters": 12}},
        trainer={"max_epochs": EPOCHS, "limit_val_batches": 0}, data={"val_fraction": 0.1})


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run (two epochs, a LinearLR schedule, LoRA dropout)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done = cli(["fit", "--config", str(_recipe(tmp_path_factory.mktemp("full")))])
    finally:
        torch.set_num_threads(threads)
    assert done.trainer.global_step == STEPS
    return done


def test_a_run_sized_by_epochs_with_a_schedule_resumes_at_its_data_position(tmp_path, full):
    recipe = _recipe(tmp_path)
    cut = cli(["fit", "--config", str(recipe)], trainer_defaults={"callbacks": [SignalAtBatch(4)]})
    assert cut.interrupted_by() == signal.SIGINT and cut.trainer.global_step == 5
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == STEPS
    assert_same_adapter(full, resumed)


def test_an_interrupt_beside_save_last_leaves_one_last_checkpoint_that_resumes(tmp_path, full):
    recipe = _recipe(tmp_path)
    cut = cli(["fit", "--config", str(recipe), PERIODIC], trainer_defaults={"callbacks": [SignalAtBatch(3)]})
    assert cut.interrupted_by() == signal.SIGINT and cut.trainer.global_step == 4
    folder = tmp_path / "runs" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]  # no last-v1.ckpt marking epoch 0 finished
    saved = torch.load(folder / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and saved["epoch"] == 0

    resumed = cli(["fit", "--config", str(recipe), PERIODIC, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == STEPS and resumed.trainer.current_epoch == EPOCHS
    assert_same_adapter(full, resumed)
    # The resumed run's ModelCheckpoint took the interrupt's file as its "last": it replaced it.
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_best_is_the_best_checkpoint_the_runs_newest_checkpoint_records(tmp_path, capsys):
    with_best = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
                 '"init_args": {"monitor": "val_loss", "save_top_k": 1, "save_last": true}}]')
    recipe = causal_recipe(tmp_path, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1},
                           data={"val_fraction": 0.1})
    with pytest.raises(ConfigError, match="ckpt_path: 'best' found no checkpoint"):  # (it said 'last')
        find_best_checkpoint(tmp_path / "runs")
    done = cli(["fit", "--config", str(recipe), with_best])
    (callback,) = done.trainer.checkpoint_callbacks
    assert callback.best_model_path and str(find_best_checkpoint(tmp_path / "runs")) == callback.best_model_path
    assert os.path.basename(callback.best_model_path) != "last.ckpt"
    # `--ckpt_path best` in a process of its own (Lightning's own "best" was a traceback there).
    capsys.readouterr()
    assert main(["validate", "--config", str(recipe), with_best, "--ckpt_path", "best"]) == 0
    assert f"peftplug: checkpoint {callback.best_model_path}" in capsys.readouterr().err

    other = tmp_path / "other"
    recipe = causal_recipe(other, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 2, "limit_val_batches": 0}, data={"val_fraction": 0.1})
    cli(["fit", "--config", str(recipe), PERIODIC])  # saves only last.ckpt: nothing is "best"
    with pytest.raises(ConfigError, match="records no best checkpoint"):
        find_best_checkpoint(other / "runs")
