"""nf4_dequantize: the pure-torch reference vs bitsandbytes, and the Triton kernel (interpreter on CPU) vs both."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.nf4_dequantize import reference

bnbf = pytest.importorskip("bitsandbytes.functional")

@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize(("dtype", "blocksize"), [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 64)])
def test_torch_dequant_equals_bitsandbytes(device, quantize, quant_type, nested, dtype, blocksize):
    _, packed, state = quantize((48, 256), dtype, quant_type, nested, blocksize, device)
    ours = reference.dequantize_4bit(packed, state)
    theirs = bnbf.dequantize_4bit(packed, state)
    assert ours.dtype == theirs.dtype == dtype
    # Bit-exact against bitsandbytes' CPU kernels; its CUDA kernels may round the product differently (1 ulp).
    exact = device == "cpu"
    torch.testing.assert_close(ours, theirs, rtol=0 if exact else None, atol=0 if exact else None)


def test_torch_dequant_rows_not_multiple_of_blocksize(quantize):
    # Quantization blocks run over the row-major flattened weight and may straddle rows. bitsandbytes 0.50's CPU
    # C kernel gets this case wrong (it restarts blocks per row), so compare with its pure-torch default backend
    # and with the original weight instead.
    default_ops = pytest.importorskip("bitsandbytes.backends.default.ops")
    w, packed, state = quantize((6, 96), torch.float32, "nf4", False)
    ours = reference.dequantize_4bit(packed, state)
    # Unwrap bitsandbytes' torch.compile wrapper: compiling costs ~10 s here and changes nothing numerically.
    compute = getattr(default_ops._dequantize_4bit_compute, "__wrapped__", default_ops._dequantize_4bit_compute)
    theirs = compute(packed.reshape(-1), state.absmax, state.code, 64, state.shape, torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # NF4 error stays within half the widest code gap (≈0.16) times the block's absmax.
    assert (ours - w).abs().max() <= 0.17 * w.abs().max()


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(
    ("shape", "blocksize", "quant_type", "nested"),
    [
        ((48, 256), 64, "nf4", True),  # aligned rows, double quant
        ((6, 96), 64, "nf4", False),  # quantization blocks straddle rows
        ((5, 7), 64, "fp4", True),  # odd element count: the last byte holds one code
        ((300, 256), 128, "nf4", True),  # > 2¹⁶ elements: several programs in the interpreter too
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_dequant_matches_reference(device, quantize, shape, blocksize, quant_type, nested, dtype):
    _, packed, state = quantize(shape, dtype, quant_type, nested, blocksize, device)
    expected = reference.dequantize_4bit(packed, state)
    got = ops.dequantize_4bit(packed, state, impl="triton")
    assert got.shape == shape and got.dtype == dtype
    _assert_same_rounding(got, expected, device)
    if shape[1] % blocksize == 0 or device == "cuda":
        _assert_same_rounding(got, bnbf.dequantize_4bit(packed, state), device)


def _assert_same_rounding(got: torch.Tensor, expected: torch.Tensor, device: str) -> None:
    """Bit-exact on CPU, except that the Triton interpreter truncates fp32 -> bf16 (GPUs round to nearest), so bf16
    may differ by one ulp there; on GPU an FMA may round the nested scale differently (an ulp)."""
    if device == "cpu" and got.dtype != torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        ulp = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=0)


@pytest.mark.usefixtures("needs_triton")
def test_dequant_output_dtype_is_honoured(device, quantize):
    _, packed, state = quantize((16, 64), torch.float32, "nf4", True, device=device)
    got = ops.dequantize_4bit(packed, state, dtype=torch.bfloat16, impl="triton")
    assert got.dtype == torch.bfloat16
    _assert_same_rounding(got, reference.dequantize_4bit(packed, state, dtype=torch.bfloat16), device)


def test_dequant_torch_impl_is_the_reference(quantize):
    _, packed, state = quantize((8, 64), torch.float16, "nf4", False)
    torch.testing.assert_close(ops.dequantize_4bit(packed, state, impl="torch"),
                               reference.dequantize_4bit(packed, state), rtol=0, atol=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.dequantize_4bit(packed, state, impl="cuda")
