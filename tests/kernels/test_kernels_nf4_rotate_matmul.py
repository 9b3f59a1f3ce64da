"""nf4_rotate_matmul: the fused Triton kernel (interpreter on CPU) vs the unfused oracle ``block_rotate`` ->
``bitsandbytes.functional.dequantize_4bit`` -> matmul, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peftplug_kernels import ops
from peftplug_kernels.block_rotate.reference import block_rotate
from peftplug_kernels.nf4_dequantize import reference

bnbf = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    ("lead", "out_f", "in_f", "b", "quant_type", "nested", "shared"),
    [
        ((1,), 16, 64, 16, "nf4", False, False),  # tiny
        ((37,), 40, 128, 32, "nf4", True, False),  # odd token / output counts, double quant
        ((2, 9), 24, 96, 12, "fp4", False, False),  # non-power-of-two block, rows straddling quant blocks
        ((130,), 72, 128, 64, "nf4", True, True),  # several token tiles, shared block
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_matches_unfused_oracle(device, close, quantize, lead, out_f, in_f, b, quant_type, nested, shared, dtype):
    _, packed, state = quantize((out_f, in_f), dtype, quant_type, nested, device=device, seed=in_f + b)
    x = torch.randn(*lead, in_f, device=device, dtype=dtype, requires_grad=True)
    rot = torch.linalg.qr(torch.randn(1 if shared else in_f // b, b, b, device=device))[0].requires_grad_(True)
    bias = torch.randn(out_f, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(*lead, out_f, device=device, dtype=dtype)

    y = ops.nf4_rotate_matmul(x, rot, packed, state, bias, impl="triton")
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    y.backward(grad)
    got = [t.grad.clone() for t in (x, rot, bias)]
    for t in (x, rot, bias):
        t.grad = None

    # The oracle dequantizes with our torch code: bitsandbytes' CPU kernel is wrong when rows straddle blocks
    # (see above); on CUDA, and whenever rows align, the two dequantizations are identical (tested above).
    if in_f % state.blocksize == 0 or device == "cuda":
        w = bnbf.dequantize_4bit(packed, state).to(dtype)
    else:
        w = reference.dequantize_4bit(packed, state, dtype=dtype)
    expected = F.linear(block_rotate(x, rot), w, bias)
    expected.backward(grad)
    close(y, expected, dtype, "y")
    for name, g, t in zip(("dX", "dR", "dbias"), got, (x, rot, bias)):
        close(g, t.grad, dtype, name)


def test_reference_path_matches_oracle(quantize):
    _, packed, state = quantize((32, 64), torch.float32, "nf4", True)
    x = torch.randn(5, 64)
    rot = torch.linalg.qr(torch.randn(4, 16, 16))[0]
    expected = F.linear(block_rotate(x, rot), bnbf.dequantize_4bit(packed, state))
    torch.testing.assert_close(ops.nf4_rotate_matmul(x, rot, packed, state, impl="torch"), expected)


def test_shape_mismatch_raises(quantize):
    _, packed, state = quantize((32, 64), torch.float32, "nf4", False)
    with pytest.raises(ValueError, match="does not match input width"):
        ops.nf4_rotate_matmul(torch.randn(2, 48), torch.eye(16)[None], packed, state)


def test_layers_the_fused_kernel_cannot_take_are_refused_when_forced():
    assert ops.nf4_kernel_unfit(32, (4096, 4096)) == ""
    assert "rotation blocks up to" in ops.nf4_kernel_unfit(256, (4096, 4096))
    assert "2³¹" in ops.nf4_kernel_unfit(32, (65536, 65536))  # int32 offsets would wrap

    class HugeState:  # only the shape is read before the refusal
        shape = (65536, 65536)

    with pytest.raises(ValueError, match="cannot run this layer"):
        ops.nf4_rotate_matmul(torch.zeros(1, 65536), torch.eye(32)[None], torch.zeros(1, dtype=torch.uint8),
                              HugeState(), impl="triton")
