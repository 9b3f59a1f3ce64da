"""LR schedules sized from the run and checked against it (``peftplug.schedules``), through the real CLI and
``PeftModule.configure_optimizers`` on a tiny model: the quickstart recipe on 32 BBC articles is 4 steps of 8."""

from __future__ import annotations

import json
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch

from peftplug.cli import cli, main
from peftplug.errors import ConfigError
from peftplug.schedules import CosineAnnealingLR

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
TINY = ["--model.model", "tiny:llama", "--data.init_args.n_train", "32", "--data.init_args.n_val", "8",
        "--data.init_args.n_test", "8", "--data.init_args.n_words", "4", "--data.init_args.max_length", "200",
        "--evaluate_before_fit", "false", "--evaluate_after_fit", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.logger", "false"]


def _fit(tmp_path, *args: str):
    return cli(["fit", "--config", str(QUICKSTART), *TINY, "--trainer.default_root_dir", str(tmp_path), *args])


def _refused(capsys, tmp_path, *args: str) -> str:
    code = main(["fit", "--config", str(QUICKSTART), *TINY, "--trainer.default_root_dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


REFUSED = {
    "cosine_shorter": (["--model.lr_scheduler", "peftplug.schedules.CosineAnnealingLR",
                        "--model.lr_scheduler.init_args.T_max", "2"],
                       ("model.lr_scheduler.init_args.T_max: CosineAnnealingLR lasts 2 steps but this run takes 4 "
                       "(trainer.max_epochs 1 × 4 steps per epoch: 4 batches of the data); its learning rate would "
                       "climb back up after it. Set T_max to null to size it from the run, or --trainer.max_steps 2")),
    "linear_to_zero_shorter": (["--model.lr_scheduler", "torch.optim.lr_scheduler.LinearLR",
                                "--model.lr_scheduler.init_args.end_factor", "0.0",
                                "--model.lr_scheduler.init_args.total_iters", "3"],
                               "LinearLR lasts 3 steps but this run takes 4"),
    "epochs_shorter": (["--model.lr_scheduler", "torch.optim.lr_scheduler.PolynomialLR",
                        "--model.lr_scheduler.init_args.total_iters", "2", "--model.lr_scheduler_interval", "epoch",
                        "--trainer.max_epochs", "3"],
                       ("PolynomialLR lasts 2 epochs but this run takes 3 (trainer.max_epochs 3); its learning rate "
                       "stays at 0 after it. Set total_iters to null to size it from the run, or "
                       "--trainer.max_epochs 2")),
    "no_length_to_follow": (["--model.lr_scheduler", "torch.optim.lr_scheduler.LinearLR",
                             "--model.lr_scheduler.init_args.total_iters", "null", "--trainer.max_epochs", "-1"],
                            ("model.lr_scheduler.init_args.total_iters: null means the run's length, but this run "
                            "sets none")),
}


@pytest.mark.parametrize("args, expected", REFUSED.values(), ids=REFUSED.keys())
def test_a_schedule_that_would_run_out_is_refused_before_training(capsys, tmp_path, args, expected):
    assert expected in _refused(capsys, tmp_path, *args)


def test_null_lengths_follow_the_run(tmp_path):
    """Step interval: the optimizer steps (here capped by max_steps); epoch interval: the epochs. A LinearLR warm-up
    shorter than the run is a choice, not refused."""
    run = _fit(tmp_path, "--trainer.max_steps", "3")
    assert run.trainer.lr_scheduler_configs[0].scheduler.total_steps == 3
    run = _fit(tmp_path, "--model.lr_scheduler", "torch.optim.lr_scheduler.PolynomialLR", "--model.lr_scheduler_interval",
               "epoch", "--model.lr_scheduler.init_args.total_iters", "null", "--trainer.max_epochs", "2")
    assert run.trainer.lr_scheduler_configs[0].scheduler.total_iters == 2 and run.trainer.global_step == 8
    run = _fit(tmp_path, "--model.lr_scheduler", "torch.optim.lr_scheduler.LinearLR",
               "--model.lr_scheduler.init_args.start_factor", "0.1", "--model.lr_scheduler.init_args.end_factor", "1.0",
               "--model.lr_scheduler.init_args.total_iters", "2")
    assert run.trainer.global_step == 4


def test_a_python_factory_is_checked_too(tmp_path):
    """A factory that is not a recipe's (a lambda) cannot be sized, but what it builds is still checked."""
    from lightning.pytorch import Trainer

    from peftplug.data import CausalLMData
    from peftplug.lightning import PeftModule

    rows = [{"prompt": f"Q{i}?", "response": f" {i}"} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = CausalLMData(train_file=str(tmp_path / "train.jsonl"), prompt_column="prompt", response_column="response",
                        batch_size=4, val_fraction=0.25)
    module = PeftModule("tiny:llama", lr_scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=1e-4, total_steps=2))
    trainer = Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ConfigError, match="OneCycleLR lasts 2 steps but this run takes 3"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0
    with pytest.raises(ConfigError, match="T_max: null means the run's length"):
        CosineAnnealingLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_resuming_into_a_longer_run_than_the_restored_schedule_is_refused(capsys, tmp_path):
    # Lightning loads the checkpoint's scheduler state over the one sized for this run, length included: without
    # the check the resumed run ends in torch's "Tried to step 3 times" traceback at its third step.
    checkpointing = ["--trainer.enable_checkpointing", "true"]
    _fit(tmp_path, *checkpointing, "--trainer.max_steps", "2")
    (checkpoint,) = (tmp_path / "checkpoints").glob("*.ckpt")
    line = _refused(capsys, tmp_path, *checkpointing, "--trainer.max_steps", "6", "--trainer.max_epochs", "2",
                    "--ckpt_path", str(checkpoint))
    assert line == (f"peftplug: error: --ckpt_path {checkpoint}: its OneCycleLR lasts 2 steps (restored with the "
                    "checkpoint) but this run takes 6 (trainer.max_steps 6); it raises at the step after its last. "
                    "Resume with --trainer.max_steps 2, or start a new run from the checkpoint's adapter")
    # Within the restored length the resume runs.
    resumed = _fit(tmp_path, *checkpointing, "--trainer.max_steps", "2", "--trainer.max_epochs", "2",
                   "--ckpt_path", str(checkpoint))
    assert resumed.trainer.global_step == 2
