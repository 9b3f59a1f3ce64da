"""QOFT on bitsandbytes 8-bit bases (``Linear8bitLt``: threshold and ``has_fp16_weights`` settings) and
:func:`oftv2.bnb.merge_drift`, each against a reference computed here from the exactly dequantized weights."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

import oftv2
from oftv2 import bnb as qoft
from peftplug_kernels.block_rotate.reference import block_rotate

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def load_8bit(tiny_checkpoint, device):
    """Factory: the tiny Llama in 8-bit, with ``BitsAndBytesConfig`` overrides (threshold, fp16 weights)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    def load(**overrides):
        logging.disable_progress_bar()
        config = BitsAndBytesConfig(load_in_8bit=True, **overrides)
        return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, quantization_config=config, device_map=device)

    return load


def _adapt(model, **overrides):
    config = {"block_size": 16, "target_modules": "all-linear", "kernel_impl": "torch"}
    config.update(overrides)
    return peft.get_peft_model(model, oftv2.OFTv2Config(**config))


def _layers(model):
    return [m for m in model.modules() if isinstance(m, qoft._QuantizedOFTv2)]


def _within_int8_rounding(got, expected):
    """Whether ``got`` is ``expected`` quantized row-wise to int8: half a step, after bitsandbytes' fp16 cast."""
    step = got.abs().amax(dim=1, keepdim=True) / 127
    return bool(((got - expected).abs() <= 0.5 * step + expected.abs() * 2.0**-11 + 1e-7).all())


def _rotated_weight(weight, rotation):
    """``W Rᵀ`` block by block, plain torch."""
    n, b = rotation.shape[0], rotation.shape[-1]
    return torch.einsum("oik,ijk->oij", weight.view(weight.shape[0], n, b), rotation.expand(n, b, b)).reshape(
        weight.shape)


@pytest.mark.parametrize("overrides", [{}, {"llm_int8_threshold": 0.0}], ids=["threshold6", "threshold0"])
def test_int8_forward_and_gradients_match_the_dequantized_fp32_model(load_8bit, tiny_checkpoint, randomize, batch,
                                                                      overrides):
    from transformers import AutoModelForCausalLM

    quantized = load_8bit(**overrides)
    # The fp32 reference: the same model with every 8-bit weight replaced by its exact dequantization.
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).to(batch["input_ids"].device)
    state = reference.state_dict()
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            state[name + ".weight"] = qoft.dequantize_8bit_weight(module)
    reference.load_state_dict(state)
    model, ref = _adapt(quantized), _adapt(reference)
    assert len(_layers(model)) == 14 and all(isinstance(m, qoft.Linear8bitLt) for m in _layers(model))
    for m in (model, ref):
        randomize(m, std=0.05)
        m.train()  # bitsandbytes' CPU training path multiplies by the dequantized weight (eval quantizes x too)
    layer = _layers(model)[0]
    x = torch.randn(3, layer.in_features, device=batch["input_ids"].device)
    with torch.no_grad():
        expected = block_rotate(x, layer.get_rotation("default")) @ qoft.dequantize_8bit_weight(
            layer.get_base_layer()).T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    out, ref_out = model(**batch, labels=batch["input_ids"]), ref(**batch, labels=batch["input_ids"])
    out.loss.backward()
    ref_out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if "oftv2_Q" in n}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if "oftv2_Q" in n}
    assert len(grads) == len(ref_grads) == 14
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6)


def test_int8_merge_unmerge_export_and_reload(load_8bit, randomize, batch, tmp_path):
    model = _adapt(load_8bit())
    randomize(model, std=0.05)
    model.train()
    layer = _layers(model)[0]
    base = layer.get_base_layer()
    original = qoft.dequantize_8bit_weight(base).clone()
    with torch.no_grad():
        adapter = model(**batch).logits
        with model.disable_adapter():
            plain = model(**batch).logits
        rotation = layer.get_rotation("default")
    # Merge: W Rᵀ requantized row-wise to int8 (PEFT's LoRA convention on Linear8bitLt), so within half a step.
    layer.merge()
    assert base.weight.dtype == torch.int8
    assert _within_int8_rounding(qoft.dequantize_8bit_weight(base), _rotated_weight(original, rotation))
    # Unmerge: the exact inverse of the requantized weight, requantized again.
    with torch.no_grad():
        inverse = layer._apply_rotation_to_weight(qoft.dequantize_8bit_weight(base), "default", inverse=True)
    layer.unmerge()
    assert _within_int8_rounding(qoft.dequantize_8bit_weight(base), inverse) and not layer.merged
    # A saved adapter on a freshly quantized base: identical logits.
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(load_8bit(), tmp_path / "adapter").train()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, adapter, rtol=0, atol=0)
        with reloaded.disable_adapter():
            torch.testing.assert_close(reloaded(**batch).logits, plain, rtol=0, atol=0)
    # Full-precision export of the reloaded adapter: deq(W) Rᵀ in fp32, no requantization.
    exported = qoft.merge_and_export_full_precision(reloaded)
    assert not any(isinstance(m, (bnb.nn.Linear8bitLt, oftv2.OFTv2Layer)) for m in exported.modules())
    assert not getattr(exported, "is_loaded_in_8bit", False)
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, adapter, rtol=1e-4, atol=1e-4)


def test_two_adapters_on_int8_compose_and_merge_in_forward_order(load_8bit, randomize):
    model = _adapt(load_8bit())
    model.add_adapter("second", oftv2.OFTv2Config(block_size=8, target_modules="all-linear", kernel_impl="torch"))
    randomize(model, std=0.05)
    model.base_model.set_adapter(["default", "second"])
    model.train()
    layer = _layers(model)[0]
    weight = qoft.dequantize_8bit_weight(layer.get_base_layer())
    x = torch.randn(4, layer.in_features, device=weight.device)
    with torch.no_grad():
        first, second = layer.get_rotation("default"), layer.get_rotation("second")
        expected = block_rotate(block_rotate(x, first), second) @ weight.T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        layer.merge()
        # y = base(x R₁ R₂): the merged weight is W R₂ᵀ R₁ᵀ.
        assert _within_int8_rounding(qoft.dequantize_8bit_weight(layer.get_base_layer()),
                                     _rotated_weight(_rotated_weight(weight, second), first))


def test_int8_layers_never_plan_the_fused_4bit_kernel(load_8bit):
    for impl in ("auto", "triton"):
        model = _adapt(load_8bit(), kernel_impl=impl)
        assert all(m.kernel_plan("default").fused_max_tokens == 0 for m in _layers(model))


def test_merge_into_fp16_weight_int8_layers_reaches_the_eval_forward(load_8bit, randomize, batch):
    # has_fp16_weights=True keeps a float weight that each forward quantizes; an eval forward reuses the int8 copy
    # the previous one cached. Before the fix the merge left that cache alone: the merged model ran the base weights.
    model = _adapt(load_8bit(llm_int8_has_fp16_weight=True))
    randomize(model, std=0.05)
    model.eval()
    assert _layers(model)[0].get_base_layer().weight.dtype == torch.float32
    with torch.no_grad():
        adapter = model(**batch).logits
        with model.disable_adapter():
            plain = model(**batch).logits
        model.base_model.merge_adapter()
        merged = model(**batch).logits
        model.base_model.unmerge_adapter()
        unmerged = model(**batch).logits
    scale = (plain - adapter).norm()
    assert (merged - adapter).norm() < 0.1 * scale, "the merged model must run the merged weights"
    assert (unmerged - adapter).norm() < 0.01 * scale


@pytest.mark.parametrize("bits", [8, 4])
def test_merge_drift_leaves_the_model_as_it_was(load_quantized, randomize, batch, bits):
    # A merge/unmerge round trip requantizes twice; before the fix merge_drift left the model that far off (NF4:
    # ~9 % of the logits) while only reporting it.
    model = _adapt(load_quantized(bits, "nf4", True))
    randomize(model, std=0.05)
    model.train()
    # The whole state (int8 row scales, 4-bit block scales and double quantization included), as saved.
    saved = {k: v.clone() for k, v in model.base_model.model.state_dict().items()}
    with torch.no_grad():
        before = model(**batch).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drift = qoft.merge_drift(model, batch)
    assert 0 < drift["unmerged_vs_adapter"] and drift["merged_vs_adapter"] < 0.5 * drift["base_vs_adapter"], drift
    assert model.training and not any(m.merged for m in _layers(model))
    after = model.base_model.model.state_dict()
    assert after.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(after[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)
    # Again: the second measurement sees the same model, so reports the same drift.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert qoft.merge_drift(model, batch) == drift


def test_merge_drift_refuses_a_merged_model(load_quantized, randomize, batch):
    model = _adapt(load_quantized(8))
    randomize(model, std=0.05)
    _layers(model)[0].merge()
    with pytest.raises(ValueError, match="unmerge_adapter"):
        qoft.merge_drift(model, batch)
