"""float64 is not a Triton input (the kernels compute in fp32): forcing ``impl="triton"`` on fp64 tensors is a
one-line error naming the dtype (before, the kernels silently computed fp64 inputs in fp32 and failed gradcheck),
and ``impl="auto"`` keeps fp64 on the torch path, exact to fp64."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops

pytestmark = pytest.mark.usefixtures("needs_triton")


def test_forced_triton_refuses_float64_in_one_line(device):
    x = torch.randn(3, 8, dtype=torch.float64, device=device)
    rotation = torch.eye(4, dtype=torch.float64, device=device).expand(2, 4, 4).contiguous()
    q = torch.zeros(2, 6, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="take fp16, bf16 or fp32 tensors, got float64"):
        ops.block_rotate(x, rotation, impl="triton")
    with pytest.raises(RuntimeError, match="got float64"):
        ops.cayley_neumann(q, 4, impl="triton")


def test_auto_keeps_float64_on_the_exact_torch_path():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64, generator=gen)
    q = 0.1 * torch.randn(2, 6, dtype=torch.float64, generator=gen)
    assert ops.resolve_impl("auto", x, q) == "torch"
    rotation = ops.cayley_neumann(q, 4, impl="auto")
    expected = torch.einsum("tnb,nbc->tnc", x.view(3, 2, 4), rotation).reshape(3, 8)
    torch.testing.assert_close(ops.block_rotate(x, rotation, impl="auto"), expected, rtol=0, atol=1e-15)
