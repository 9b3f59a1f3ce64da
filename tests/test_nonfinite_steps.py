"""A step whose loss is not finite moves neither the parameters nor the LR schedule (first- and zeroth-order)."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from peft import LoraConfig

from helene import ZOSGD
from peftplug.data import CausalLMData
from peftplug.lightning import PeftModule

BASE_LR = 1e-2


def warmup(optimizer):
    """A linear warmup whose learning rate says how many times it was stepped."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 10)


class PoisonedCalls(PeftModule):
    """Makes the loss of the forwards numbered in ``poisoned`` (counted from 0, training forwards only) NaN."""

    def __init__(self, *args, poisoned=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned, self.calls = set(poisoned), 0

    def forward(self, **batch):
        out = super().forward(**batch)
        if self.trainer.training:
            if self.calls in self.poisoned:
                out.loss = out.loss * float("nan")
            self.calls += 1
        return out


class RecordLR(L.Callback):
    """Records the learning rate each optimizer step runs with."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "instr.jsonl"
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return CausalLMData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=4)


def fit(tmp_path, data, poisoned, optimizer=None, interval="step", **trainer_args):
    """Fits a tiny Llama with LoRA and the warmup; returns the module, its scheduler and the recorded rates."""
    module = PoisonedCalls("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj"]), poisoned=poisoned,
                           optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=BASE_LR)),
                           lr_scheduler=warmup, lr_scheduler_interval=interval)
    record = RecordLR()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        limit_val_batches=0, callbacks=[record], **trainer_args)
    trainer.fit(module, datamodule=data)
    return module, trainer.lr_scheduler_configs[0].scheduler, record.lrs


def rates(*steps):
    return pytest.approx([BASE_LR * (s + 1) / 10 for s in steps])


def test_a_skipped_step_does_not_advance_the_warmup(tmp_path, data):
    module, scheduler, lrs = fit(tmp_path, data, poisoned={0}, max_steps=3)
    assert module.nonfinite_steps == 1
    # The step after the skipped one trains at the rate the skipped one would have used.
    assert lrs == rates(0, 0, 1) and scheduler.last_epoch == 2
    clean, clean_scheduler, clean_lrs = fit(tmp_path, data, poisoned=(), max_steps=3)
    assert clean.nonfinite_steps == 0 and clean_lrs == rates(0, 1, 2) and clean_scheduler.last_epoch == 3


def test_a_poisoned_micro_batch_holds_the_schedule_once_per_optimizer_step(tmp_path, data):
    # Two micro-batches a step (3 batches an epoch: Lightning steps on the epoch's lone third one): the poisoned
    # second micro-batch skips the first optimizer step, and the schedule is held for that step only.
    module, scheduler, lrs = fit(tmp_path, data, poisoned={1}, max_steps=3, accumulate_grad_batches=2)
    assert module.nonfinite_steps == 1 and scheduler.last_epoch == 2
    assert lrs == rates(0, 0, 0, 1, 1)


def test_epoch_schedulers_step_at_the_epoch_end_as_usual(tmp_path, data):
    module, scheduler, lrs = fit(tmp_path, data, poisoned={0}, interval="epoch", max_epochs=2)
    assert module.nonfinite_steps == 1 and scheduler.last_epoch == 2
    assert lrs == rates(0, 0, 0, 1, 1, 1)


def test_a_nonfinite_zeroth_order_step_does_not_advance_the_schedule(tmp_path, data):
    # ZO-SGD calls the closure twice a step: poisoning the first call makes step 0 non-finite.
    module, scheduler, lrs = fit(tmp_path, data, poisoned={0}, max_steps=3,
                                 optimizer=lambda p: ZOSGD(p, lr=BASE_LR, eps=1e-3, seed=0))
    assert module.nonfinite_steps == 1 and module.optimizers().optimizer.skipped_nonfinite == 1
    assert lrs == rates(0, 0, 1) and scheduler.last_epoch == 2


def test_a_zeroth_order_run_steps_reduce_on_plateau_once_per_validation(tmp_path, data):
    # Lightning steps no scheduler under manual optimization; the module steps a plateau scheduler on val_loss.
    # threshold=inf in "max" mode: no validation counts as an improvement, whatever the loss (-inf + inf is nan).
    def plateau(optimizer):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0,
                                                          threshold=float("inf"), threshold_mode="abs")

    data.val_fraction = 0.25
    module = PoisonedCalls("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj"]),
                           optimizer=lambda p: ZOSGD(p, lr=BASE_LR, eps=1e-3, seed=0), lr_scheduler=plateau)
    record = RecordLR()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        max_epochs=4, num_sanity_val_steps=1, callbacks=[record])
    trainer.fit(module, datamodule=data)
    # 3 batches an epoch; the validation after each epoch halves the rate; the sanity check does not count.
    assert record.lrs == pytest.approx([BASE_LR / 2 ** (i // 3) for i in range(12)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(BASE_LR / 16)
    trainer.validate(module, datamodule=data)  # outside fit: leaves the schedule alone
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(BASE_LR / 16)
