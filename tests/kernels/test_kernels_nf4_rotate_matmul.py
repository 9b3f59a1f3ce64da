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
        ((2, 9), 24, 192, 12, "fp4", False, False),  # non-power-of-two block: x rotated before the kernel
        ((130,), 72, 128, 64, "nf4", True, True),  # several token tiles (above FUSED_MAX_TOKENS), shared block
        ((3,), 16, 512, 256, "nf4", True, False),  # a rotation block wider than the K step
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
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


@pytest.mark.parametrize(
    ("dtype", "in_f", "blocksize", "why"),
    [
        (torch.float32, 128, 64, "float16/bfloat16 activations, got torch.float32"),
        (torch.float16, 96, 64, "input width 96 is not a multiple of the quantization blocksize 64"),
        (torch.bfloat16, 128, 32, "power of two >= 64, got 32"),
    ],
)
def test_forcing_the_fused_kernel_where_it_does_not_run_is_a_one_line_error(quantize, dtype, in_f, blocksize, why):
    _, packed, state = quantize((16, in_f), dtype, "nf4", True, blocksize=blocksize)
    x = torch.randn(3, in_f, dtype=dtype)
    rot = torch.linalg.qr(torch.randn(in_f // 16, 16, 16))[0]
    # Refused before any kernel loads (no Triton needed for the error), at any token count.
    with pytest.raises(ValueError, match="the fused NF4 kernel cannot run this layer") as err:
        ops.nf4_rotate_matmul(x, rot, packed, state, impl="triton")
    assert why in str(err.value) and "\n" not in str(err.value)
    # auto runs the same layer unfused, as the torch reference does.
    w = reference.dequantize_4bit(packed, state, dtype=dtype)
    torch.testing.assert_close(ops.nf4_rotate_matmul(x, rot, packed, state, impl="auto"),
                               F.linear(block_rotate(x, rot), w), rtol=1e-2, atol=1e-2)


def test_auto_leaves_unfit_layers_unfused_where_the_table_fuses(quantize, monkeypatch):
    # On CPU auto never resolves the fused op to Triton: stand in for a device whose table fuses (any token count),
    # so that the fit rule alone decides. The fused kernel itself is replaced by a recorder.
    real_resolved = ops._resolved
    monkeypatch.setattr(ops, "_resolved", lambda impl, op, *t: "triton" if op == "nf4_rotate_matmul"
                        else real_resolved(impl, op, *t))
    monkeypatch.setattr(ops.dispatch_table, "fused_nf4_max_tokens", lambda device: 1 << 20)
    fused_calls = []
    monkeypatch.setattr(ops.library, "nf4_rotate_matmul", lambda *args: fused_calls.append(args) or args[0])
    rot = torch.linalg.qr(torch.randn(128 // 16, 16, 16))[0]
    for dtype in (torch.float16, torch.float32):
        _, packed, state = quantize((16, 128), dtype, "nf4", True)
        x = torch.randn(3, 128, dtype=dtype)
        out = ops.nf4_rotate_matmul(x, rot, packed, state, impl="auto")
        if dtype == torch.float16:  # fit: the table's choice, the fused kernel
            assert len(fused_calls) == 1
            continue
        assert len(fused_calls) == 1  # fp32 activations: unfused, whatever the table says
        w = reference.dequantize_4bit(packed, state, dtype=dtype)
        torch.testing.assert_close(out, F.linear(block_rotate(x, rot), w), rtol=1e-4, atol=1e-4)
