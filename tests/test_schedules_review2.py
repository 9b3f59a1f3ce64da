"""LR schedules against torch stepped by hand: the learning rate of every optimizer step of a tiny run, read from the
optimizer, equals a reference scheduler's of the expected length (``null`` lengths under accumulation, train-batch
limits and the epoch interval; resumes), and a warm-up plus a decay (``SequentialLR``, ``ChainedScheduler``) is
checked part by part like a bare schedule."""

from __future__ import annotations

import functools
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import LoraConfig

from peftplug.data import CausalLMData
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.schedules import CosineAnnealingLR

S = torch.optim.lr_scheduler
LR = 1e-2


class RecordLR(L.Callback):
    """Records the learning rate each optimizer step runs with."""

    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.fixture
def data(tmp_path):
    """20 rows, 2 held out: 9 training batches of 2."""
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q{i}?", "response": f" {i}"}) for i in range(20)))
    return CausalLMData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=2,
                        val_fraction=0.1)


def fit(tmp_path, data, scheduler, interval="step", ckpt_path=None, callbacks=(), **trainer_args):
    """Fits a tiny Llama with LoRA under SGD and ``scheduler``; returns the trainer and the recorded rates."""
    module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"]),
                        optimizer=lambda p: torch.optim.SGD(p, lr=LR), lr_scheduler=scheduler,
                        lr_scheduler_interval=interval)
    record = RecordLR()
    trainer_args.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0,
                        callbacks=[record, *callbacks], **trainer_args)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, record.lrs


def reference(build, steps, steps_per_scheduler_step=1):
    """The learning rates of ``steps`` optimizer steps under torch's scheduler stepped by hand."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler, rates = build(optimizer), []
    for step in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        if (step + 1) % steps_per_scheduler_step == 0:
            scheduler.step()
    return pytest.approx(rates, rel=1e-6, abs=1e-12)


ONE_CYCLE = functools.partial(S.OneCycleLR, max_lr=LR, total_steps=None, pct_start=0.3)


@pytest.mark.parametrize("trainer_args, steps", [
    # 9 batches accumulating 4: 3 optimizer steps an epoch (the last window is 1 batch), 6 in 2 epochs.
    ({"accumulate_grad_batches": 4, "max_epochs": 2}, 6),
    ({"limit_train_batches": 5, "accumulate_grad_batches": 2, "max_epochs": 1}, 3),
], ids=["partial_accumulation_window", "limit_train_batches"])
def test_a_null_length_is_the_runs_optimizer_steps(tmp_path, data, trainer_args, steps):
    trainer, rates = fit(tmp_path, data, ONE_CYCLE, **trainer_args)
    assert trainer.global_step == steps
    assert rates == reference(lambda o: S.OneCycleLR(o, max_lr=LR, total_steps=steps, pct_start=0.3), steps)


def test_a_null_length_is_the_runs_epochs_with_the_epoch_interval(tmp_path, data):
    _, rates = fit(tmp_path, data, functools.partial(CosineAnnealingLR, T_max=None), "epoch",
                   limit_train_batches=2, max_epochs=3)
    assert rates == reference(lambda o: S.CosineAnnealingLR(o, T_max=3), 6, steps_per_scheduler_step=2)


def test_a_resumed_run_continues_the_same_schedule(tmp_path, data):
    args = {"accumulate_grad_batches": 2, "limit_train_batches": 5, "max_epochs": 2}  # 3 steps an epoch
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _, whole = fit(tmp_path, data, ONE_CYCLE, callbacks=[saves], enable_checkpointing=True, **args)
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=2.ckpt")
    _, resumed = fit(tmp_path, data, ONE_CYCLE, ckpt_path=str(checkpoint), **args)
    assert len(whole) == 6 and resumed == pytest.approx(whole[2:], rel=1e-6, abs=1e-12)


def warmup_then(decay, milestone=2):
    """A linear warm-up over ``milestone`` steps, then ``decay(optimizer)`` (what recipes elsewhere call warm-up +
    cosine)."""
    return lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=milestone), decay(o)],
                                    milestones=[milestone])


SHORT = {
    # 8 steps: the cosine after a 2-step warm-up runs 6 steps; with T_max 5 its lr climbs back up at the end.
    "sequential_cosine": (warmup_then(lambda o: S.CosineAnnealingLR(o, T_max=5)),
                          ("model.lr_scheduler: SequentialLR's schedulers[1] (CosineAnnealingLR) lasts 5 steps but "
                          "it runs for 6 of this run's 8, from step 2 (trainer.max_epochs 1 × 8 steps per epoch: 8 "
                          "batches of the data); its learning rate would climb back up after it. Give it T_max 6, "
                          "or --trainer.max_steps 7")),
    # Unchecked, torch's "Tried to step 6 times" ended the run at its last step, a traceback after training.
    "sequential_one_cycle": (warmup_then(lambda o: S.OneCycleLR(o, max_lr=LR, total_steps=5)),
                             "SequentialLR's schedulers[1] (OneCycleLR) lasts 5 steps but it runs for 6"),
    "chained_cosine": (lambda o: S.ChainedScheduler([S.LinearLR(o, start_factor=0.1, total_iters=2),
                                                     S.CosineAnnealingLR(o, T_max=7)]),
                       ("ChainedScheduler's schedulers[1] (CosineAnnealingLR) lasts 7 steps but it runs for 8 of "
                       "this run's 8, from step 0")),
}


@pytest.mark.parametrize("scheduler, message", SHORT.values(), ids=SHORT.keys())
def test_a_decay_after_a_warmup_that_runs_out_is_refused_before_training(tmp_path, data, scheduler, message):
    with pytest.raises(ConfigError) as refused:
        fit(tmp_path, data, scheduler, limit_train_batches=8, max_epochs=1)
    assert message in str(refused.value)


@pytest.mark.parametrize("decay", [lambda o: S.OneCycleLR(o, max_lr=LR, total_steps=6),
                                   lambda o: S.CosineAnnealingLR(o, T_max=6)], ids=["one_cycle", "cosine"])
def test_a_decay_after_a_warmup_that_fits_runs_as_torch_steps_it(tmp_path, data, decay):
    trainer, rates = fit(tmp_path, data, warmup_then(decay), limit_train_batches=8, max_epochs=1)
    assert trainer.global_step == 8 and rates == reference(warmup_then(decay), 8)


def test_a_restored_warmup_and_decay_that_this_run_outlasts_is_refused(tmp_path, data):
    """The checkpoint's inner lengths win over the ones built for the resumed run (Lightning loads the state over
    them): a resume with more steps would run the restored cosine past its end."""
    t_max = {"value": 2}
    schedule = warmup_then(lambda o: S.CosineAnnealingLR(o, T_max=t_max["value"]))
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path, data, schedule, callbacks=[saves], enable_checkpointing=True, max_steps=4, max_epochs=1)
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=2.ckpt")
    t_max["value"] = 6  # what this run builds fits it; what the checkpoint restores does not
    with pytest.raises(ConfigError) as refused:
        fit(tmp_path, data, schedule, ckpt_path=str(checkpoint), max_steps=8, max_epochs=1)
    assert str(refused.value) == (
        f"--ckpt_path {checkpoint}: its SequentialLR's schedulers[1] (CosineAnnealingLR) lasts 2 steps (restored with "
        "the checkpoint) but it runs for 6 of this run's 8, from step 2 (trainer.max_steps 8); its learning rate "
        "would climb back up after it. Resume with --trainer.max_steps 4, or start a new run from the checkpoint's "
        "adapter")


def test_lambda_and_schedules_longer_than_the_run_pass_through(tmp_path, data):
    """LambdaLR is not sized or checked; a cosine or a warm-up longer than the run is a choice, not refused."""
    for build in (lambda o: S.LambdaLR(o, lambda step: 1 / (step + 1)), lambda o: S.CosineAnnealingLR(o, T_max=10),
                  lambda o: S.LinearLR(o, start_factor=0.1, total_iters=10)):
        _, rates = fit(tmp_path, data, build, limit_train_batches=4, max_epochs=1)
        assert rates == reference(build, 4)
