"""block_rotate's one-pass backward kernel (dX and dR from one read of x and dX') and the token-chunked dR
reduction, against autograd through the reference."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels._triton_available import load_kernel_module
from peftplug_kernels.block_rotate.reference import block_rotate

pytestmark = pytest.mark.usefixtures("needs_triton")


@pytest.mark.parametrize(("tokens", "width", "b", "shared"), [(37, 96, 32, False), (20, 48, 12, False),
                                                              (9, 128, 64, True), (5, 256, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 16])  # one chunk, or several partial dRs summed
def test_backward_matches_autograd(device, close, monkeypatch, tokens, width, b, shared, dtype, chunk):
    kernel = load_kernel_module("block_rotate")
    if chunk:
        monkeypatch.setattr(kernel, "INTERPRETER_TOKENS_PER_CHUNK", chunk)
        monkeypatch.setattr(kernel, "TOKENS_PER_CHUNK", chunk)
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    rot = torch.linalg.qr(torch.randn(1 if shared else width // b, b, b, device=device))[0].contiguous()
    rot.requires_grad_(True)
    grad = torch.randn(tokens, width, device=device, dtype=dtype)
    block_rotate(x, rot).backward(grad)
    dx, dr = kernel.block_rotate_backward(x.detach(), grad, rot.detach())
    close(dx, x.grad, dtype, "dX")
    close(dr, rot.grad, dtype, "dR")
    assert dr.dtype == torch.float32 and dr.shape == rot.shape
    close(kernel.block_grad_rotation(x.detach(), grad, rot.shape[0], b), rot.grad, dtype, "dR alone")
    only_dr = kernel.block_rotate_backward(x.detach(), grad, rot.detach(), need_x=False)
    assert only_dr[0] is None
    close(only_dr[1], rot.grad, dtype, "dR without dX")
    assert kernel.block_rotate_backward(x.detach(), grad, rot.detach(), need_rotation=False)[1] is None


def test_backward_of_no_tokens(device):
    kernel = load_kernel_module("block_rotate")
    dx, dr = kernel.block_rotate_backward(torch.zeros(0, 64, device=device), torch.zeros(0, 64, device=device),
                                          torch.eye(32, device=device).expand(2, 32, 32).contiguous())
    assert dx.shape == (0, 64) and torch.equal(dr, torch.zeros(2, 32, 32, device=device))
