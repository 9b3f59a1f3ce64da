"""block_rotate: Triton kernel (interpreter on CPU) vs the pure-torch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.block_rotate import reference

pytestmark = pytest.mark.usefixtures("needs_triton")


@pytest.mark.parametrize(
    ("lead", "b", "n_blocks", "shared"),
    [
        ((1,), 16, 1, False),  # tiny
        ((37,), 12, 3, False),  # non-power-of-two block and token count
        ((2, 19), 32, 4, False),  # leading batch dims
        ((5,), 4, 6, True),  # one block shared across the width, block below tl.dot's 16
        ((300,), 64, 2, False),  # several token tiles
        ((7,), 33, 2, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_and_backward_match_reference(device, close, lead, b, n_blocks, shared, dtype):
    torch.manual_seed(b * 7 + n_blocks)
    width = n_blocks * b
    x = torch.randn(*lead, width, device=device, dtype=dtype, requires_grad=True)
    # Rotations stay fp32 adapter parameters while activations are half, as in training.
    rot = torch.randn(1 if shared else n_blocks, b, b, device=device, requires_grad=True)
    grad = torch.randn(*lead, width, device=device, dtype=dtype)

    out = ops.block_rotate(x, rot, impl="triton")
    assert out.dtype == dtype and out.shape == x.shape
    out.backward(grad)
    gx, grot = x.grad.clone(), rot.grad.clone()
    x.grad, rot.grad = None, None

    expected = reference.block_rotate(x, rot)
    expected.backward(grad)
    close(out, expected, dtype, "output")
    close(gx, x.grad, dtype, "dX")
    close(grot, rot.grad, dtype, "dR")


def test_identity_rotation_is_exact(device):
    x = torch.randn(9, 48, device=device)
    eye = torch.eye(12, device=device).expand(4, 12, 12).contiguous()
    assert torch.equal(ops.block_rotate(x, eye, impl="triton"), x)


def test_only_requested_gradients(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    rot = torch.randn(2, 16, 16, device=device)  # frozen rotation: only dX
    ops.block_rotate(x, rot, impl="triton").sum().backward()
    expected = torch.einsum("trc,rkc->trk", torch.ones(6, 2, 16, device=device), rot)  # dX = dX' Rᵀ
    torch.testing.assert_close(x.grad, expected.reshape(6, 32))


def test_empty_input(device):
    x = torch.randn(0, 24, device=device)
    assert ops.block_rotate(x, torch.randn(2, 12, 12, device=device), impl="triton").shape == (0, 24)


@pytest.mark.parametrize(
    ("width", "shape", "match"),
    [(30, (3, 12, 12), "not a multiple"), (36, (2, 12, 12), "do not fit"), (24, (2, 12, 11), "n_blocks, b, b")],
)
def test_bad_shapes_raise(width, shape, match):
    with pytest.raises(ValueError, match=match):
        ops.block_rotate(torch.randn(2, width), torch.randn(*shape), impl="torch")
