"""cayley_rotate: the lean torch path (series + rotation in one autograd Function, hand-written backward) against the
composition of the references under autograd, in fp64 (parity to rounding), half precision and under compile.

The parity tests take the ``device`` fixture: CPU here, CUDA in the GPU run (``PEFTPLUG_KERNELS_ON_GPU=1``, phase 2
of ``benchmarks/gpu/run_all.sh``), before its step benchmark times this path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann.reference import triangle_size
from peftplug_kernels.cayley_rotate import function as lean
from peftplug_kernels.cayley_rotate import reference


def _inputs(n_blocks, b, rows, dtype=torch.float64, tokens=(2, 5), seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = (0.3 / b**0.5 * torch.randn(rows, triangle_size(b), generator=gen, dtype=torch.float64)).to(device, dtype)
    x = torch.randn(*tokens, n_blocks * b, generator=gen, dtype=torch.float64).to(device, dtype)
    return x.requires_grad_(True), q.requires_grad_(True)


def _grads(y, inputs, grad):
    return torch.autograd.grad(y, inputs, grad)


@pytest.mark.parametrize("terms", [2, 3, 4, 5])
@pytest.mark.parametrize(("n_blocks", "b", "shared"), [(3, 4, False), (3, 4, True), (1, 6, False), (2, 8, False)])
@pytest.mark.parametrize("dropout", [False, True])
def test_matches_reference_composition_fp64(device, terms, n_blocks, b, shared, dropout):
    x, q = _inputs(n_blocks, b, 1 if shared else n_blocks, seed=terms + n_blocks, device=device)
    keep = (torch.tensor([1.0, 0.0, 1.0][:n_blocks], dtype=torch.float64, device=device).view(-1, 1, 1)
            if dropout else None)
    y = lean.CayleyRotateFunction.apply(x, q, b, terms, keep)
    expected = reference.cayley_rotate(x, q, b, terms=terms, keep=keep)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    for got, want, name in zip(_grads(y, (x, q), grad), _grads(expected, (x, q), grad), ("dx", "dq")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("terms", [2, 3, 5])
def test_gradcheck(terms):
    x, q = _inputs(2, 4, 2, tokens=(3,), seed=terms)
    assert torch.autograd.gradcheck(lambda x_, q_: lean.CayleyRotateFunction.apply(x_, q_, 4, terms, None), (x, q))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset"])
def test_non_contiguous_input_and_gradient(device, layout):
    # The Function takes block views of contiguous tensors by one as_strided (strides computed from the shape) and
    # of others by reshape: a transposed or sliced input, a view at a storage offset, and a non-contiguous incoming
    # gradient must all give the reference's values.
    x, q = _inputs(3, 4, 3, tokens=(6,), seed=7, device=device)
    base = x.detach()
    x = {"transposed": base.t().contiguous().t(), "sliced": torch.stack([base, base], -1).flatten(-2)[:, ::2],
         "offset": torch.cat([base, base])[6:]}[layout]
    assert x.is_contiguous() == (layout == "offset") and (layout != "offset" or x.storage_offset() > 0)
    x = x.requires_grad_(True)
    y = lean.CayleyRotateFunction.apply(x, q, 4, 5, None)
    expected = reference.cayley_rotate(x, q, 4, terms=5)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn(12, 6, dtype=y.dtype, device=device).t()  # non-contiguous
    for got, want, name in zip(_grads(y, (x, q), grad), _grads(expected, (x, q), grad), ("dx", "dq")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_dropped_block_is_the_identity():
    x, q = _inputs(3, 4, 3)
    keep = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64).view(-1, 1, 1)
    y = lean.CayleyRotateFunction.apply(x, q, 4, 5, keep)
    torch.testing.assert_close(y[..., 4:8], x[..., 4:8], rtol=0, atol=0)
    assert not torch.allclose(y[..., :4], x[..., :4])


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input_rotates_in_fp32(device, x_dtype):
    x, q = _inputs(4, 32, 4, dtype=torch.float32, tokens=(6,), seed=3, device=device)
    x = x.detach().to(x_dtype).requires_grad_(True)
    y = lean.CayleyRotateFunction.apply(x, q, 32, 5, None)
    assert y.dtype == x_dtype
    # The reference also rotates in fp32 and rounds once: one rounding apart at most.
    expected = reference.cayley_rotate(x, q, 32, terms=5)
    ulp = torch.finfo(x_dtype).eps * expected.float().abs()
    assert ((y.float() - expected.float()).abs() <= ulp + 1e-6).all()
    grad = torch.randn_like(y)
    dx, dq = _grads(y, (x, q), grad)
    dx_ref, dq_ref = _grads(expected, (x, q), grad)
    assert dx.dtype == x_dtype and dq.dtype == torch.float32
    torch.testing.assert_close(dq, dq_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx.float(), dx_ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_only_the_needed_gradients(needs):
    x, q = _inputs(2, 4, 2)
    x.requires_grad_(needs[0])
    q.requires_grad_(needs[1])
    y = lean.CayleyRotateFunction.apply(x, q, 4, 5, None)
    wanted = [t for t, n in zip((x, q), needs) if n]
    got = _grads(y, wanted, torch.ones_like(y))
    expected = _grads(reference.cayley_rotate(x, q, 4), wanted, torch.ones_like(y))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("form", "terms"), [("peft_cn", 5), ("cayley", 5), ("cayley_neumann", 6)])
def test_ops_composes_the_references_where_no_program_exists(form, terms):
    assert not lean.supports(form, terms)
    x, q = _inputs(2, 4, 2)
    y = ops.cayley_rotate(x, q, 4, terms=terms, form=form, cayley_impl="torch", rotate_impl="torch")
    torch.testing.assert_close(y, reference.cayley_rotate(x, q, 4, terms=terms, form=form))


def test_ops_rejects_blocks_that_do_not_fit():
    x, q = _inputs(2, 4, 2)
    with pytest.raises(ValueError, match="do not fit input width 8"):
        ops.cayley_rotate(x, q, 3, cayley_impl="torch", rotate_impl="torch")
    with pytest.raises(ValueError, match=r"q_vec must be \[n_blocks, 6\]"):
        ops.cayley_rotate(x, q[:, :5], 4, cayley_impl="torch", rotate_impl="torch")


class _CountOps(TorchDispatchMode):
    """Counts ATen ops that compute (views and allocations left out): the kernel calls a GPU would launch."""

    VIEWS = frozenset({"view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze",
             "slice", "select", "alias", "detach", "as_strided", "empty", "empty_like", "_to_copy_noop"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _count(fn):
    x, q = _inputs(4, 8, 4, dtype=torch.float32, tokens=(8,))
    grad = torch.ones(8, 32)
    torch.autograd.grad(fn(x, q), (x, q), grad)  # first call: builds the cached index tables
    with _CountOps() as counter:
        torch.autograd.grad(fn(x, q), (x, q), grad)
    return counter.count


def test_fewer_kernel_calls_than_the_composition():
    lean_calls = _count(lambda x, q: lean.CayleyRotateFunction.apply(x, q, 8, 5, None))
    composed = _count(lambda x, q: reference.cayley_rotate(x, q, 8, terms=5))
    # 6 forward + 8 backward (module docstring), against ~35 composed (docs/benchmarks/oftv2_overhead.md).
    assert lean_calls <= 14, lean_calls
    assert composed >= 2 * lean_calls, (lean_calls, composed)


def test_compiles_fullgraph_and_equals_eager():
    x, q = _inputs(3, 4, 3, dtype=torch.float32)

    def fn(x_, q_):
        return ops.cayley_rotate(x_, q_, 4, cayley_impl="torch", rotate_impl="torch")

    y = fn(x, q)
    expected = _grads(y, (x, q), torch.ones_like(y))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y_c = compiled(x, q)
    torch.testing.assert_close(y_c, y)
    torch.testing.assert_close(_grads(y_c, (x, q), torch.ones_like(y)), expected)


def test_two_block_sizes_compile_in_one_graph():
    # The index tables were once constant results lifted as graph inputs under one name per function: a second block
    # size in the same graph made their sizes symbolic and fullgraph compilation failed (a Llama with r=8 has blocks
    # of 8 and 16). Built inline under compile, each block size's tables have static shapes.
    x4, q4 = _inputs(3, 4, 3, dtype=torch.float32)
    x8, q8 = _inputs(2, 8, 2, dtype=torch.float32, seed=1)

    def fn(x4_, q4_, x8_, q8_):
        return (lean.CayleyRotateFunction.apply(x4_, q4_, 4, 5, None).sum()
                + lean.CayleyRotateFunction.apply(x8_, q8_, 8, 5, None).sum())

    inputs = (x4, q4, x8, q8)
    expected_loss = fn(*inputs)
    expected = torch.autograd.grad(expected_loss, inputs)
    torch._dynamo.reset()
    loss = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
    torch.testing.assert_close(loss, expected_loss)
    for got, want in zip(torch.autograd.grad(loss, inputs), expected):
        torch.testing.assert_close(got, want)


def test_one_wide_blocks_are_the_identity_on_the_torch_path_as_on_auto():
    # A 1-wide block has no triangle entries: R = I. The torch path crashed in its gather tables before.
    x = torch.randn(2, 3)
    q = torch.zeros(3, 0)
    for impl in ("torch", "auto"):
        torch.testing.assert_close(ops.cayley_rotate(x, q, 1, cayley_impl=impl, rotate_impl=impl), x, rtol=0, atol=0)
