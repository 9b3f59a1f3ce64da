"""The Cayley–Neumann series of many layers in one batch, and the rotation of one layer by blocks computed elsewhere.

The torch path of an OFTv2 layer (:class:`~peftplug_kernels.cayley_rotate.function.CayleyRotateFunction`) computes
its rotation blocks ``R = I + 2 S`` from its own triangles on every forward: 6 kernel calls forward and 8 backward
per layer, of which only the rotation itself (``x R`` forward; ``g Rᵀ`` and ``xᵀ g`` backward) depends on the
layer's input. The series depends only on the parameters, so the series of every layer with the same block size
and series length can run as one batch at the start of the model's forward:

forward, once per model forward and group::

    cat of the triangles, skew gather and sign, 3 baddbmm (m = 4)     6 calls, for all layers of the group
    split into per-layer views                                       no call

per layer: ``x R`` and a layout copy forward, ``g Rᵀ``, ``xᵀ g`` and a copy backward (:func:`rotate_by`; for
half-precision ``x`` one call forward and two backward, in a Function that keeps ``x`` in its own dtype);

backward, once per group: autograd joins the layers' ``dL/dR`` (one cat, from ``split``'s backward), then the
series gradient and the triangle projection (6 calls) and the split of the triangles' gradients (views).

With L layers that is ``5 + 13 / L`` calls per layer where the per-layer path made 14 (LoRA r16: 10); what it buys
in time is measured in docs/benchmarks/oftv2_overhead.md. ``oftv2.stacking`` decides when a model uses it.
"""

from __future__ import annotations

import torch

from peftplug_kernels._function_guards import guarded_backward, guarded_forward
from peftplug_kernels.cayley_neumann.reference import triangle_size

from .function import (
    MAX_TERMS,
    _cast,
    _rotate,
    _rotation,
    _series_grad,
    compute_dtype,
    rotation_grad,
    skew_blocks,
    supports,
    triangle_grad,
)


class StackedRotationFunction(torch.autograd.Function):
    """``StackedRotationFunction.apply(block_size, terms, *q_vecs, keep)`` -> the rotation blocks of every layer.

    Args (of ``apply``):
        block_size: b, the same for every layer.
        terms: Taylor series length, 2 to ``function.MAX_TERMS``, the same for every layer.
        *q_vecs: Each layer's ``[n_i, b(b-1)/2]`` triangles (``n_i = 1`` for a block shared across a width; not with
            ``keep``), all of one floating dtype and device. The series runs in :func:`compute_dtype` of it (fp32 for
            half-precision triangles, as the per-layer path computes).
        keep: Last: ``None``, or a ``[Σ n_i, 1, 1]`` 0/1 block-dropout mask over the concatenated blocks (0 means
            ``R = I``), in the compute dtype. (After the triangles: dynamo, tracing this Function without
            grad, mis-binds a ``None`` placed before the variable arguments.)

    Returns:
        One ``[Σ n_i, b, b]`` tensor: :func:`stacked_rotations` splits it per layer (under autograd, so that the
        layers' gradients reach the backward joined in one call).
    """

    @staticmethod
    @guarded_forward
    def forward(ctx, block_size, terms, *tensors):
        *q_vecs, keep = tensors
        # Joined first, then cast once: half-precision triangles cost one cast for all layers, not one each.
        q_all = torch.cat(q_vecs) if len(q_vecs) > 1 else q_vecs[0]
        q = skew_blocks(_cast(q_all, compute_dtype(q_all.dtype)), block_size)
        r, saved = _rotation(q, terms - 1, keep)
        ctx.save_for_backward(q, keep, *saved)
        ctx.rows = [t.shape[0] for t in q_vecs]
        ctx.block_size, ctx.powers, ctx.q_dtype = block_size, terms - 1, q_vecs[0].dtype
        return r

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_r):
        q, keep, *saved = ctx.saved_tensors
        if keep is not None:
            grad_r = grad_r * keep
        # alpha=2: R = I + 2S.
        grad_q = _series_grad(grad_r, q, ctx.powers, saved, alpha=2.0)
        grad_q_all = _cast(triangle_grad(grad_q, ctx.block_size), ctx.q_dtype)
        grads = grad_q_all.split(ctx.rows) if len(ctx.rows) > 1 else (grad_q_all,)
        return (None, None, *(g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:])), None)


def stacked_rotations(
    q_vecs: list[torch.Tensor], block_size: int, terms: int, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """The rotation blocks ``R_i = I + 2 S(Q_i)`` of several layers, computed as one batch.

    Args:
        q_vecs: Each layer's ``[n_i, b(b-1)/2]`` triangles (one dtype and device).
        block_size: b.
        terms: Taylor series length, 2 to ``function.MAX_TERMS``.
        keep: ``None``, or a ``[Σ n_i, 1, 1]`` 0/1 block-dropout mask in :func:`compute_dtype` of the triangles'.

    Returns:
        ``R_i`` as ``[n_i, b, b]`` views of one tensor in :func:`compute_dtype` of the triangles', in the order of
        ``q_vecs``.

    Raises:
        ValueError: For no triangles, triangles of another width than ``b(b-1)/2`` or of mixed dtypes or devices,
            ``terms`` outside 2 to ``function.MAX_TERMS``, or a mask that does not cover the blocks.
    """
    if not supports("cayley_neumann", terms):
        raise ValueError(f"terms must be in [2, {MAX_TERMS}], got {terms}")
    width = triangle_size(block_size)
    if not q_vecs or any(t.dim() != 2 or t.shape[1] != width for t in q_vecs):
        shapes = [tuple(t.shape) for t in q_vecs]
        raise ValueError(f"q_vecs must be [n_i, {width}] triangles for block_size {block_size}, got {shapes}")
    if len({(t.dtype, t.device) for t in q_vecs}) > 1:
        raise ValueError("q_vecs must share one dtype and device (group them by both)")
    rows = sum(t.shape[0] for t in q_vecs)
    if keep is not None and tuple(keep.shape) != (rows, 1, 1):
        raise ValueError(f"keep must be [{rows}, 1, 1] (one 0/1 per block), got {tuple(keep.shape)}")
    r = StackedRotationFunction.apply(block_size, terms, *q_vecs, keep)
    return r.split([t.shape[0] for t in q_vecs]) if len(q_vecs) > 1 else (r,)


class RotateByFunction(torch.autograd.Function):
    """``RotateByFunction.apply(x, r)`` -> ``x R`` block-wise, in ``x``'s dtype, computed in ``r``'s.

    For an ``x`` of another dtype than the blocks (bf16 activations, fp32 blocks): it saves ``x`` in its own dtype
    and casts again in the backward, where plain autograd would keep the fp32 copy alive until the backward (twice
    a bf16 activation, for every adapted layer). One call forward, two backward (``g Rᵀ`` and ``xᵀ g``).

    Args (of ``apply``):
        x: ``[..., n_blocks · b]``.
        r: ``[n_blocks, b, b]`` blocks, or one ``[1, b, b]`` block shared across the width.
    """

    @staticmethod
    @guarded_forward
    def forward(ctx, x, r):
        n_blocks = x.shape[-1] // r.shape[-1]
        ctx.save_for_backward(x, r)
        ctx.n_blocks = n_blocks
        return _rotate(_cast(x, r.dtype), r, n_blocks, x.dtype)

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_out):
        x, r = ctx.saved_tensors
        g = _cast(grad_out, r.dtype)
        grad_x = grad_r = None
        if ctx.needs_input_grad[0]:
            grad_x = _rotate(g, r.transpose(-1, -2), ctx.n_blocks, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_r = rotation_grad(_cast(x, r.dtype), g, r, ctx.n_blocks, alpha=1.0)
        return grad_x, grad_r


def rotate_by(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x R`` block-wise with precomputed blocks, in ``x``'s dtype, computed in ``r``'s (gradients reach both).

    With ``x`` in the blocks' dtype, plain ops under autograd: one ``bmm`` and a layout copy forward, two ``bmm`` and
    a copy backward, all with C++ backward nodes. The hand-written :class:`RotateByFunction` makes one call fewer
    each way but runs its forward and backward in Python: on the overhead benchmark (8 layers, width 64, eager, fp32)
    a layer took 573 µs with it and 481 µs without (LoRA r16: 399). With ``x`` in another dtype the Function runs, for
    the memory it saves (see there), and under autocast.

    Args:
        x: ``[..., n_blocks · b]``.
        r: ``[n_blocks, b, b]`` or a shared ``[1, b, b]``.

    Raises:
        ValueError: When the blocks do not tile the width.
    """
    rows, block = r.shape[0], r.shape[-1]
    width = x.shape[-1]
    # No ``rows not in (1, width // block)``: dynamo evaluates ``in`` with a symbolic width as False (ops.py).
    if r.dim() != 3 or width % block or (rows != 1 and rows != width // block):
        raise ValueError(f"rotation {tuple(r.shape)} does not tile input width {width}")
    # Under autocast the plain products would run in its dtype: the Function keeps the blocks' (_function_guards.py).
    if x.dtype != r.dtype or torch.is_autocast_enabled(x.device.type):
        return RotateByFunction.apply(x, r)
    if rows == 1:  # one block for the whole width: a single 2-D product
        return torch.mm(x.reshape(-1, block), r[0]).reshape(x.shape)
    return torch.bmm(x.reshape(-1, rows, block).transpose(0, 1), r).transpose(0, 1).reshape(x.shape)
