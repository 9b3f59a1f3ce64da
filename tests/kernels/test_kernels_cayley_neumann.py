"""cayley_neumann: Triton kernel (interpreter on CPU) vs the pure-torch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann import reference

pytestmark = pytest.mark.usefixtures("needs_triton")


@pytest.mark.parametrize("form", ["cayley_neumann", "peft_cn"])
@pytest.mark.parametrize(("b", "n_blocks", "terms"), [(2, 1, 5), (12, 3, 5), (32, 2, 6), (16, 1, 1), (24, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_and_backward_match_reference(device, close, form, b, n_blocks, terms, dtype):
    torch.manual_seed(b + terms)
    q = (0.3 / b**0.5 * torch.randn(n_blocks, reference.triangle_size(b), device=device)).to(dtype)
    q.requires_grad_(True)
    grad = torch.randn(n_blocks, b, b, device=device, dtype=dtype)

    rot = ops.cayley_neumann(q, b, terms=terms, form=form, impl="triton")
    assert rot.dtype == dtype and rot.shape == (n_blocks, b, b)
    rot.backward(grad)
    gq = q.grad.clone()
    q.grad = None

    # Oracle in fp32 (the kernel computes in fp32 whatever the storage dtype).
    q32 = q.detach().float().requires_grad_(True)
    expected = reference.cayley_neumann(q32, b, terms=terms, form=form)
    close(rot, expected, dtype, "R")
    if terms == 1:  # R = I does not depend on Q
        assert not gq.any()
        return
    expected.backward(grad.float())
    close(gq, q32.grad, dtype, "dq")


def test_zero_triangle_gives_identity(device):
    rot = ops.cayley_neumann(torch.zeros(3, reference.triangle_size(12), device=device), 12, impl="triton")
    assert torch.equal(rot, torch.eye(12, device=device).expand(3, 12, 12))


def test_taylor_form_is_nearly_orthogonal(device):
    q = 0.02 * torch.randn(4, reference.triangle_size(32), device=device)
    rot = ops.cayley_neumann(q, 32, terms=5, impl="triton")
    eye = torch.eye(32, device=device)
    assert (rot @ rot.transpose(-1, -2) - eye).abs().max() < 1e-4


def test_exact_form_has_no_kernel():
    with pytest.raises(ValueError, match="Triton Cayley-Neumann kernel supports"):
        ops.cayley_neumann(torch.zeros(1, 6), 4, form="cayley", impl="triton")
    # "auto" quietly uses the reference for the exact form.
    assert torch.equal(ops.cayley_neumann(torch.zeros(1, 6), 4, form="cayley"), torch.eye(4)[None])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"form": "taylor"}, "form must be one of"), ({"terms": 0}, "terms must be >= 1"), ({"impl": "cuda"}, "impl")],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.cayley_neumann(torch.zeros(2, 6), 4, **kwargs)


def test_triangle_length_checked():
    with pytest.raises(ValueError, match=r"\[n_blocks, 6\]"):
        ops.cayley_neumann(torch.zeros(2, 5), 4, impl="torch")


def test_training_after_a_first_call_in_inference_mode():
    # The triangle indices are cached; a cache filled under inference_mode must not hold inference tensors, which
    # autograd refuses to save (validate-then-fit in Lightning does exactly this).
    reference._triu_indices.cache_clear()
    q = (0.1 * torch.randn(2, reference.triangle_size(8))).requires_grad_(True)
    with torch.inference_mode():
        reference.cayley_neumann(q.detach(), 8)
    reference.cayley_neumann(q, 8).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_reference_works_under_vmap():
    q = 0.1 * torch.randn(3, 2, reference.triangle_size(8))
    batched = torch.func.vmap(lambda v: reference.cayley_neumann(v, 8))(q)
    torch.testing.assert_close(batched, torch.stack([reference.cayley_neumann(v, 8) for v in q]))
