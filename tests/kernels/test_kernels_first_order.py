"""The hand-written backwards are first order: a ``create_graph=True`` backward through any of them stops with one
line saying so (before, some paths returned wrong second derivatives silently), and ordinary gradients, through
``backward()`` or ``torch.autograd.grad``, are unchanged."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.cayley_rotate.reference import cayley_rotate as composed_reference
from peftplug_kernels.cayley_rotate.stacked import rotate_by, stacked_rotations

BLOCK = 4


def _inputs(device="cpu", dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen, dtype=dtype).to(device).requires_grad_()
    q = (0.1 * torch.randn(2, BLOCK * (BLOCK - 1) // 2, generator=gen, dtype=dtype)).to(device).requires_grad_()
    return x, q


def _torch_path(x, q):
    return ops.cayley_rotate(x, q, BLOCK, cayley_impl="torch", rotate_impl="torch")


def _stacked(x, q):
    (r,) = stacked_rotations([q], BLOCK, 5)
    return rotate_by(x, r)


def _triton_rotate(x, q):
    pytest.importorskip("triton")
    rotation = ops.cayley_neumann(q, BLOCK, impl="torch").float()
    return ops.block_rotate(x.float(), rotation, impl="triton")


def _triton_series(x, q):
    pytest.importorskip("triton")
    rotation = ops.cayley_neumann(q.float(), BLOCK, impl="triton")
    return ops.block_rotate(x.float(), rotation, impl="torch")


PATHS = {"torch": _torch_path, "stacked": _stacked, "triton-rotate": _triton_rotate, "triton-series": _triton_series}


@pytest.mark.parametrize("path", list(PATHS))
def test_create_graph_backward_is_refused_in_one_line(path, device):
    # (device: the Triton paths run where the kernel tests run, CPU interpreter or CUDA.)
    x, q = _inputs(device)
    loss = PATHS[path](x, q).pow(3).sum()
    with pytest.raises(RuntimeError, match="first-order gradients only; a create_graph=True backward"):
        torch.autograd.grad(loss, q, create_graph=True)


@pytest.mark.parametrize("path", ["torch", "stacked"])
def test_first_order_gradients_still_equal_the_composed_reference(path):
    x, q = _inputs()
    grads = torch.autograd.grad(PATHS[path](x, q).pow(3).sum(), (x, q))
    x_ref, q_ref = (t.detach().clone().requires_grad_() for t in (x, q))
    expected = torch.autograd.grad(composed_reference(x_ref, q_ref, BLOCK, terms=5).pow(3).sum(), (x_ref, q_ref))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
