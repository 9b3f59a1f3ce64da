"""QOFT: OFTv2 on bitsandbytes 4-bit and 8-bit bases (CPU; CUDA with PEFTPLUG_KERNELS_ON_GPU=1), compared with
dequantized references."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
import torch.nn.functional as F

import oftv2
from oftv2 import bnb as qoft
from peftplug.quantized_layout import keep_exact_4bit_layout
from peftplug_kernels.block_rotate.reference import block_rotate

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _adapt(model, **overrides):
    config = {"block_size": 16, "target_modules": "all-linear", "kernel_impl": "torch"}
    config.update(overrides)
    return peft.get_peft_model(model, oftv2.OFTv2Config(**config))


def _first_qoft(model):
    return next(m for m in model.modules() if isinstance(m, qoft._QuantizedOFTv2))


@pytest.mark.parametrize(
    ("quant_type", "double_quant", "compute_dtype"),
    [("nf4", False, torch.float32), ("nf4", True, torch.bfloat16), ("fp4", True, torch.float32),
     ("fp4", False, torch.float16)],
)
def test_4bit_forward_rotates_then_calls_the_quantized_layer(load_quantized, randomize, quant_type, double_quant,
                                                              compute_dtype):
    model = _adapt(load_quantized(4, quant_type, double_quant, compute_dtype))
    layers = [m for m in model.modules() if isinstance(m, qoft.Linear4bit)]
    assert len(layers) == 14  # 7 linear layers × 2 decoder layers, all 4-bit
    randomize(model, std=0.05)
    layer = layers[0]
    base = layer.get_base_layer()
    x = torch.randn(3, 5, layer.in_features, device=base.weight.device)
    with torch.no_grad():
        # Dequantize first: an eval forward on CPU may repack the weight for bitsandbytes' CPU kernels.
        weight = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
        got = layer(x)
        rotation = layer.get_rotation("default")
        expected = F.linear(block_rotate(x, rotation).to(compute_dtype), weight.to(compute_dtype)).to(x.dtype)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, expected, rtol=2e-2 if compute_dtype != torch.float32 else 1e-5, atol=1e-2)


def test_zero_init_equals_base_model(load_quantized, batch):
    base_model = load_quantized(4, "nf4", True)
    # Without this, the base forward repacks the weights on AVX512-BF16 CPUs and _adapt refuses them
    # (tests/oftv2_bnb/test_repack_table.py); peftplug's loader does it for every 4-bit model it loads.
    keep_exact_4bit_layout(base_model)
    with torch.no_grad():
        expected = base_model(**batch).logits
    model = _adapt(base_model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, rtol=0, atol=1e-5)


def test_8bit_layers_wrapped_and_trainable(load_quantized, batch):
    model = _adapt(load_quantized(8))
    assert isinstance(_first_qoft(model), qoft.Linear8bitLt)
    model.train()
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "oftv2_Q" in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_training_steps_reduce_loss_on_4bit_base(load_quantized, batch):
    model = _adapt(load_quantized(4, "nf4", True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    optim = torch.optim.Adam(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(6):
        loss = model(**batch, labels=batch["input_ids"]).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_gradients_survive_an_eval_forward(load_quantized, batch):
    # bitsandbytes repacks 4-bit weights for CPU inference during an eval forward; its matmul on the repacked
    # weight has no autograd. The QOFT layer restores the layout before a forward that needs gradients.
    model = _adapt(load_quantized(4, "nf4", False))
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "oftv2_Q" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", False), ("nf4", True), ("fp4", True)])
def test_merged_4bit_model_keeps_the_rotation(load_quantized, randomize, batch, quant_type, double_quant):
    model = _adapt(load_quantized(4, quant_type, double_quant))
    randomize(model, std=0.05)
    layer = _first_qoft(model)
    before = layer.get_base_layer().weight
    settings = (before.quant_type, before.blocksize, before.compress_statistics, before.quant_storage,
                before.quant_state.dtype)
    drift = qoft.merge_drift(model, batch)
    # Requantization moves the merged weights to a new 4-bit grid, but the merged model stays far nearer the
    # adapter than the base is.
    assert drift["merged_vs_adapter"] < 0.4 * drift["base_vs_adapter"], drift
    assert drift["unmerged_vs_adapter"] < 0.4 * drift["base_vs_adapter"], drift
    model.base_model.merge_adapter()
    after = layer.get_base_layer().weight
    assert isinstance(after, bnb.nn.Params4bit) and after.bnb_quantized
    assert (after.quant_type, after.blocksize, after.compress_statistics, after.quant_storage,
            after.quant_state.dtype) == settings
    assert after.quant_state.nested == double_quant


def test_merge_weight_matches_rotated_dequantized_weight(load_quantized, randomize):
    model = _adapt(load_quantized(4, "nf4", True))
    randomize(model, std=0.05)
    layer = _first_qoft(model)
    with torch.no_grad():
        target = qoft.dequantize_4bit_weight(layer.get_base_layer()) @ layer.get_delta_weight("default").T
        bnb_packed, bnb_state = bnb.functional.quantize_4bit(target, blocksize=64, compress_statistics=True,
                                                            quant_type="nf4")
        bnb_error = (bnb.functional.dequantize_4bit(bnb_packed, bnb_state) - target).norm()
        layer.merge()
        merged = qoft.dequantize_4bit_weight(layer.get_base_layer())
    # MSE-optimal block scales requantize W Rᵀ more accurately than bitsandbytes' absmax quantizer.
    assert (merged - target).norm() < bnb_error
    assert (merged - target).norm() / target.norm() < 0.12


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_absmax_mode_reproduces_bitsandbytes_quantizer(quant_type, nested):
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested,
                                                quant_type=quant_type)
    ours, our_state = qoft.quantize_4bit(weight, quant_type, 64, nested, torch.float32, mode="absmax")
    assert torch.equal(ours, packed)
    torch.testing.assert_close(bnb.functional.dequantize_4bit(ours, our_state),
                               bnb.functional.dequantize_4bit(packed, state), rtol=0, atol=0)
    assert qoft.resolve_requantization("auto", "nf4") == "mse"
    assert qoft.resolve_requantization("auto", "fp4") == "absmax"
    with pytest.raises(ValueError, match="requantization mode"):
        qoft.quantize_4bit(weight, quant_type, 64, nested, torch.float32, mode="round")


def test_merged_8bit_model_keeps_the_rotation(load_quantized, randomize, batch):
    model = _adapt(load_quantized(8))
    randomize(model, std=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drift = qoft.merge_drift(model, batch)
    assert drift["merged_vs_adapter"] < 0.1 * drift["base_vs_adapter"], drift
    assert _first_qoft(model).get_base_layer().weight.dtype == torch.int8


def test_merge_and_export_full_precision(load_quantized, randomize, batch):
    model = _adapt(load_quantized(4, "nf4", True))
    randomize(model, std=0.05)
    # Train mode (no dropout in the tiny model): in eval mode bitsandbytes' CPU path computes in bf16.
    model.train()
    with torch.no_grad():
        adapter = model(**batch).logits
    exported = qoft.merge_and_export_full_precision(model)
    linears = [m for m in exported.modules() if isinstance(m, torch.nn.Linear)]
    assert not any(isinstance(m, (bnb.nn.Linear4bit, oftv2.OFTv2Layer)) for m in exported.modules())
    assert len(linears) == 15 and not getattr(exported, "is_loaded_in_4bit", False)
    assert not hasattr(exported.config, "quantization_config")
    with torch.no_grad():
        full = exported(**batch).logits
    # No requantization: only fp32 rounding separates the export from the adapter.
    torch.testing.assert_close(full, adapter, rtol=1e-4, atol=1e-4)


def test_ordinary_models_do_not_use_the_bnb_dispatchers(tiny_model):
    model = _adapt(tiny_model("llama"))
    assert not any(isinstance(m, qoft._QuantizedOFTv2) for m in model.modules())
    assert any(isinstance(m, oftv2.Linear) for m in model.modules())


def test_kbit_training_preparation_then_training(load_quantized, batch):
    base = peft.prepare_model_for_kbit_training(load_quantized(4, "nf4", True), use_gradient_checkpointing=True)
    model = _adapt(base)
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if "oftv2_Q" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_unmerge_restores_the_base_within_requantization_error(load_quantized, randomize):
    model = _adapt(load_quantized(4, "fp4", False))
    randomize(model, std=0.05)
    layer = _first_qoft(model)
    original = qoft.dequantize_4bit_weight(layer.get_base_layer())
    layer.merge()
    assert layer.merged
    layer.unmerge()
    assert not layer.merged
    restored = qoft.dequantize_4bit_weight(layer.get_base_layer())
    # Two requantizations (merge, unmerge), each ~10% relative error for FP4; the rotation moved W further.
    rotated = original @ layer.get_delta_weight("default").T
    assert (restored - original).norm() < (rotated - original).norm()
    assert (restored - original).norm() / original.norm() < 0.25


def test_saved_adapter_reloads_on_a_fresh_4bit_base(load_quantized, randomize, batch, tmp_path):
    model = _adapt(load_quantized(4, "nf4", True))
    randomize(model, std=0.05)
    model.train()  # train mode: same bitsandbytes CPU code path for both models
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(load_quantized(4, "nf4", True), tmp_path)
    assert isinstance(_first_qoft(reloaded), qoft.Linear4bit)
    reloaded.train()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected, rtol=1e-5, atol=1e-5)


def test_export_unwraps_modules_to_save_and_does_not_fold_a_merged_adapter_twice(load_quantized, randomize, batch):
    model = _adapt(load_quantized(4, "nf4", False), target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    randomize(model, std=0.05)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    _first_qoft(model).merge()  # this layer's rotation now lives in its (requantized) 4-bit weight
    model.train()  # same bitsandbytes CPU code path as the export (see test_merge_and_export_full_precision)
    with torch.no_grad():
        current = model(**batch).logits
    exported = qoft.merge_and_export_full_precision(model)
    assert not any(isinstance(m, (peft.utils.ModulesToSaveWrapper, oftv2.OFTv2Layer, bnb.nn.Linear4bit))
                   for m in exported.modules())
    assert not any("modules_to_save" in k or "original_module" in k for k in exported.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, current, rtol=1e-4, atol=1e-4)


def test_stacked_rotations_on_a_4bit_base_equal_the_per_layer_path(load_quantized, randomize, batch):
    # QOFT with OFTv2Config(stack_rotations=True): the 4-bit layers (not fused with the matmul on this device) take
    # their blocks from the model's one batched series; loss and gradients are the per-layer path's.
    base = load_quantized(4, "nf4", True)
    keep_exact_4bit_layout(base)
    model = _adapt(base, kernel_impl="auto", stack_rotations=True).train()
    randomize(model, std=0.05)
    layers = [m for m in model.modules() if isinstance(m, qoft.Linear4bit)]
    assert all(oftv2.stacking.eligible(layer, "default") for layer in layers)

    def step():
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if "oftv2_Q" in n]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    stacked_loss, stacked_grads = step()
    model.base_model._oftv2_stacking.remove()
    loss, grads = step()
    torch.testing.assert_close(stacked_loss, loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(stacked_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
