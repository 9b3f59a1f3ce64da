"""Second review: the public ops under ``torch.compile(fullgraph=True, dynamic=True)`` and after a recompile that
makes the input width symbolic while the adapter's parameters keep static shapes (dynamo treats parameters as
static). Dynamo evaluated ``rows in (1, width // b)`` with a static ``rows`` and a symbolic width as False, so every
shape check written that way raised its own ``ValueError`` ("3 blocks of size 4 do not fit input width 12") on
valid inputs: ``torch.compile(model, dynamic=True)`` of any OFTv2 model failed on its first call."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.block_rotate import reference as rotate_ref
from peftplug_kernels.cayley_neumann.reference import triangle_size
from peftplug_kernels.cayley_rotate import reference as rotate_composed
from peftplug_kernels.cayley_rotate.stacked import rotate_by

B = 4  # block size
N_BLOCKS = 3


class _Adapter(torch.nn.Module):
    """One adapter's triangles as a parameter (static under dynamo), applied by one of the public entry points."""

    def __init__(self, path: str):
        super().__init__()
        self.q = torch.nn.Parameter(0.1 * torch.randn(N_BLOCKS, triangle_size(B), dtype=torch.float64))
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "cayley_rotate":
            return ops.cayley_rotate(x, self.q, B, cayley_impl="torch", rotate_impl="torch")
        if self.path == "cayley_rotate_exact":  # the composed references (no Function for the exact form)
            return ops.cayley_rotate(x, self.q, B, form="cayley", cayley_impl="torch", rotate_impl="torch")
        rotation = ops.cayley_neumann(self.q, B, impl="torch")
        if self.path == "block_rotate":
            return ops.block_rotate(x, rotation, impl="torch")
        if self.path == "rotate_by":
            return rotate_by(x, rotation)
        return rotate_ref.block_rotate(x, rotation)


PATHS = ["cayley_rotate", "cayley_rotate_exact", "block_rotate", "rotate_by", "reference"]


def _expected(module: _Adapter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = module.q.detach().clone().requires_grad_(True)
    xe = x.detach().clone().requires_grad_(True)
    form = "cayley" if module.path == "cayley_rotate_exact" else "cayley_neumann"
    y = rotate_composed.cayley_rotate(xe, q, B, form=form)
    gx, gq = torch.autograd.grad(y.square().sum(), (xe, q))
    return y.detach(), gx, gq


def _check(compiled, module: _Adapter, x: torch.Tensor) -> None:
    x = x.detach().requires_grad_(True)
    y = compiled(x)
    gx, gq = torch.autograd.grad(y.square().sum(), (x, module.q))
    ey, egx, egq = _expected(module, x)
    torch.testing.assert_close(y, ey, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, egx, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gq, egq, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", PATHS)
def test_compile_dynamic_true(path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = _Adapter(path)
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in ((2, 5), (3, 1), (7,)):  # several token counts on one compiled graph
        _check(compiled, module, torch.randn(*shape, N_BLOCKS * B, dtype=torch.float64))


@pytest.mark.parametrize("path", PATHS)
def test_recompile_after_a_rank_change(path):
    # Automatic dynamic shapes: 2-D inputs of two token counts, then a 3-D one (generation's x[:, -1:] slice) and
    # 4-D: the recompile marks every dimension of the input dynamic, the width included.
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = _Adapter(path)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    width = N_BLOCKS * B
    long = torch.randn(2, 6, width, dtype=torch.float64)
    for x in (torch.randn(5, width, dtype=torch.float64), torch.randn(7, width, dtype=torch.float64), long[:, -1:],
              torch.randn(2, 3, 2, width, dtype=torch.float64), torch.randn(0, width, dtype=torch.float64)):
        _check(compiled, module, x)


def test_width_checks_still_refuse_bad_shapes_under_compile():
    # The rewritten checks keep refusing what they refused (eager and compiled).
    q = torch.zeros(2, triangle_size(B))
    x = torch.randn(3, N_BLOCKS * B)
    for fn in (lambda x, q: ops.cayley_rotate(x, q, B, cayley_impl="torch", rotate_impl="torch"),
               lambda x, q: ops.block_rotate(x, ops.cayley_neumann(q, B, impl="torch"), impl="torch"),
               lambda x, q: rotate_by(x, ops.cayley_neumann(q, B, impl="torch")),
               lambda x, q: rotate_ref.block_rotate(x, ops.cayley_neumann(q, B, impl="torch"))):
        with pytest.raises(ValueError, match="fit|tile"):
            fn(x, q)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="fit|tile"):
            torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")(x, q)


class _TwoLayers(torch.nn.Module):
    """Two adapters in one graph: the case where a symbolic float that dynamo made of a default argument in the
    first layer's backward broke the second's ("lift_tracked_freevar_to_input should not be called on root
    SubgraphTracer")."""

    def __init__(self, path: str, dtype: torch.dtype):
        super().__init__()
        self.qs = torch.nn.ParameterList(
            [torch.nn.Parameter(0.1 * torch.randn(N_BLOCKS, triangle_size(B), dtype=dtype)) for _ in range(2)])
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for q in self.qs:
            if self.path == "cayley_rotate":
                x = ops.cayley_rotate(x, q, B, terms=self.terms, cayley_impl="torch", rotate_impl="torch")
            else:  # bf16 activations, fp32 blocks: rotate_by's hand-written Function
                x = rotate_by(x, ops.cayley_neumann(q, B, terms=self.terms, impl="torch"))
        return x


@pytest.mark.parametrize("terms", [3, 5])
@pytest.mark.parametrize("path", ["cayley_rotate", "rotate_by"])
def test_compile_dynamic_true_two_layers(path, terms):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = _TwoLayers(path, torch.float64 if path == "cayley_rotate" else torch.float32)
    module.terms = terms
    x_dtype = torch.float64 if path == "cayley_rotate" else torch.bfloat16
    x = torch.randn(2, 5, N_BLOCKS * B, dtype=torch.float64).to(x_dtype).requires_grad_(True)
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x).float().square().sum(), (x, *module.qs))
    expected = torch.autograd.grad(module(x).float().square().sum(), (x, *module.qs))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6 if x_dtype == torch.float64 else 2e-2, atol=1e-6)
