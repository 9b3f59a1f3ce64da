"""TRL's DPOTrainer with OFTv2: the reference is the model with its adapter disabled (``peft_config=``), or a frozen
copy ``ref`` of a pretrained adapter (a ``PeftModel`` with ``ref_model=None``), which TRL makes by renaming
``.default.`` to ``.ref.`` in parameter names (``peftplug.adapter_params`` keeps OFTv2's names in that layout)."""

from __future__ import annotations

import math

import peft
import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl_helpers import preference_rows

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model


def _q(model, adapter: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f"oftv2_Q.{adapter}." in n}


def test_reference_is_the_disabled_adapter_with_peft_config(trl_args):
    trainer = trl.DPOTrainer(
        model=tiny_model("llama"), args=trl_args(trl.DPOConfig), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(), peft_config=OFTv2Config(target_modules="all-linear", block_size=8),
    )
    assert list(trainer.model.peft_config) == ["default"] and trainer.ref_model is None
    before = _q(trainer.model, "default")
    trainer.train()
    first = trainer.state.log_history[0]
    # Before the first update the policy is the fresh (identity) adapter, i.e. the reference: loss = log 2.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert all(not torch.equal(before[n], p) for n, p in _q(trainer.model, "default").items())
    ids = torch.tensor([[5, 9, 14, 20, 33]])
    with torch.no_grad(), trainer.model.disable_adapter():
        disabled = trainer.model(ids).logits
    assert torch.allclose(disabled, tiny_model("llama")(ids).logits, atol=1e-6)  # the reference: the base model


def test_a_pretrained_adapter_is_copied_into_a_frozen_ref_adapter(trl_args):
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "pretrained" adapter: far from the identity
        for name, param in model.named_parameters():
            if "oftv2_Q" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    pretrained = _q(model, "default")
    trainer = trl.DPOTrainer(
        model=model, args=trl_args(trl.DPOConfig), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(),
    )
    assert sorted(trainer.model.peft_config) == ["default", "ref"]
    ref = _q(trainer.model, "ref")
    assert len(ref) == len(pretrained)
    assert all(torch.equal(ref[n.replace(".default.", ".ref.")], v) for n, v in pretrained.items())
    trainer.train()
    # Policy == reference before the first update only if the copy happened (a fresh ref adapter is the identity).
    first = trainer.state.log_history[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    after_ref = {n: p for n, p in trainer.model.named_parameters() if n in ref}
    assert all(torch.equal(ref[n], p) and not p.requires_grad for n, p in after_ref.items())
    assert all(not torch.equal(pretrained[n], p) for n, p in _q(trainer.model, "default").items())
