"""The QOFT 4-bit layer's fused path (rotate + dequantize + matmul in one Triton kernel), run by Triton's
interpreter on CPU (compiled on CUDA with PEFTPLUG_KERNELS_ON_GPU=1), against the same layer's unfused torch path."""

from __future__ import annotations

import peft
import pytest
import torch

import oftv2
from oftv2 import bnb as qoft
from peftplug_kernels import dispatch_table
from peftplug_kernels._triton_available import triton_usable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False)])
def test_fused_layer_matches_unfused(load_quantized, randomize, device, quant_type, double_quant):
    probe = torch.zeros(1, device=device)
    ok, why = triton_usable("nf4_rotate_matmul", probe)
    if not ok:
        pytest.skip(why)
    model = peft.get_peft_model(load_quantized(4, quant_type, double_quant),
                                oftv2.OFTv2Config(block_size=16, target_modules=["q_proj"], kernel_impl="torch"))
    randomize(model, std=0.05)
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    layer.train()
    x = torch.randn(2, 7, layer.in_features, device=device, requires_grad=True)
    q = layer.oftv2_Q["default"]

    outputs = {}
    for impl in ("torch", "triton"):
        layer.oftv2_settings["default"] = layer.oftv2_settings["default"].__class__(
            **{**layer.oftv2_settings["default"].__dict__, "impl": impl})
        assert (layer._fused_adapter(x) is not None) == (impl == "triton")
        y = layer(x)
        y.pow(2).sum().backward()
        outputs[impl] = (y.detach(), x.grad.clone(), q.grad.clone())
        x.grad, q.grad = None, None
    for name, a, b in zip(("y", "dX", "dQ"), outputs["triton"], outputs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_never_fuses_on_a_measured_device(load_quantized, device):
    # The per-device table says never (the fused kernel was slower at every size on an H200; CPU runs Triton only
    # in the interpreter): "auto" plans no fused kernel on this device, at any token count.
    model = peft.get_peft_model(load_quantized(4, "nf4", True), oftv2.OFTv2Config(block_size=16,
                                                                                   target_modules=["q_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    assert dispatch_table.fused_nf4_max_tokens(device) == 0
    assert layer.kernel_plan("default").fused_max_tokens == 0
    assert layer._fused_adapter(torch.randn(1, 1, layer.in_features, device=device)) is None


def test_auto_leaves_the_fused_kernel_above_the_token_threshold(load_quantized, device, monkeypatch):
    ok, why = triton_usable("nf4_rotate_matmul", torch.zeros(1, device=device))
    if not ok:
        pytest.skip(why)
    model = peft.get_peft_model(load_quantized(4, "nf4", True), oftv2.OFTv2Config(block_size=16,
                                                                                   target_modules=["q_proj"]))
    layer = next(m for m in model.modules() if isinstance(m, qoft.Linear4bit))
    # A device whose table entry fuses up to 8 tokens. "auto" picks Triton only on CUDA; here the kernels run in the
    # interpreter, so stand in for that one check too. The plan is resolved once: refresh it after the change.
    real_resolve = qoft.ops.resolve_impl
    monkeypatch.setattr(qoft.ops, "resolve_impl", lambda impl, *t, **k: real_resolve(
        "triton" if impl == "auto" else impl, *t, **k))
    monkeypatch.setattr(dispatch_table, "fused_nf4_max_tokens", lambda device: 8)
    assert layer._fused_adapter(torch.randn(1, 1, layer.in_features, device=device)) is None  # not yet refreshed
    # This layer computes in fp32, which the W4A16 kernels do not take: auto leaves it unfused whatever the table.
    layer.refresh_kernels()
    assert layer.kernel_plan("default").fused_max_tokens == 0
    # Stand in for a layer they take (bf16 would make the interpreter comparison below a bf16 one).
    monkeypatch.setattr(qoft, "w4a16_unfit", lambda *args: "")
    layer.refresh_kernels()
    small = torch.randn(2, 4, layer.in_features, device=device)
    large = torch.randn(3, 3, layer.in_features, device=device)
    assert layer._fused_adapter(small) == "default"
    assert layer._fused_adapter(large) is None  # 9 tokens: rotate kernel, then bitsandbytes' own matmul
    with torch.no_grad():
        unfused = layer(large)
        settings = layer.oftv2_settings["default"]
        layer.oftv2_settings["default"] = settings.__class__(**{**settings.__dict__, "impl": "triton"})
        assert layer._fused_adapter(large) == "default"  # a forced kernel is used at any size
        torch.testing.assert_close(layer(large), unfused, rtol=1e-4, atol=1e-4)
