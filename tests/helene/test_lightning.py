"""HELENE through peftplug's Lightning module: manual optimization, eval-mode passes, resume, DDP (gloo)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from helene import FZOO, ZOSGD, Helene

lightning = pytest.importorskip("lightning")


def _batches(n_batches=2, size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(4, 90, (size, 10), generator=g), "attention_mask": torch.ones(size, 10,
                 dtype=torch.long), "labels": torch.randint(0, 2, (size,), generator=g)} for _ in range(n_batches)]


def _trainer(tmp_path, **kw):
    args = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                "enable_model_summary": False, "num_sanity_val_steps": 0, "default_root_dir": str(tmp_path)}
    return lightning.Trainer(**{**args, **kw})


def _module(tiny_model, optimizer, lora=True):
    from peft import LoraConfig

    from peftplug.lightning import PeftModule

    torch.manual_seed(0)  # LoRA's init draws from the global RNG
    peft = LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"]) if lora else None
    return PeftModule(tiny_model("bert", "seq_cls", seed=0, num_labels=2, hidden_dropout_prob=0.3),
                      task="seq_cls", peft=peft, optimizer=optimizer)


HELENE = partial(Helene, lr=1e-3, eps=1e-3, hessian_interval=2, anneal_horizon=10.0, seed=3)
FZOO_ = partial(FZOO, lr=1e-3, eps=1e-3, n_probes=3, seed=3)


@pytest.mark.parametrize("lora,make", [(True, HELENE), (False, HELENE), (True, FZOO_)],
                         ids=["lora", "full", "fzoo-lora"])
def test_fit_steps_equal_manual_zo_steps_in_eval_mode(tiny_model, tmp_path, lora, make):
    from torch.utils.data import DataLoader

    batches = _batches()
    module = _module(tiny_model, make, lora=lora)
    reference = copy.deepcopy(module.model)
    init = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    module.train()  # Lightning puts modules in train mode; the ZO step must switch dropout off itself
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))

    opt = trainer.optimizers[0]
    assert isinstance(opt, make.func) and not module.automatic_optimization
    assert trainer.global_step == 3 and opt.step_count == 3 and opt.skipped_nonfinite == 0
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    # The optimizer's own count of closure calls is logged: 2 a step for HELENE (no curvature), N + 1 for FZOO.
    assert trainer.callback_metrics["zo_forward_passes"].item() == opt.forward_passes == 3 * (
        2 if make is HELENE else 4)
    assert all(p.grad is None for p in module.model.parameters())

    reference.eval()
    ref_opt = make([p for p in reference.parameters() if p.requires_grad])
    for i in range(3):
        batch = batches[i % 2]
        ref_opt.step(lambda batch=batch: reference(**batch).loss.float())
    for (n, p), q in zip(module.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-7, msg=n)
        assert torch.equal(p, init[n]) != p.requires_grad, n  # trainable moved, frozen did not


def test_checkpoint_resume_equals_uninterrupted_fit(tiny_model, tmp_path):
    from torch.utils.data import DataLoader

    # One batch per epoch: Lightning's own data position on resume (it may replay a batch) cannot matter, so
    # any difference would come from the optimizer state (m, h, step, generator) in the checkpoint.
    loader = lambda: DataLoader(_batches(n_batches=1), batch_size=None)
    full = _module(tiny_model, HELENE)
    _trainer(tmp_path / "a", max_steps=4).fit(full, train_dataloaders=loader())

    first = _module(tiny_model, HELENE)
    trainer = _trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, train_dataloaders=loader())
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = _module(tiny_model, HELENE)
    trainer = _trainer(tmp_path / "c", max_steps=4)
    trainer.fit(resumed, train_dataloaders=loader(), ckpt_path=str(ckpt))
    assert trainer.optimizers[0].step_count == 4
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n


class SaveRankRun(lightning.Callback):
    """Writes each rank's batches and final parameters to ``<out>.<rank>`` (read back by the test process)."""

    def __init__(self, out: str):
        self.out, self.seen = out, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})

    def on_train_end(self, trainer, module):
        torch.save({"params": [p.detach().clone() for p in module.model.parameters()], "batches": self.seen},
                   f"{self.out}.{trainer.global_rank}")


def _zosgd_module(tiny_model):
    from peftplug.lightning import PeftModule

    return PeftModule(tiny_model("bert", "seq_cls", seed=0, num_labels=2), task="seq_cls",
                      optimizer=partial(ZOSGD, lr=1e-2, eps=1e-2, seed=5))


def _ddp_rank(rank: int, out: str, port: int) -> None:
    """One of two ranks, in the environment ``torchrun`` gives it: 3 ZOSGD steps under ``strategy="ddp"``."""
    import os

    from gloo_ranks import torchrun_env
    from torch.utils.data import DataLoader

    from peftplug.tiny import tiny_model

    os.environ.update(torchrun_env(rank, port))
    batches = _batches(n_batches=6, size=4, seed=1)
    _trainer(f"{out}_root", devices=2, strategy="ddp", max_steps=3, callbacks=[SaveRankRun(out)]).fit(
        _zosgd_module(tiny_model), train_dataloaders=DataLoader(batches, batch_size=None))


def test_ddp_two_processes_equal_one_process_over_the_global_batch(tiny_model, tmp_path, zygote):
    """One process trained on the concatenation of the two ranks' batches (as Lightning's distributed sampler
    dealt them) takes the same steps: the closure's all-reduced loss is the global-batch mean.

    The two ranks are forked from a fresh process (tests/gloo_ranks.py), each in a ``torchrun`` environment."""
    from gloo_ranks import free_port, run_ranks
    from torch.utils.data import DataLoader

    out = str(tmp_path / "ddp")
    run_ranks(zygote, _ddp_rank, (out, free_port()))
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert len(r0["batches"]) == len(r1["batches"]) == 3
    assert not torch.equal(r0["batches"][0]["input_ids"], r1["batches"][0]["input_ids"])
    merged = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(r0["batches"], r1["batches"])]
    single = _zosgd_module(tiny_model)
    init = [p.detach().clone() for p in single.model.parameters()]
    _trainer(tmp_path, max_steps=3).fit(single, train_dataloaders=DataLoader(merged, batch_size=None))
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    for a, p in zip(r0["params"], single.model.parameters()):
        torch.testing.assert_close(a, p.detach(), rtol=0, atol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(r0["params"], init)) > 1e-3


def test_offline_recipe_fits_with_helene_on_a_tiny_model(tmp_path, capsys, tiny_recipe_args):
    """recipes/helene/minilm_bbcnews_lora.yaml end to end (tiny BERT, few articles): Helene from class_path."""
    from peftplug.cli import cli

    run = cli(tiny_recipe_args("helene/minilm_bbcnews_lora.yaml", tmp_path, 3, "--trainer.val_check_interval", "3",
                               "--data.init_args.max_length", "32", bbc_subset=True))
    opt = run.trainer.optimizers[0]
    assert isinstance(opt, Helene) and opt.step_count == 3 and run.trainer.global_step == 3
    assert all(g["lam"] == 1.0 for g in opt.param_groups) and len(opt.param_groups) > 1  # layerwise: tensor
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("held-out accuracy: ")


def test_peft_module_gives_helene_the_parameter_names_and_the_run_length(tiny_model, tmp_path):
    from torch.utils.data import DataLoader

    auto = partial(Helene, lr=1e-3, eps=1e-3, layerwise="block", anneal_horizon="auto", seed=3)
    module = _module(tiny_model, auto, lora=False)
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.fit(module, train_dataloaders=DataLoader(_batches(), batch_size=None))
    opt = trainer.optimizers[0]
    # The run length reached the optimizer: T = 10% of the 4 steps (floored at 1), not the 1000-step fallback.
    assert opt.total_steps == 4 and opt.horizon() == 1.0
    # Block-wise groups need names: one layer per encoder block (split into decayed / no-decay parameters), plus
    # embeddings, pooler and classifier.
    layers = {g["layer"] for g in opt.param_groups}
    assert {k for k in layers if ".layer." in k} == {f"bert.encoder.layer.{i}" for i in range(2)}, layers
    assert len(layers) > 2
