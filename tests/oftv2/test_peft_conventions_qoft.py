"""QOFT (OFTv2 on a bitsandbytes NF4 base, on CPU) with two adapters: an adapter merged into the 4-bit weight and
one still pending are exported in forward order, as ``merge_and_unload`` composes them."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q

import oftv2  # noqa: F401
from oftv2 import OFTv2Config

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture
def nf4_two_adapters(tiny_model, tmp_path):
    """A tiny Llama loaded in NF4 with OFTv2 adapters ``default`` and ``b``, both active (``default`` first)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", seed=0).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    model = peft.get_peft_model(base, OFTv2Config(target_modules=TARGETS, block_size=8))
    model.add_adapter("b", OFTv2Config(target_modules=TARGETS, block_size=8))
    randomize_q(model, std=0.05)
    model.base_model.set_adapter(["default", "b"])
    return model


def _dense(layer, name: str) -> torch.Tensor:
    return torch.block_diag(*layer.get_rotation(name).detach().unbind(0)).double()


def test_full_precision_export_folds_a_pending_adapter_in_forward_order(nf4_two_adapters):
    """With ``default`` merged into the 4-bit weight, the pending ``b`` was folded on top (``W_d R_bᵀ``: the forward
    ``x R_b R_d``) where the composed forward is ``x R_d R_b``, i.e. the weight ``W R_bᵀ R_dᵀ``."""
    from oftv2 import bnb as qoft

    model = nf4_two_adapters
    model.merge_adapter(["default"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.merged_adapters == ["default"]
    merged = layer._get_base_weight().double()  # dequantized W R_dᵀ, requantized once
    r_d, r_b = _dense(layer, "default"), _dense(layer, "b")
    expected = merged @ torch.linalg.inv(r_d.T) @ r_b.T @ r_d.T
    with torch.no_grad():
        weight = layer.full_precision_weight(["b"]).double()
    assert (weight - expected).abs().max() < 1e-5
    assert (merged @ r_b.T - expected).abs().max() > 1e-3  # the wrong order is visibly different
    exported = qoft.merge_and_export_full_precision(model)
    q_proj = exported.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, torch.nn.Linear)
    assert (q_proj.weight.double() - expected).abs().max() < 1e-5
