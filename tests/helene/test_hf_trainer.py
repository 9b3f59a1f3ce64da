"""helene.hf.ZeroOrderTrainer: Hugging Face's Trainer driving our zeroth-order optimizers, against peftplug's
Lightning path and a hand-run loop on the same tiny model, seed and batches; the import stays optional."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helene import FZOO, ZOSGD, Helene

lightning = pytest.importorskip("lightning")
pytest.importorskip("transformers")


def _batches(n_batches=2, size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(4, 90, (size, 10), generator=g),
             "attention_mask": torch.ones(size, 10, dtype=torch.long),
             "labels": torch.randint(0, 2, (size,), generator=g)} for _ in range(n_batches)]


def _examples(batches):
    """The batches cut into examples, in order: a sequential sampler deals them back as the same batches."""
    return [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["labels"]))]


def _model(tiny_model):
    return tiny_model("bert", "seq_cls", seed=0, num_labels=2, hidden_dropout_prob=0.3)


def _args(tmp_path, steps, **kw):
    from transformers import TrainingArguments

    base = {"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_steps": steps, "use_cpu": True,
            "report_to": "none", "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
            "train_sampling_strategy": "sequential", "lr_scheduler_type": "constant", "dataloader_num_workers": 0}
    return TrainingArguments(**{**base, **kw})


def _hf_fit(tiny_model, tmp_path, make, batches, steps, **kw):
    from helene.hf import ZeroOrderTrainer

    model = _model(tiny_model)
    model.train()  # the trainer must switch dropout off itself
    opt = make(list(model.named_parameters()))
    trainer = ZeroOrderTrainer(model=model, args=_args(tmp_path, steps, **kw), train_dataset=_examples(batches),
                               optimizers=(opt, None))
    trainer.train()
    return model, opt, trainer


MAKERS = {
    "helene": partial(Helene, lr=1e-3, eps=1e-3, hessian_interval=2, anneal_horizon="auto", seed=3),
    "zosgd": partial(ZOSGD, lr=1e-2, eps=1e-3, seed=3, perturbation="rademacher"),
    "fzoo": partial(FZOO, lr=1e-3, eps=1e-3, n_probes=3, seed=3),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_trainer_steps_equal_the_lightning_path_exactly(tiny_model, tmp_path, name):
    from torch.utils.data import DataLoader

    from peftplug.lightning import PeftModule

    make, batches, steps = MAKERS[name], _batches(), 3
    model, opt, trainer = _hf_fit(tiny_model, tmp_path / "hf", make, batches, steps)

    module = PeftModule(_model(tiny_model), task="seq_cls", optimizer=make)
    lt = lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "l"))
    lt.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))

    ref = lt.optimizers[0]
    assert opt.step_count == ref.step_count == steps and opt.forward_passes == ref.forward_passes
    if name == "helene":  # both told the run length: T = 10% of 3 steps, floored at 1
        assert opt.total_steps == ref.total_steps == steps
    assert all(p.grad is None for p in model.parameters())  # no backward anywhere
    moved = 0.0
    for (n, p), q, p0 in zip(model.named_parameters(), module.model.parameters(), _model(tiny_model).parameters()):
        assert torch.equal(p.detach(), q.detach()), n
        moved = max(moved, (p.detach() - p0).abs().max().item())
    assert moved > 1e-4  # the equality is not that of two models that did not move
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == steps and all("grad_norm" not in row for row in logged)
    assert logged[-1]["zo_forward_passes"] == opt.forward_passes


def test_lr_scheduler_is_stepped_once_per_zeroth_order_step(tiny_model, tmp_path):
    """Linear decay over 4 steps: step t uses lr0·(4 − t)/4, as a hand-run loop that sets it does."""
    lr0, steps, batches = 1e-2, 4, _batches()
    make = partial(ZOSGD, lr=lr0, eps=1e-3, seed=1)
    model, opt, _ = _hf_fit(tiny_model, tmp_path, make, batches, steps, lr_scheduler_type="linear")

    ref = _model(tiny_model)  # eval mode, as built
    ref_opt = make(list(ref.named_parameters()))
    for t in range(steps):
        ref_opt.param_groups[0]["lr"] = lr0 * (steps - t) / steps
        batch = batches[t % 2]
        ref_opt.step(lambda batch=batch: ref(**batch).loss.float())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    assert opt.param_groups[0]["lr"] == 0.0


def test_refusals_name_the_cause(tiny_model, tmp_path):
    from helene.hf import ZeroOrderTrainer

    model = _model(tiny_model)
    data = _examples(_batches())
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be 1"):
        ZeroOrderTrainer(model=model, args=_args(tmp_path, 2, gradient_accumulation_steps=2), train_dataset=data,
                         optimizers=(ZOSGD(model.parameters()), None))
    with pytest.raises(ValueError, match="zeroth-order optimizer"):
        ZeroOrderTrainer(model=model, args=_args(tmp_path, 2), train_dataset=data,
                         optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ValueError, match="zeroth-order optimizer"):
        ZeroOrderTrainer(model=model, args=_args(tmp_path, 2), train_dataset=data)


def test_import_helene_stays_torch_only(run_fresh):
    out = run_fresh("""
        import sys
        import helene
        print(sorted(m for m in ("transformers", "lightning", "peft", "helene.hf") if m in sys.modules))
    """, bare=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_checkpoint_resume_equals_the_uninterrupted_run(tiny_model, tmp_path):
    """The Trainer saves the optimizer through the stand-in (m, h, counters, generator) and loads it back."""
    from helene.hf import ZeroOrderTrainer

    make, batches = MAKERS["helene"], _batches()
    full, _, _ = _hf_fit(tiny_model, tmp_path / "full", make, batches, 4)
    _hf_fit(tiny_model, tmp_path / "half", make, batches, 4, save_strategy="steps", save_steps=2)
    model = _model(tiny_model)
    opt = make(list(model.named_parameters()))
    trainer = ZeroOrderTrainer(model=model, args=_args(tmp_path / "half", 4), train_dataset=_examples(batches),
                               optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-2"))
    assert opt.step_count == 4 and opt.forward_passes == 8
    for (n, p), q in zip(full.named_parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_fp16_loss_scaler_is_dropped_and_training_runs(tiny_model, tmp_path):
    """``fp16=True`` on a GPU gives the accelerator a GradScaler, whose step fails when no loss was ever scaled (a
    zeroth-order step runs no backward). On CPU accelerate builds none, so the test gives it the same real
    ``torch.amp.GradScaler`` a CUDA device gets, and the trainer must drop it before preparing the optimizer."""
    from helene.hf import ZeroOrderTrainer

    model = _model(tiny_model)
    before = [p.detach().clone() for p in model.parameters()]
    opt = MAKERS["zosgd"](list(model.named_parameters()))
    trainer = ZeroOrderTrainer(model=model, args=_args(tmp_path, 2, fp16=True), train_dataset=_examples(_batches()),
                               optimizers=(opt, None))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    assert trainer.accelerator.scaler is None and opt.step_count == 2
    logged = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(logged)))
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
