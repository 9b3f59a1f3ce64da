"""Fourth review: arguments of the public ops that the kernels cannot check themselves are refused with a one-line
``ValueError`` naming the argument, on every path, where before they gave wrong results silently (a ``[n_blocks]``
dropout mask broadcast over the wrong dimension; the forced Triton NF4 and dequantize kernels reading past the end of
a too-short bias or packed weight) or a ``ZeroDivisionError`` (a ``[n, 0, 0]`` rotation)."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops

bnbf = pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    """Both implementations; ``"triton"`` skips cleanly without Triton (the interpreter on CPU)."""
    if request.param == "triton":
        request.getfixturevalue("needs_triton")
    return request.param


@pytest.mark.parametrize("keep_shape", [(4,), (2, 1, 1), (4, 1)])
def test_a_dropout_mask_that_is_not_one_per_block_is_refused(device, impl, keep_shape):
    # 4 blocks of 4: a [4] mask broadcast over each block's columns and returned a wrong rotation without an error.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen).to(device)
    q = (0.1 * torch.randn(4, 6, generator=gen)).to(device)
    keep = torch.ones(keep_shape, device=device)
    with pytest.raises(ValueError, match=r"keep must be None or a \[4, 1, 1\] 0/1 mask") as err:
        ops.cayley_rotate(x, q, 4, keep=keep, cayley_impl=impl, rotate_impl=impl)
    assert "\n" not in str(err.value) and str(keep_shape) in str(err.value)


@pytest.mark.parametrize("shared", [False, True])
def test_a_dropout_mask_of_one_per_block_still_matches_the_reference(device, impl, shared):
    from peftplug_kernels.cayley_rotate import reference

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=gen).to(device)
    q = (0.1 * torch.randn(1 if shared else 4, 6, generator=gen)).to(device)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0], device=device).view(4, 1, 1)
    got = ops.cayley_rotate(x, q, 4, keep=keep, cayley_impl=impl, rotate_impl=impl)
    expected = reference.cayley_rotate(x.double(), q.double(), 4, keep=keep.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_an_empty_rotation_block_is_a_value_error():
    with pytest.raises(ValueError, match=r"rotation blocks must be at least 1 x 1, got \(1, 0, 0\)"):
        ops.block_rotate(torch.randn(3, 12), torch.zeros(1, 0, 0))


def _layer(device):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)).half()
    packed, state = bnbf.quantize_4bit(w.to(device), blocksize=64, quant_type="nf4")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3)).half().to(device)
    rotation = torch.eye(32, device=device).expand(4, 32, 32).contiguous()
    return x, rotation, packed, state


@pytest.mark.parametrize("length", [8, 40])
def test_a_bias_that_is_not_one_per_output_is_refused(device, impl, length):
    x, rotation, packed, state = _layer(device)
    # A view of a longer tensor: the fused kernel read big[8:32] as the bias of outputs 8..31, without an error.
    bias = torch.randn(64, device=device).half()[:length]
    with pytest.raises(ValueError, match=rf"bias must be None or \[32\] \(one per output feature\), got \({length},\)"):
        ops.nf4_rotate_matmul(x, rotation, packed, state, bias, impl=impl)


def test_a_packed_weight_shorter_than_its_quant_state_is_refused(device, impl):
    x, rotation, packed, state = _layer(device)
    half = packed[: packed.shape[0] // 2]  # the Triton kernels decoded 2048 bytes from a 1024-byte weight
    with pytest.raises(ValueError, match=r"weight holds 1024 packed bytes, but quant_state.shape \(32, 128\) needs 2048"):
        ops.dequantize_4bit(half, state, impl=impl)
    with pytest.raises(ValueError, match="weight holds 1024 packed bytes"):
        ops.nf4_rotate_matmul(x, rotation, half, state, None, impl=impl)


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_valid_4bit_inputs_are_still_taken(device, close, impl, storage):
    """The checks accept what bitsandbytes produces, in any quant_storage, and odd element counts."""
    x, rotation, _, _ = _layer(device)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)).half().to(device)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=storage)
    bias = torch.randn(32, device=device).half()
    expected = x @ ops.dequantize_4bit(packed, state, impl="torch").t() + bias
    close(ops.nf4_rotate_matmul(x, rotation, packed, state, bias, impl=impl), expected, torch.float16, "y")
    packed_odd, state_odd = bnbf.quantize_4bit(torch.randn(5, 7).to(device), blocksize=64, quant_type="fp4")
    assert ops.dequantize_4bit(packed_odd, state_odd, impl=impl).shape == (5, 7)
