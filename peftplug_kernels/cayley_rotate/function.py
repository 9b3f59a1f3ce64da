"""Cayley–Neumann rotation and block rotation in one autograd Function: the torch path of an OFTv2 layer, in few ops.

An OFTv2 layer computes, on every forward, ``x' = x R`` with ``R = I + 2 S`` and ``S = Q + Q² + … + Q^m`` (the
Taylor form with ``terms = m + 1``) from the strict upper triangles ``q`` of the skew blocks ``Q``. Composed from
the two reference functions (``cayley_neumann/reference.py``, ``block_rotate/reference.py``) under autograd that is
14 kernel calls forward and ~23 backward per layer (docs/benchmarks/oftv2_overhead.md): index_put for the skew
matrix, an identity, one ``bmm`` and one ``add`` per power, the rotation and a copy, then autograd's backward of
each. Here the same mathematics runs in the fewest calls we found, with a hand-written backward:

forward (m = 4, the default ``neumann_terms=5``)::

    Q = q[:, gather] · sign     index_select and mul with constant tables (the skew matrix, exact)
    A = Q + Q·Q                 baddbmm
    B = I + Q·Q                 baddbmm       (symmetric: (Q²)ᵀ = (Qᵀ)² = Q²; under torch.compile one bmm forms Q·Q
                                               for both, and the sums fuse into a generated kernel)
    R = I + 2 A·B               baddbmm       (A·B = Q + Q² + Q³ + Q⁴ = S)
    x' = x R                    bmm, written straight into token-major layout (no copy)

backward, with ``Qᵀ = -Q``::

    gx = g Rᵀ                   bmm (token-major output again)
    G  = 2 xᵀ g                 baddbmm (beta=0)  (dL/dS)
    gA = G Bᵀ ; H = gA + Aᵀ G   bmm, baddbmm  (H = gA + gB)
    gQ = gA - H Q - Q H         two baddbmm
    gq = (gQ - gQᵀ)[triu]       sub and index_select

That is 6 calls forward and 8 backward for the adapter, where the composed references made ~35 (the base layer
adds its own); LoRA r16 adds 10 (docs/benchmarks/oftv2_overhead.md has the counts). A dense ±1 matrix would unpack
in one mm and pack in one, but it costs b⁴/2 multiply-adds per block (16× a power of Q at b = 32): measured slower.
Fewer powers (``terms`` 2–4) build ``S`` in 0–2 calls, then ``R = I + 2 S`` in one. Block dropout multiplies ``S``
(for m = 4: ``A``) by a keep mask (a dropped block has ``S = 0``, i.e. ``R = I``). Half-precision inputs are rotated in fp32 and rounded once, as the
reference and the Triton kernel do.

Only the Taylor form with 2–5 terms has a program here (:func:`supports`); the exact Cayley map, PEFT's product form
and longer series run the composition of the references (``peftplug_kernels.cayley_rotate.reference``).
"""

from __future__ import annotations

import functools

import torch

from peftplug_kernels._function_guards import guarded_backward, guarded_forward

#: Highest number of series terms (``neumann_terms``) with a program here: powers up to Q⁴.
MAX_TERMS = 5


def supports(form: str, terms: int) -> bool:
    """Whether :class:`CayleyRotateFunction` computes this form and series length.

    Args:
        form: ``"cayley_neumann"``, ``"cayley"`` or ``"peft_cn"``.
        terms: Series length n (highest power n - 1).
    """
    return form == "cayley_neumann" and 2 <= terms <= MAX_TERMS


# The index and sign tables below are cached per block size and device in eager mode (building them is a measurable
# share of a small layer's step on CPU). Under torch.compile they are built inline instead, and Inductor folds them
# (the compiled overhead stack's kernel calls per layer moved 14.62 -> 14.75 with this change). Marked as constant
# results, as before, dynamo lifted them as graph inputs under one name per function, and a second block size in the
# same graph made their sizes symbolic: fullgraph failed for models whose layers differ in block size.


def skew_gather(block_size: int, device: torch.device) -> torch.Tensor:
    """Index ``[b·b]`` into a triangle vector for every entry of the flattened skew matrix (0 on the diagonal).

    ``vec(Q) = q[:, skew_gather(b)] · skew_sign(b)``: one gather and one multiply, where a zero fill, an index_put and
    a subtraction (and their backward) ran before.

    Args:
        block_size: b.
        device: Where the index lives.
    """
    if torch.compiler.is_compiling():
        return _build_skew_tables(block_size, device)[0]
    return _skew_tables(block_size, device)[0]


def skew_sign(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[b·b]`` signs of :func:`skew_gather`'s entries: +1 above the diagonal, -1 below, 0 on it.

    Args:
        block_size: b.
        device: Where the signs live.
        dtype: Their dtype (that of the triangles).
    """
    if torch.compiler.is_compiling():
        return _build_skew_sign(block_size, device, dtype)
    return _skew_sign(block_size, device, dtype)


def triangle_positions(block_size: int, device: torch.device) -> torch.Tensor:
    """Flat positions ``i·b + j`` of the strict upper triangle, in ``triu_indices`` order (packs a gradient).

    Args:
        block_size: b.
        device: Where the index lives.
    """
    if torch.compiler.is_compiling():
        return _build_skew_tables(block_size, device)[1]
    return _skew_tables(block_size, device)[1]


def identity(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``b × b`` identity (cached in eager mode: one fewer kernel call per layer and forward than ``torch.eye``).

    Args:
        block_size: b.
        device: Where it lives.
        dtype: Its dtype.
    """
    if torch.compiler.is_compiling():
        return torch.eye(block_size, dtype=dtype, device=device)
    return _identity(block_size, device, dtype)


# Cached tables are built outside inference mode: an inference tensor in the cache could not be saved for a later
# backward.
@functools.lru_cache(maxsize=32)
def _identity(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.eye(block_size, dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def _skew_tables(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):
        return _build_skew_tables(block_size, device)


@functools.lru_cache(maxsize=32)
def _skew_sign(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):
        return _build_skew_sign(block_size, device, dtype)


def _build_skew_tables(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(block_size, block_size, 1, device=device)
    t = torch.arange(rows.numel(), device=device)
    gather = torch.zeros(block_size * block_size, dtype=torch.long, device=device)
    gather[rows * block_size + cols] = t
    gather[cols * block_size + rows] = t
    return gather, rows * block_size + cols


def _build_skew_sign(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = torch.triu_indices(block_size, block_size, 1, device=device)
    sign = torch.zeros(block_size * block_size, dtype=dtype, device=device)
    sign[rows * block_size + cols] = 1.0
    sign[cols * block_size + rows] = -1.0
    return sign


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the series runs in for triangles of ``dtype``: fp32 for fp16/bf16, else ``dtype`` itself.

    Args:
        dtype: The triangles' dtype.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def skew_blocks(q_vec: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[n, b(b-1)/2]`` triangles -> ``[n, b, b]`` skew-symmetric blocks: one gather and one multiply.

    Args:
        q_vec: The triangles, in the dtype the series runs in.
        block_size: b.
    """
    q = torch.index_select(q_vec, 1, skew_gather(block_size, q_vec.device))
    return (q * skew_sign(block_size, q_vec.device, q_vec.dtype)).view(-1, block_size, block_size)


def triangle_grad(grad_q: torch.Tensor, block_size: int) -> torch.Tensor:
    """dL/dq of :func:`skew_blocks` from dL/dQ ``[n, b, b]``: at (i, j), dL/dQ[i, j] - dL/dQ[j, i].

    Args:
        grad_q: Gradient of the skew blocks.
        block_size: b.
    """
    skew_grad = torch.sub(grad_q, grad_q.transpose(-1, -2)).view(grad_q.shape[0], -1)
    return torch.index_select(skew_grad, 1, triangle_positions(block_size, grad_q.device))


def _series(q: torch.Tensor, powers: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``S = Q + … + Q^powers`` for ``[n, b, b]`` blocks and ``powers`` 1 to 3, and what :func:`_series_grad` needs
    (:func:`_rotation` builds ``powers = 4`` into ``R`` directly)."""
    if powers == 1:
        return q, ()
    a = torch.baddbmm(q, q, q)  # Q + Q²
    if powers == 2:
        return a, ()
    return torch.baddbmm(q, q, a), (a,)  # Q + Q(Q + Q²)


def _series_grad(
    g: torch.Tensor, q: torch.Tensor, powers: int, saved: tuple[torch.Tensor, ...], alpha: float
) -> torch.Tensor:
    """dL/dQ from dL/dS for :func:`_series`, using ``Qᵀ = -Q`` (the caller projects it onto the triangle).

    ``alpha`` scales ``g`` first (``R = I + 2S`` gives ``dL/dS = 2 dL/dR``); for the default series it rides on the
    first two products (no extra call). ``alpha`` has no default, nor has :func:`rotation_grad`'s: under
    ``torch.compile(dynamic=True)`` dynamo turns a float default into a symbolic input, and with two layers in one
    graph the second backward then failed to trace ("lift_tracked_freevar_to_input should not be called on root
    SubgraphTracer"); a literal at the call site stays a constant."""
    if powers != 4 and alpha != 1.0:
        g = g * alpha
    if powers == 1:
        return g
    if powers == 2:  # S = Q + QQ: gQ = G + G Qᵀ + Qᵀ G
        return torch.baddbmm(torch.baddbmm(g, g, q, alpha=-1), q, g, alpha=-1)
    if powers == 3:  # S = Q + Q A, A = Q + QQ
        (a,) = saved
        grad_a = torch.baddbmm(g, q, g, beta=0, alpha=-1)  # Qᵀ G
        grad_q = torch.baddbmm(g + grad_a, g, a.transpose(-1, -2))
        return torch.baddbmm(torch.baddbmm(grad_q, grad_a, q, alpha=-1), q, grad_a, alpha=-1)
    a, b = saved  # S = A B, A = Q + QQ, B = I + QQ
    grad_a = torch.baddbmm(g, g, b.transpose(-1, -2), beta=0, alpha=alpha) if alpha != 1.0 else torch.bmm(g, b.mT)
    h = torch.baddbmm(grad_a, a.transpose(-1, -2), g, alpha=alpha)  # gA + gB
    return torch.baddbmm(torch.baddbmm(grad_a, h, q, alpha=-1), q, h, alpha=-1)


def _rotation(q: torch.Tensor, powers: int, keep: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``R = I + 2 S`` (``S`` masked by ``keep``) for ``[n, b, b]`` blocks, and what :func:`_series_grad` needs.

    For the default series (``powers = 4``) the identity and the factor 2 ride on the last product
    (``R = I + 2 A B``): one call, where ``S`` and then ``x + 2 x S`` took a product and a copy more.

    ``A`` and ``B`` share ``Q²``. Eager, each is one ``baddbmm`` (2 calls; forming ``Q²`` once would take 3). Under
    ``torch.compile`` ``Q²`` is formed once and Inductor fuses the two sums into a kernel it generates anyway: one
    b × b product and one call fewer per layer and forward (docs/benchmarks/oftv2_overhead.md, run ``amx-q2once``)."""
    ident = identity(q.shape[-1], q.device, q.dtype)  # broadcasts over the blocks
    if powers == 4:
        if torch.compiler.is_compiling():
            q2 = torch.bmm(q, q)
            a, b = q + q2, ident + q2  # Q + Q², I + Q²
        else:
            a = torch.baddbmm(q, q, q)  # Q + Q²
            b = torch.baddbmm(ident, q, q)  # I + Q²
        if keep is None:
            return torch.baddbmm(ident, a, b, alpha=2), (a, b)
        # (A B)·keep = (A·keep) B: keep is one 0/1 scalar per block (per position for a shared block: expand B).
        a_kept = a * keep
        return torch.baddbmm(ident, a_kept, b.expand(a_kept.shape), alpha=2), (a, b)
    s, saved = _series(q, powers)
    return torch.add(ident, s if keep is None else s * keep, alpha=2), saved


def _blocks_first(t: torch.Tensor, n_blocks: int, block_size: int, tokens_last: bool = False) -> torch.Tensor:
    """``[..., n·b]`` -> ``[n, tokens, b]`` (``[n, b, tokens]`` with ``tokens_last``), a view.

    One ``as_strided`` for a contiguous ``t`` in eager mode, where a reshape and a transpose make two dispatcher calls
    (each about as costly as a small kernel's launch on the CPU side; 4 such views ran per layer and step). Only
    inside the Functions below, which run without autograd: an ``as_strided`` under autograd has a costly backward.
    """
    if t.is_contiguous() and not torch.compiler.is_compiling():
        tokens = t.numel() // (n_blocks * block_size)
        if tokens_last:
            return t.as_strided((n_blocks, block_size, tokens), (block_size, 1, n_blocks * block_size))
        return t.as_strided((n_blocks, tokens, block_size), (block_size, n_blocks * block_size, 1))
    blocks = t.reshape(-1, n_blocks, block_size)
    return blocks.permute(1, 2, 0) if tokens_last else blocks.transpose(0, 1)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A no-op ``Tensor.to`` still costs a dispatcher call; every forward of every layer makes several.
    return t if t.dtype == dtype else t.to(dtype)


def _rotate(x: torch.Tensor, r: torch.Tensor, n_blocks: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``x R`` block-wise, returned in ``out_dtype`` (``x`` in its compute dtype; ``r`` ``[n, b, b]`` or one shared
    ``[1, b, b]``).

    The blocks-first product is written straight into a token-major tensor (``bmm``'s ``out`` is a transposed view,
    which BLAS takes as its output's leading dimension): no layout copy. Under ``torch.compile`` the functional form
    runs instead (dynamo wants no ``out=`` into views; Inductor plans the layout itself)."""
    block = r.shape[-1]
    if r.shape[0] == 1:  # one block for the whole width: a single 2-D product
        return _cast(torch.mm(x.reshape(-1, block), r[0]).reshape(x.shape), out_dtype)
    xb = _blocks_first(x, n_blocks, block)
    if torch.compiler.is_compiling():
        return _cast(torch.bmm(xb, r).transpose(0, 1).reshape(x.shape), out_dtype)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (half the CPU time of torch.empty(shape))
    torch.bmm(xb, r, out=_blocks_first(out, n_blocks, block))
    return _cast(out, out_dtype)


def rotation_grad(x: torch.Tensor, g: torch.Tensor, r: torch.Tensor, n_blocks: int, alpha: float) -> torch.Tensor:
    """``alpha · dL/dR`` of ``x R`` block-wise: ``alpha Σ_tokens x_blkᵀ g_blk`` in one call, ``[n, b, b]`` (``[1, b, b]``
    summed over the width for a shared block ``r``).

    Args:
        x: ``[..., n_blocks · b]`` input, in ``r``'s dtype.
        g: Gradient of the output, same shape and dtype.
        r: The rotation blocks (only their shape, dtype and device are read: ``beta=0``).
        n_blocks: Blocks across the width.
        alpha: Scale folded into the product (required: see :func:`_series_grad`).
    """
    block = r.shape[-1]
    if r.shape[0] == 1:
        return torch.addmm(r[0], x.reshape(-1, block).t(), g.reshape(-1, block), beta=0, alpha=alpha).unsqueeze(0)
    x_t = _blocks_first(x, n_blocks, block, tokens_last=True)  # [n, b, tokens]
    return torch.baddbmm(r, x_t, _blocks_first(g, n_blocks, block), beta=0, alpha=alpha)


class CayleyRotateFunction(torch.autograd.Function):
    """``CayleyRotateFunction.apply(x, q_vec, block_size, terms, keep)`` -> ``x R`` with ``R`` from ``q_vec``.

    Args (of ``apply``):
        x: ``[..., n_blocks · b]`` input.
        q_vec: ``[n_blocks, b(b-1)/2]`` triangles, or ``[1, b(b-1)/2]`` for one block shared across the width; fp32
            or fp64 (the caller casts half-precision parameters). The series and the rotation run in this dtype
            (promoted to fp64 for an fp64 ``x``).
        block_size: b.
        terms: Taylor series length, 2 to :data:`MAX_TERMS`.
        keep: ``None``, or a ``[n_blocks, 1, 1]`` 0/1 mask in ``q_vec``'s dtype (block dropout: 0 means ``R = I``).

    Returns:
        The rotated input, in ``x``'s dtype.
    """

    @staticmethod
    @guarded_forward
    def forward(ctx, x, q_vec, block_size, terms, keep):
        n_blocks = x.shape[-1] // block_size
        # The triangles' dtype (fp32 for half-precision layers), or fp64 when x is: as the references compute.
        # (Chosen in Python: torch.promote_types is a dispatcher call, on every forward of every layer.)
        compute = torch.float64 if torch.float64 in (q_vec.dtype, x.dtype) else q_vec.dtype
        ctx.q_dtype = q_vec.dtype
        q = skew_blocks(_cast(q_vec, compute), block_size)
        r, saved = _rotation(q, terms - 1, keep)
        out = _rotate(_cast(x, compute), r, n_blocks, x.dtype)
        ctx.save_for_backward(x, q, r, keep, *saved)
        ctx.n_blocks, ctx.block_size, ctx.powers = n_blocks, block_size, terms - 1
        return out

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_out):
        x, q, r, keep, *saved = ctx.saved_tensors
        n_blocks, block = ctx.n_blocks, ctx.block_size
        compute = q.dtype
        g = _cast(grad_out, compute)
        grad_x = grad_q_vec = None
        if ctx.needs_input_grad[0]:
            grad_x = _rotate(g, r.transpose(-1, -2), n_blocks, x.dtype)  # g Rᵀ
        if ctx.needs_input_grad[1]:
            # alpha=2: the factor of R = I + 2S.
            grad_s = rotation_grad(_cast(x, compute), g, r, n_blocks, alpha=2)
            if keep is not None:
                grad_s = grad_s * keep
                if q.shape[0] == 1:  # a shared block dropped per position: its gradient sums over positions
                    grad_s = grad_s.sum(0, keepdim=True)
            grad_q = _series_grad(grad_s, q, ctx.powers, saved, alpha=1.0)  # (alpha=2 rode on grad_s)
            grad_q_vec = _cast(triangle_grad(grad_q, block), ctx.q_dtype)
        return grad_x, grad_q_vec, None, None, None
