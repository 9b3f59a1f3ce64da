"""The QOFT 4-bit layer's fused path (rotate + dequantize + matmul in one W4A16 Triton kernel), run by Triton's
interpreter on CPU (compiled on CUDA with PEFTPLUG_KERNELS_ON_GPU=1), against the same layer's unfused torch path;
and the layers the fused kernel does not take: unfused under ``auto``, a one-line error when it is forced."""

from __future__ import annotations

import peft
import pytest
import torch

import oftv2
from oftv2 import bnb as qoft
from peftplug_kernels import dispatch_table
from peftplug_kernels._triton_available import triton_usable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _needs_fused_kernel(device: str) -> None:
    ok, why = triton_usable("nf4_rotate_matmul", torch.zeros(1, device=device))
    if not ok:
        pytest.skip(why)


def _set_impl(layer, impl: str) -> None:
    settings = layer.oftv2_settings["default"]
    layer.oftv2_settings["default"] = settings.__class__(**{**settings.__dict__, "impl": impl})


def _assert_half_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # fp16 compute on both paths, rounded at different points (the kernel's prologue rotation stays in fp32):
    # a few fp16 roundings of the output's magnitude.
    scale = expected.float().abs().max().item() + 1e-6
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= 8e-3 * scale, f"{what}: max error {err:.3g} > {8e-3 * scale:.3g}"


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_fused_layer_matches_unfused(load_quantized, randomize, device, quant_type, double_quant):
    _needs_fused_kernel(device)
    model = peft.get_peft_model(load_quantized(4, quant_type, double_quant, compute_dtype=torch.float16),
                                oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"], kernel_impl="torch"))
    randomize(model, std=0.05)
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    layer.train()
    x = torch.randn(2, 7, layer.in_features, device=device, requires_grad=True)
    q = layer.oftv2_Q["default"]

    outputs = {}
    for impl in ("torch", "triton"):
        _set_impl(layer, impl)
        assert (layer._fused_adapter(x) is not None) == (impl == "triton")
        y = layer(x)
        y.float().pow(2).sum().backward()
        outputs[impl] = (y.detach(), x.grad.clone(), q.grad.clone())
        x.grad, q.grad = None, None
    for name, a, b in zip(("y", "dX", "dQ"), outputs["triton"], outputs["torch"]):
        _assert_half_close(a, b, name)


def test_forcing_the_fused_kernel_on_a_layer_it_does_not_take_is_a_one_line_error(load_quantized, device):
    # fp32 compute: the fused kernel's main dot is a half-precision tensor-core dot. The plan is resolved when the
    # adapter is built, so the error comes from get_peft_model, naming the layer, before any forward.
    with pytest.raises(ValueError, match="kernel_impl='triton' forces the fused NF4 kernel") as err:
        peft.get_peft_model(load_quantized(4, "nf4", True),
                            oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"], kernel_impl="triton"))
    message = str(err.value)
    assert "\n" not in message
    assert "'model.layers.0.self_attn.q_proj'" in message and "float16/bfloat16" in message
    assert "kernel_impl='auto'" in message


def test_auto_never_fuses_on_a_measured_device(load_quantized, device):
    # The per-device table says never (the fused kernel was slower at every size on an H200; CPU runs Triton only
    # in the interpreter): "auto" plans no fused kernel on this device, at any token count.
    model = peft.get_peft_model(load_quantized(4, "nf4", True, compute_dtype=torch.float16),
                                oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    assert dispatch_table.fused_nf4_max_tokens(device) == 0
    assert layer.kernel_plan("default").fused_max_tokens == 0
    assert layer._fused_adapter(torch.randn(1, 1, layer.in_features, device=device)) is None


def test_auto_leaves_the_fused_kernel_above_the_token_threshold(load_quantized, device, monkeypatch):
    _needs_fused_kernel(device)
    # A device whose table entry fuses up to 8 tokens. "auto" picks Triton only on CUDA; here the kernels run in the
    # interpreter, so stand in for that one check too. The plan is resolved once: refresh it after the change.
    real_resolve = qoft.ops.resolve_impl
    monkeypatch.setattr(qoft.ops, "resolve_impl", lambda impl, *t, **k: real_resolve(
        "triton" if impl == "auto" else impl, *t, **k))
    monkeypatch.setattr(dispatch_table, "fused_nf4_max_tokens", lambda device: 8)

    # A layer computing in fp32, which the fused kernel does not take: auto leaves it unfused whatever the table.
    fp32 = peft.get_peft_model(load_quantized(4, "nf4", True), oftv2.OFTv2Config(block_size=16,
                                                                                  target_modules=["q_proj"]))
    layer = next(m for m in fp32.modules() if isinstance(m, qoft.Linear4bit))
    assert layer.kernel_plan("default").fused_max_tokens == 0

    model = peft.get_peft_model(load_quantized(4, "nf4", True, compute_dtype=torch.float16),
                                oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    assert layer._fused_adapter(torch.randn(1, 1, layer.in_features, device=device)) == "default"
    small = torch.randn(2, 4, layer.in_features, device=device)
    large = torch.randn(3, 3, layer.in_features, device=device)
    assert layer._fused_adapter(small) == "default"
    assert layer._fused_adapter(large) is None  # 9 tokens: rotate kernel, then bitsandbytes' own matmul
    with torch.no_grad():
        unfused = layer(large)
        _set_impl(layer, "triton")
        assert layer._fused_adapter(large) == "default"  # a forced kernel is used at any size
        _assert_half_close(layer(large), unfused, "forced fused vs unfused")


def test_a_layer_without_compute_dtype_is_judged_by_its_input(load_quantized, device, monkeypatch):
    _needs_fused_kernel(device)
    # compute_dtype unset (a hand-built Linear4bit): the forward computes in the activations' dtype, so the fused
    # kernel's dtype rule is judged per forward, not on the fp32 quant state at build time.
    base = load_quantized(4, "nf4", True)
    for block in base.model.layers:
        block.self_attn.q_proj.compute_dtype = None
    model = peft.get_peft_model(base, oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"],
                                                        kernel_impl="triton"))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    half = torch.randn(2, 3, layer.in_features, device=device, dtype=torch.float16)
    assert layer._fused_adapter(half) == "default"
    with torch.no_grad():
        fused = layer(half)
        _set_impl(layer, "torch")
        _assert_half_close(fused, layer(half), "fused vs unfused, fp16 input")
    # Forced on fp32 activations: the one-line error naming the layer, at the forward.
    _set_impl(layer, "triton")
    with pytest.raises(ValueError, match="kernel_impl='triton' forces the fused NF4 kernel") as err:
        layer(torch.randn(2, 3, layer.in_features, device=device))
    assert "'model.layers.0.self_attn.q_proj'" in str(err.value) and "got torch.float32" in str(err.value)
    # Under auto with a table that fuses, fp32 activations run unfused (no error).
    real_resolve = qoft.ops.resolve_impl
    monkeypatch.setattr(qoft.ops, "resolve_impl", lambda impl, *t, **k: real_resolve(
        "triton" if impl == "auto" else impl, *t, **k))
    monkeypatch.setattr(dispatch_table, "fused_nf4_max_tokens", lambda device: 64)
    _set_impl(layer, "auto")
    assert layer.kernel_plan("default").fused_max_tokens == 64
    assert layer._fused_adapter(half) == "default"
    assert layer._fused_adapter(torch.randn(2, 3, layer.in_features, device=device)) is None


def test_a_refused_adapter_leaves_the_layer_as_it_was(load_quantized, randomize, device, batch):
    model = peft.get_peft_model(load_quantized(4, "nf4", True), oftv2.OFTv2Config(block_size=16,
                                                                                   target_modules=["q_proj"]))
    randomize(model, std=0.05)
    model.eval()
    with torch.no_grad():
        before = model(**batch).logits
    with pytest.raises(ValueError, match="kernel_impl='triton' forces the fused NF4 kernel"):
        model.add_adapter("forced", oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"],
                                                      kernel_impl="triton"))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    assert list(layer.oftv2_Q) == ["default"] and list(layer.oftv2_settings) == ["default"]
    assert list(model.peft_config) == ["default"]
    model.to(device)  # refreshes every adapter's kernel plan: nothing half-built left to raise
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before)
    # Forcing it afterwards through the settings (no update_layer to refuse it): the forward says the same.
    _set_impl(layer, "triton")
    with pytest.raises(ValueError, match="which cannot run layer 'model.layers.0.self_attn.q_proj'"):
        model(**batch)
