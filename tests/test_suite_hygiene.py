"""The suite's own fixtures: what one test leaves in the process environment does not reach the next one."""

from __future__ import annotations

import os

import lightning as L
import torch


def test_an_in_process_strategy_run_sets_rank_variables():
    # What the next test relies on being undone: Lightning exports the rank of an in-process run.
    os.environ.pop("MASTER_PORT", None)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=0)
    trainer.strategy.setup_environment()
    assert os.environ.get("MASTER_PORT")
    torch.distributed.destroy_process_group()


def test_the_previous_tests_rank_variables_are_gone():
    assert "MASTER_PORT" not in os.environ
