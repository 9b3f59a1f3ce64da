"""Triton kernels for the block-diagonal rotation x' = x R and its backward, at memory speed.

Three kernels:
    ``_block_mm_kernel``   C[:, blk] = A[:, blk] @ M_blk — forward (M = R) and dX (M = Rᵀ via swapped strides);
    ``_block_atb_kernel``  dR_blk = Σ_t A[t, blk]ᵀ B[t, blk] over one chunk of tokens (chunks summed after);
    ``_block_bwd_kernel``  both at once for blocks ≤ 64: reads x and dX' once, writes dX and a partial dR.
All three are memory-bound (a 32-wide block does 64 FLOPs per element moved): at 4096 × 4096 bf16 the forward
moves 64 MiB (x in, x' out; 14 µs at an H200's 4.8 TB/s) and the fused backward 96 MiB (x, dX' in, dX out;
21 µs) plus the fp32 dR. So the tiles are sized for bytes in flight, not for FLOPs: ``BLOCK_T`` grows as the
block shrinks (:func:`token_tile`), and dR is reduced over token chunks in parallel
(the first version reduced all tokens serially in ``r`` programs: 64 steps each at 4096 tokens).
Inputs may be fp16/bf16/fp32; tiles are cast to fp32 before ``tl.dot`` (the accumulate precision we want, and
bf16 ``tl.dot`` is wrong in the interpreter). Import this module only through
:func:`peftplug_kernels._triton_available.load_kernel_module`, after ``TRITON_INTERPRET`` has its final value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels._tiles import block_tile, dot_precision, next_pow2


@triton.jit
def _block_mm_kernel(
    a_ptr, m_ptr, c_ptr, T, B, n_tiles_n,
    stride_at, stride_mb, stride_mk, stride_mn, stride_ct,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bn = tl.program_id(1)
    blk = pid_bn // n_tiles_n
    n0 = (pid_bn % n_tiles_n) * BLOCK_N
    # int64 rows: tokens × width can exceed 2³¹ elements (e.g. 256k tokens × 14336), where int32 offsets wrap.
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, B, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_at + (blk * B + ks)[None, :],
                    mask=row_ok[:, None] & (ks < B)[None, :], other=0.0)
        m = tl.load(m_ptr + blk * stride_mb + ks[:, None] * stride_mk + cols[None, :] * stride_mn,
                    mask=(ks < B)[:, None] & (cols < B)[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), m.to(tl.float32), input_precision=PRECISION)
    tl.store(c_ptr + rows[:, None] * stride_ct + (blk * B + cols)[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < B)[None, :])


@triton.jit
def _block_atb_kernel(
    a_ptr, b_ptr, out_ptr, T, B, R, n_tiles, tokens_per_chunk,
    stride_at, stride_bt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    blk = pid // (n_tiles * n_tiles)
    rest = pid % (n_tiles * n_tiles)
    ms = (rest // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (rest % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    t_begin = chunk * tokens_per_chunk
    for t0 in range(t_begin, t_begin + tokens_per_chunk, BLOCK_T):
        ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)  # int64 offsets, as in _block_mm_kernel
        t_ok = ts < T
        # A tile loaded transposed: [BLOCK_M, BLOCK_T].
        a_t = tl.load(a_ptr + ts[None, :] * stride_at + (blk * B + ms)[:, None],
                      mask=t_ok[None, :] & (ms < B)[:, None], other=0.0)
        b = tl.load(b_ptr + ts[:, None] * stride_bt + (blk * B + ns)[None, :],
                    mask=t_ok[:, None] & (ns < B)[None, :], other=0.0)
        acc += tl.dot(a_t.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    tl.store(out_ptr + (chunk * R + blk) * B * B + ms[:, None] * B + ns[None, :], acc,
             mask=(ms < B)[:, None] & (ns < B)[None, :])


@triton.jit
def _block_bwd_kernel(
    x_ptr, g_ptr, m_ptr, dx_ptr, dr_ptr, T, B, R, tokens_per_chunk,
    stride_t, stride_mb, HAS_DX: tl.constexpr, HAS_DR: tl.constexpr,
    BLOCK_T: tl.constexpr, BB: tl.constexpr, PRECISION: tl.constexpr,
):
    blk = tl.program_id(0)
    chunk = tl.program_id(1)
    kk = tl.arange(0, BB)
    k_ok = kk < B
    cols = blk * B + kk
    if HAS_DX:  # Rᵀ of this block, loaded once: m[i, j] = R[j, i]
        rt = tl.load(m_ptr + blk * stride_mb + kk[None, :] * B + kk[:, None], mask=k_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
    acc = tl.full((BB, BB), 0.0, tl.float32)
    t_begin = chunk * tokens_per_chunk
    for t0 in range(t_begin, t_begin + tokens_per_chunk, BLOCK_T):
        ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask = (ts < T)[:, None] & k_ok[None, :]
        offs = ts[:, None] * stride_t + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DX:
            dx = tl.dot(g, rt, input_precision=PRECISION)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DR:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            acc += tl.dot(tl.trans(x), g, input_precision=PRECISION)
    if HAS_DR:
        tl.store(dr_ptr + (chunk * R + blk) * B * B + kk[:, None] * B + kk[None, :], acc,
                 mask=k_ok[:, None] & k_ok[None, :])


# True when the kernels above were decorated in interpreter mode (TRITON_INTERPRET=1 at import).
INTERPRETED = type(_block_mm_kernel).__name__ == "InterpretedFunction"
# Elements of a [BLOCK_T, tile] slab per program on GPU (bf16: 32 KiB in and out), and the chunk of tokens one
# dR program reduces; untimed until benchmarks/kernels/rotate_sweep.py runs on a GPU.
GPU_SLAB = 8192
TOKENS_PER_CHUNK = 512
INTERPRETER_TOKENS_PER_CHUNK = 1 << 20


def token_tile(tokens: int, tile: int, slab: int = GPU_SLAB, itemsize: int = 2) -> int:
    """Tokens per program for a ``tile``-wide block tile: ``slab / tile`` on GPU (256 at b = 32 in bf16).

    The interpreter pays per program and per loop iteration, not per element: the biggest tiles there.

    Args:
        tokens: Rows of the input.
        tile: Block tile edge (power of two ≥ 16).
        slab: Elements per program; the fused backward holds x, dX' and dX tiles, so it takes half.
        itemsize: Bytes per input element: fp32 (exact FMA dots, no tensor cores) takes half the tokens; the
            sm_90 compile check then finds ≤ 56 B of spills per thread instead of up to 2.4 KB.
    """
    if INTERPRETED:
        return min(256, max(16, next_pow2(tokens)))
    return max(16, min(slab * 2 // max(2, itemsize) // tile, next_pow2(tokens)))


def _as_blocks(x2: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A shared ``[1, b, b]`` rotation is one block over a ``[tokens * r, b]`` view: same math, one code path."""
    b = rotation.shape[-1]
    if rotation.shape[0] == 1 and x2.shape[1] != b:
        return x2.reshape(-1, b), 1
    return x2, rotation.shape[0]


def block_matmul(x2: torch.Tensor, rotation: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``out[:, blk] = x2[:, blk] @ R_blk`` (or ``@ R_blkᵀ`` with ``transpose``), fp32 accumulate.

    Args:
        x2: ``[tokens, n_blocks * b]`` contiguous input.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` contiguous blocks.
        transpose: Multiply by each block's transpose (the backward dX = dX' Rᵀ).

    Returns:
        Tensor shaped and typed like ``x2``.
    """
    b = rotation.shape[-1]
    a, n_blocks = _as_blocks(x2, rotation)
    out = torch.empty_like(a)
    tokens = a.shape[0]
    if tokens == 0:
        return out.reshape(x2.shape)
    tile = block_tile(b) if INTERPRETED else min(64, block_tile(b))
    n_tiles_n = triton.cdiv(b, tile)
    stride_mk, stride_mn = (1, b) if transpose else (b, 1)
    block_t = token_tile(tokens, tile, itemsize=x2.element_size())
    grid = (triton.cdiv(tokens, block_t), n_blocks * n_tiles_n)
    launch = {} if INTERPRETED else {"num_warps": 4 if block_t * tile <= 4096 else 8}
    _block_mm_kernel[grid](
        a, rotation, out, tokens, b, n_tiles_n,
        a.stride(0), b * b if rotation.shape[0] > 1 else 0, stride_mk, stride_mn, out.stride(0),
        BLOCK_T=block_t, BLOCK_K=tile, BLOCK_N=tile, PRECISION=dot_precision(x2, rotation), **launch,
    )
    return out.reshape(x2.shape)


def _chunks(tokens: int, block_t: int) -> tuple[int, int]:
    """``(chunks, tokens per chunk)`` of a dR reduction: about :data:`TOKENS_PER_CHUNK` tokens each (a multiple
    of ``block_t``; the interpreter, which pays per program, takes :data:`INTERPRETER_TOKENS_PER_CHUNK`)."""
    per_chunk = min(max(block_t, INTERPRETER_TOKENS_PER_CHUNK if INTERPRETED else TOKENS_PER_CHUNK), tokens)
    per_chunk = triton.cdiv(per_chunk, block_t) * block_t
    return triton.cdiv(tokens, per_chunk), per_chunk


def _sum_chunks(partial: torch.Tensor) -> torch.Tensor:
    # A fixed-order sum of per-chunk partials (no atomics): dR is deterministic run to run.
    return partial[0] if partial.shape[0] == 1 else partial.sum(0)


def block_grad_rotation(x2: torch.Tensor, grad2: torch.Tensor, rotation_blocks: int, b: int) -> torch.Tensor:
    """dR_blk = Σ_tokens x_blkᵀ dX'_blk in fp32 (summed over blocks too when the rotation is shared).

    Args:
        x2: ``[tokens, width]`` contiguous forward input.
        grad2: ``[tokens, width]`` contiguous gradient of the output.
        rotation_blocks: ``n_blocks`` of the rotation (1 when shared).
        b: Block size.

    Returns:
        ``[rotation_blocks, b, b]`` fp32 gradient.
    """
    if rotation_blocks == 1 and x2.shape[1] != b:
        x2, grad2 = x2.reshape(-1, b), grad2.reshape(-1, b)
    tokens = x2.shape[0]
    if tokens == 0:
        return torch.zeros(rotation_blocks, b, b, device=x2.device, dtype=torch.float32)
    tile = block_tile(b) if INTERPRETED else min(64, block_tile(b))
    n_tiles = triton.cdiv(b, tile)
    block_t = min(512, max(16, next_pow2(tokens))) if INTERPRETED else 64
    chunks, per_chunk = _chunks(tokens, block_t)
    partial = torch.empty(chunks, rotation_blocks, b, b, device=x2.device, dtype=torch.float32)
    _block_atb_kernel[(rotation_blocks * n_tiles * n_tiles, chunks)](
        x2, grad2, partial, tokens, b, rotation_blocks, n_tiles, per_chunk, x2.stride(0), grad2.stride(0),
        BLOCK_M=tile, BLOCK_N=tile, BLOCK_T=block_t, PRECISION=dot_precision(x2, grad2),
    )
    return _sum_chunks(partial)


def block_rotate_backward(x2: torch.Tensor, grad2: torch.Tensor, rotation: torch.Tensor, need_x: bool = True,
                          need_rotation: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dX, dR)`` of ``x' = x R`` in one pass over x and dX' (blocks ≤ 64; wider blocks run the two kernels).

    Args:
        x2: ``[tokens, n_blocks * b]`` contiguous forward input.
        grad2: ``[tokens, n_blocks * b]`` contiguous gradient of the output.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` contiguous blocks.
        need_x: Compute ``dX = dX' Rᵀ`` (x2's shape and dtype).
        need_rotation: Compute ``dR`` (``[n_blocks or 1, b, b]``, fp32).

    Returns:
        ``(dX or None, dR or None)``.
    """
    b = rotation.shape[-1]
    if block_tile(b) > 64:
        return (block_matmul(grad2, rotation, transpose=True) if need_x else None,
                block_grad_rotation(x2, grad2, rotation.shape[0], b) if need_rotation else None)
    x, n_blocks = _as_blocks(x2, rotation)
    g = grad2.reshape(x.shape)
    tokens, bb = x.shape[0], block_tile(b)
    dx = torch.empty_like(g) if need_x else None
    if tokens == 0 or not (need_x or need_rotation):
        dr = torch.zeros(n_blocks, b, b, device=x.device, dtype=torch.float32) if need_rotation else None
        return (dx.reshape(x2.shape) if need_x else None), dr
    # Half the forward's slab, 8 warps: the sm_90 compile check found no spills there at b ≤ 32 (b = 64: a few).
    block_t = token_tile(tokens, bb, GPU_SLAB // 2, x2.element_size())
    chunks, per_chunk = _chunks(tokens, block_t)
    partial = torch.empty(chunks, n_blocks, b, b, device=x.device, dtype=torch.float32) if need_rotation else g
    launch = {} if INTERPRETED else {"num_warps": 8}
    _block_bwd_kernel[(n_blocks, chunks)](
        x, g, rotation, dx if need_x else g, partial, tokens, b, n_blocks, per_chunk,
        x.stride(0), b * b if rotation.shape[0] > 1 else 0, HAS_DX=need_x, HAS_DR=need_rotation,
        BLOCK_T=block_t, BB=bb, PRECISION=dot_precision(x2, grad2, rotation), **launch,
    )
    return (dx.reshape(x2.shape) if need_x else None), (_sum_chunks(partial) if need_rotation else None)
