"""PEFT operations an OFTv2 model does not support are refused in one line naming OFTv2, not by an error about the
base model (PEFT forwards unknown attributes of the tuner to the wrapped transformers model)."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import tiny_model


def test_add_weighted_adapter_is_refused_in_one_line_and_leaves_the_model_as_it_was(tokens):
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8))
    model.add_adapter("b", OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8))
    randomize_q(model, std=0.05)
    model.eval()
    with torch.no_grad():
        before = model(tokens).logits
    # Before the fix: AttributeError "'LlamaForCausalLM' object has no attribute 'add_weighted_adapter'".
    for target in (model, model.base_model):
        with pytest.raises(ValueError, match=r"OFTv2 has no add_weighted_adapter.*set_adapter\(\[") as err:
            target.add_weighted_adapter(["default", "b"], [0.5, 0.5], "mix")
        assert "\n" not in str(err.value)
    assert sorted(model.peft_config) == ["b", "default"]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, before, atol=0, rtol=0)


def test_the_suggested_composition_is_what_set_adapter_with_both_computes(tokens):
    # The refusal points at set_adapter([...]): both rotations in sequence, equal to merging them both.
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8))
    model.add_adapter("b", OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=4))
    randomize_q(model, std=0.05)
    model.eval()
    model.base_model.set_adapter(["default", "b"])
    with torch.no_grad():
        composed = model(tokens).logits
        single = {}
        for name in ("default", "b"):
            model.base_model.set_adapter(name)
            single[name] = model(tokens).logits
        model.base_model.set_adapter(["default", "b"])
        merged = model.merge_and_unload()(tokens).logits
    assert all(not torch.allclose(composed, s, atol=1e-3) for s in single.values())
    torch.testing.assert_close(merged, composed, atol=1e-5, rtol=0)
