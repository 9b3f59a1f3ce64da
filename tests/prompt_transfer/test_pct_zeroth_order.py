"""PCT trained by a zeroth-order optimizer minimises the first-order objective: task loss + ``auxiliary_loss()``.

The references are computed here: the same optimizer, seed and batches run by hand on a copy of the model with the
closure ``model(**batch).loss + pt.auxiliary_loss(model)`` (eval mode, no gradients).
"""

from __future__ import annotations

import copy
from functools import partial

import peft
import pytest
import torch

import prompt_transfer as pt
from helene import FZOO, ZOSGD, Helene

lightning = pytest.importorskip("lightning")

L_TOKENS, D, K = 4, 64, 3
MAKERS = {
    "helene": partial(Helene, lr=1e-2, eps=1e-3, hessian_interval=2, anneal_horizon=10.0, seed=3),
    "zosgd": partial(ZOSGD, lr=1e-2, eps=1e-3, seed=3),
    "fzoo": partial(FZOO, lr=1e-2, eps=1e-3, n_probes=3, seed=3),
}


@pytest.fixture
def dec_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = {f"src{i}": torch.randn(L_TOKENS, D, generator=g) * 0.5 for i in range(K)}
    path = tmp_path / "dec"
    pt.save_decomposition(pt.decompose(prompts, contrastive_steps=10), str(path))
    return str(path)


def _config(dec_dir):
    # A large weight so that the contrastive term moves the zeroth-order estimate well above fp32 rounding.
    return pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=dec_dir, contrastive_weight=1.0)


def _batches(n=2, size=2, length=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 90, (size, length), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def _objective(model, batch) -> torch.Tensor:
    """The first-order objective of a PCT step (as ``pt.train_prompt`` and the first-order trainer form it)."""
    return (model(**batch).loss + pt.auxiliary_loss(model)).float()


def _trainer(tmp_path, steps):
    return lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             default_root_dir=str(tmp_path))


class _RecordingZOSGD(ZOSGD):
    """ZO-SGD that also records the closure's value at the unperturbed parameters of each step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_theta: list[float] = []

    def step(self, closure):
        self.at_theta.append(float(closure()))
        return super().step(closure)


def test_lightning_zeroth_order_closure_is_the_first_order_objective(tiny_model, dec_dir, tmp_path):
    from torch.utils.data import DataLoader

    from peftplug.lightning import PeftModule

    batch = _batches(n=1)[0]
    module = PeftModule(tiny_model("llama"), task="causal_lm", peft=_config(dec_dir),
                        optimizer=partial(_RecordingZOSGD, lr=1e-2, eps=1e-3, seed=3))
    module.model.eval()
    with torch.no_grad():
        task = module.model(**batch).loss.item()
        aux = pt.auxiliary_loss(module.model).item()
        expected = _objective(module.model, batch).item()
    module.model.train()  # as built; the zeroth-order step switches dropout off itself
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None))
    seen = trainer.optimizers[0].at_theta
    assert aux > 1e-3 and expected == pytest.approx(task + aux, abs=1e-6)
    assert seen == [pytest.approx(expected, abs=1e-5)], f"closure {seen}, task loss {task}, task + aux {expected}"
    # Logged once a step at the unperturbed parameters, as a first-order step logs them.
    metrics = trainer.callback_metrics
    assert metrics["aux_loss"].item() == pytest.approx(aux, rel=1e-5)
    assert sum(v.item() for k, v in metrics.items() if k.startswith("pct/attn/")) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("name", list(MAKERS))
def test_lightning_zeroth_order_steps_equal_hand_run_steps_on_the_objective(tiny_model, dec_dir, tmp_path, name):
    from torch.utils.data import DataLoader

    from peftplug.lightning import PeftModule

    make, batches, steps = MAKERS[name], _batches(), 3
    module = PeftModule(tiny_model("llama"), task="causal_lm", peft=_config(dec_dir), optimizer=make)
    ref = copy.deepcopy(module.model).eval()
    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    _trainer(tmp_path, steps).fit(module, train_dataloaders=DataLoader(batches, batch_size=None))

    opt = make([(n, p) for n, p in ref.named_parameters() if p.requires_grad])
    with torch.no_grad():
        for t in range(steps):
            batch = batches[t % len(batches)]
            opt.step(lambda batch=batch: _objective(ref, batch))
    got = {n: p.detach() for n, p in module.model.named_parameters() if p.requires_grad}
    assert set(got) == set(start) and all("prompt_encoder" in n for n in got)
    for n, p in ref.named_parameters():
        if n in got:
            torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=0, msg=n)
    assert max((got[n] - start[n]).abs().max().item() for n in got) > 1e-4  # the runs did move


def test_hf_zero_order_trainer_uses_the_compute_loss_that_first_order_training_uses(tiny_model, dec_dir, tmp_path):
    """helene.hf: the closure is ``compute_loss``, so the override docs/trl.md gives reaches zeroth-order steps."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from helene.hf import ZeroOrderTrainer

    class PCTZeroOrderTrainer(ZeroOrderTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            aux = pt.auxiliary_loss(model)
            loss = loss if aux is None else loss + aux
            return (loss, outputs) if return_outputs else loss

    batch = _batches(n=1)[0]
    model = peft.get_peft_model(tiny_model("llama"), _config(dec_dir)).eval()
    with torch.no_grad():
        expected = _objective(model, batch).item()
    opt = _RecordingZOSGD([(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             train_sampling_strategy="sequential", lr_scheduler_type="constant")
    examples = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    PCTZeroOrderTrainer(model=model, args=args, train_dataset=examples, optimizers=(opt, None)).train()
    assert opt.at_theta == [pytest.approx(expected, abs=1e-5)]
