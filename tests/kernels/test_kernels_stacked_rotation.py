"""cayley_rotate.stacked: the series of several layers as one batch, then each layer's rotation by its slice, against
the reference composition per layer (fp64, to rounding), with gradients, block dropout and a shared block."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels.cayley_neumann.reference import triangle_size
from peftplug_kernels.cayley_rotate import reference
from peftplug_kernels.cayley_rotate.stacked import rotate_by, stacked_rotations

B = 4
# Blocks per layer; 0 stands for one block shared across a width of 3 blocks.
LAYERS = (3, 0, 2)


def _layers(seed: int, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    qs, xs = [], []
    for n in LAYERS:
        rows = 1 if n == 0 else n
        q = 0.3 / B**0.5 * torch.randn(rows, triangle_size(B), generator=gen, dtype=dtype)
        qs.append(q.to(device).requires_grad_())
        xs.append(torch.randn(2, 5, (n or 3) * B, generator=gen, dtype=dtype).to(device).requires_grad_())
    return qs, xs


@pytest.mark.parametrize("terms", [2, 3, 4, 5])
def test_matches_per_layer_reference_fp64(device, terms):
    # `device`: CPU here, CUDA in the GPU run (PEFTPLUG_KERNELS_ON_GPU=1), before its step benchmark times this path.
    qs, xs = _layers(terms, device=device)
    outs = [rotate_by(x, r) for x, r in zip(xs, stacked_rotations(qs, B, terms))]
    want = [reference.cayley_rotate(x, q, B, terms=terms) for x, q in zip(xs, qs)]
    for got, expected in zip(outs, want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    weights = [torch.randn_like(o) for o in outs]
    inputs = qs + xs
    got_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs)
    want_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), inputs)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_block_dropout_matches_reference_and_gradcheck():
    gen = torch.Generator().manual_seed(0)
    qs = [(0.1 * torch.randn(n, triangle_size(B), generator=gen, dtype=torch.float64)).requires_grad_() for n in (3, 2)]
    xs = [torch.randn(4, n * B, generator=gen, dtype=torch.float64) for n in (3, 2)]
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64).view(-1, 1, 1)

    def stacked(*q):
        return tuple(rotate_by(x, r) for x, r in zip(xs, stacked_rotations(list(q), B, 5, keep)))

    per_layer = [reference.cayley_rotate(x, q, B, terms=5, keep=k) for x, q, k in zip(xs, qs, keep.split([3, 2]))]
    for got, expected in zip(stacked(*qs), per_layer):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(stacked, tuple(qs))


def test_unused_layer_gets_no_gradient_and_others_are_right():
    qs, xs = _layers(7)
    rotations = stacked_rotations(qs, B, 5)
    loss = rotate_by(xs[0], rotations[0]).square().sum()  # layers 1 and 2 never use their blocks
    grads = torch.autograd.grad(loss, qs, allow_unused=True)
    want = torch.autograd.grad(reference.cayley_rotate(xs[0], qs[0], B, terms=5).square().sum(), qs[0])[0]
    torch.testing.assert_close(grads[0], want, rtol=1e-10, atol=1e-12)
    assert all(g is None or not g.any() for g in grads[1:])


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_rotate_by_computes_in_the_blocks_dtype(x_dtype):
    qs, _ = _layers(3, dtype=torch.float32)
    r = stacked_rotations(qs[:1], B, 5)[0]
    x = torch.randn(6, 3 * B).to(x_dtype)
    got = rotate_by(x, r)
    assert got.dtype == x_dtype
    want = reference.cayley_rotate(x.float(), qs[0], B, terms=5)
    # Rotated in fp32 and rounded once: within fp32 rounding of the fp32 result, then one rounding to x's dtype.
    rtol = 1e-5 if x_dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=1e-6)


def test_rotate_by_gradcheck_shared_block():
    x = torch.randn(3, 2 * B, dtype=torch.float64, requires_grad=True)
    r = torch.randn(1, B, B, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(rotate_by, (x, r))


def test_rotate_by_rejects_blocks_that_do_not_tile_the_width():
    with pytest.raises(ValueError, match="does not tile input width 10"):
        rotate_by(torch.randn(2, 10), torch.eye(4).expand(2, 4, 4))


def test_half_precision_input_is_saved_in_its_own_dtype(device):
    # bf16 activations with fp32 blocks: what autograd keeps for the backward is x itself, not an fp32 copy (twice
    # the bytes, for every adapted layer); the gradients are those of the fp32 computation, rounded once.
    x = torch.randn(6, 3 * B).to(device, torch.bfloat16).requires_grad_()
    layers = _layers(5, dtype=torch.float32, device=device)[0][:1]
    r = stacked_rotations(layers, B, 5)[0].detach().requires_grad_()  # 3 blocks
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = rotate_by(x, r)
    assert y.dtype == torch.bfloat16
    assert not any(t.dtype == torch.float32 and t.numel() == x.numel() for t in saved)  # in any layout
    grad = torch.randn_like(y)
    gx, gr = torch.autograd.grad(y, (x, r), grad)
    x32 = x.detach().float().requires_grad_()
    r32 = r.detach().requires_grad_()
    want_gx, want_gr = torch.autograd.grad(rotate_by(x32, r32), (x32, r32), grad.float())
    torch.testing.assert_close(gx.float(), want_gx, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(gr, want_gr, rtol=1e-5, atol=1e-6)


def test_stacked_rotations_refuse_bad_input():
    qs, _ = _layers(0)
    with pytest.raises(ValueError, match=r"terms must be in \[2, 5\], got 6"):
        stacked_rotations(qs, B, 6)
    with pytest.raises(ValueError, match=r"q_vecs must be \[n_i, 10\] triangles for block_size 5, got \[\(3, 6\)"):
        stacked_rotations(qs, 5, 5)
    with pytest.raises(ValueError, match="one dtype and device"):
        stacked_rotations([qs[0], qs[1].float()], B, 5)
    with pytest.raises(ValueError, match=r"keep must be \[6, 1, 1\]"):
        stacked_rotations(qs, B, 5, keep=torch.ones(3, 1, 1, dtype=torch.float64))
