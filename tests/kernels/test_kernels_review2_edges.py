"""Second review: edge inputs the OFTv2 layers pass to the torch path (empty batch, one token, generation's
``x[:, -1:]`` slice, transposed and 4-D inputs), gradients reaching only what requires them, and a block size of 0
refused with a one-line ``ValueError``."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann.reference import triangle_size
from peftplug_kernels.cayley_rotate import reference

B, N_BLOCKS = 4, 3
WIDTH = B * N_BLOCKS


def _edge_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    long = torch.randn(2, 6, WIDTH, generator=gen, dtype=torch.float64)
    return {
        "empty": torch.randn(0, WIDTH, dtype=torch.float64),
        "empty_3d": torch.randn(2, 0, WIDTH, dtype=torch.float64),
        "one_token": torch.randn(1, WIDTH, generator=gen, dtype=torch.float64),
        "last_token_slice": long[:, -1:],
        "transposed": torch.randn(WIDTH, 3, generator=gen, dtype=torch.float64).t(),
        "every_other_column": torch.randn(3, 2 * WIDTH, generator=gen, dtype=torch.float64)[:, ::2],
        "4d": torch.randn(2, 1, 3, WIDTH, generator=gen, dtype=torch.float64),
    }


@pytest.mark.parametrize("name", list(_edge_inputs()))
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("needs", ["both", "x", "q"])
def test_torch_path_matches_reference_on_edge_inputs(name, shared, needs):
    x0 = _edge_inputs()[name]
    q0 = 0.1 * torch.randn(1 if shared else N_BLOCKS, triangle_size(B), dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
    runs = []
    for fn in (lambda x, q: ops.cayley_rotate(x, q, B, cayley_impl="torch", rotate_impl="torch"),
               lambda x, q: reference.cayley_rotate(x, q, B)):
        x = x0.detach().requires_grad_(needs in ("both", "x"))  # detach keeps the view's strides
        q = q0.clone().requires_grad_(needs in ("both", "q"))
        y = fn(x, q)
        y.backward(torch.ones_like(y))
        runs.append((y, x.grad, q.grad))
    (y, gx, gq), (ey, egx, egq) = runs
    assert y.shape == x0.shape and y.dtype == x0.dtype
    torch.testing.assert_close(y, ey, rtol=1e-12, atol=1e-12)
    for got, expected, wanted in ((gx, egx, needs != "q"), (gq, egq, needs != "x")):
        if not wanted:
            assert got is None  # None, not zeros, for an input that does not require grad
            continue
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if x0.shape[-2] == 0 and gq is not None:  # no tokens: an exact zero gradient of the triangles
        assert not gq.any()


def test_block_size_zero_is_a_value_error():
    x = torch.randn(3, WIDTH)
    with pytest.raises(ValueError, match="blocks of size 0"):
        ops.cayley_rotate(x, torch.zeros(WIDTH, 0), 0)
