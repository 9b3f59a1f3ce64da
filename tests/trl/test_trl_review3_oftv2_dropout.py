"""OFTv2 block dropout (``module_dropout``) under TRL's ``disable_dropout`` (DPOTrainer's default): TRL sets ``p = 0``
on every ``nn.Dropout`` of the model, which switches LoRA's ``lora_dropout`` off; OFTv2's block dropout must follow,
or the policy and its frozen reference copy differ by random block drops before any update."""

from __future__ import annotations

import math

import peft
import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl.trainer.utils import disable_dropout_in_model
from trl_helpers import preference_rows

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model


def _pretrained(module_dropout: float):
    """A tiny Llama with an OFTv2 adapter far from the identity (block dropout then changes the outputs)."""
    model = peft.get_peft_model(
        tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8, module_dropout=module_dropout)
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "oftv2_Q" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def test_disable_dropout_makes_training_forwards_equal_the_eval_forward():
    model = _pretrained(module_dropout=0.5)
    ids = torch.tensor([[5, 9, 14, 20, 33, 41]])
    with torch.no_grad():
        reference = model.eval()(ids).logits
        model.train()
        torch.manual_seed(0)
        dropped = model(ids).logits
    # The adapter does drop blocks in training mode (otherwise the check below proves nothing).
    assert not torch.allclose(dropped, reference, atol=1e-4)
    disable_dropout_in_model(model)
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(seed)
            torch.testing.assert_close(model(ids).logits, reference, atol=1e-6, rtol=0)
    # Setting p back (any tool toggling nn.Dropout) turns block dropout on again.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    with torch.no_grad():
        torch.manual_seed(0)
        torch.testing.assert_close(model(ids).logits, dropped, atol=1e-6, rtol=0)


def test_dpo_reference_copy_equals_the_policy_before_the_first_update_with_block_dropout(trl_args):
    args = trl_args(trl.DPOConfig, max_steps=1)
    assert args.disable_dropout  # TRL's default, the setting under test
    trainer = trl.DPOTrainer(
        model=_pretrained(module_dropout=0.5), args=args, train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(),
    )
    assert sorted(trainer.model.peft_config) == ["default", "ref"]
    trainer.train()
    first = trainer.state.log_history[0]
    # Policy == its frozen copy before the first update, as with LoRA and lora_dropout: loss log 2, no margin.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-7)
