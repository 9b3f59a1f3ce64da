"""Triton kernels for the block-diagonal rotation x' = x R and its backward.

Two kernels cover forward and backward:
    ``_block_mm_kernel``   C[:, blk] = A[:, blk] @ M_blk — forward (M = R) and dX (M = Rᵀ via swapped strides);
    ``_block_atb_kernel``  dR_blk = Σ_t A[t, blk]ᵀ B[t, blk] — the reduction over tokens for dR.
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
    a_ptr, b_ptr, out_ptr, T, B, n_tiles,
    stride_at, stride_bt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid // (n_tiles * n_tiles)
    rest = pid % (n_tiles * n_tiles)
    ms = (rest // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (rest % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for t0 in range(0, T, BLOCK_T):
        ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)  # int64 offsets, as in _block_mm_kernel
        t_ok = ts < T
        # A tile loaded transposed: [BLOCK_M, BLOCK_T].
        a_t = tl.load(a_ptr + ts[None, :] * stride_at + (blk * B + ms)[:, None],
                      mask=t_ok[None, :] & (ms < B)[:, None], other=0.0)
        b = tl.load(b_ptr + ts[:, None] * stride_bt + (blk * B + ns)[None, :],
                    mask=t_ok[:, None] & (ns < B)[None, :], other=0.0)
        acc += tl.dot(a_t.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    tl.store(out_ptr + blk * B * B + ms[:, None] * B + ns[None, :], acc,
             mask=(ms < B)[:, None] & (ns < B)[None, :])


# True when the kernels above were decorated in interpreter mode (TRITON_INTERPRET=1 at import).
INTERPRETED = type(_block_mm_kernel).__name__ == "InterpretedFunction"


def _token_tile(tokens: int) -> int:
    # The interpreter pays per program and per loop iteration, not per element: use big tiles there.
    return min(256, max(16, next_pow2(tokens))) if INTERPRETED else 64


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
    block_t = _token_tile(tokens)
    grid = (triton.cdiv(tokens, block_t), n_blocks * n_tiles_n)
    _block_mm_kernel[grid](
        a, rotation, out, tokens, b, n_tiles_n,
        a.stride(0), b * b if rotation.shape[0] > 1 else 0, stride_mk, stride_mn, out.stride(0),
        BLOCK_T=block_t, BLOCK_K=tile, BLOCK_N=tile, PRECISION=dot_precision(x2, rotation),
    )
    return out.reshape(x2.shape)


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
    out = torch.zeros(rotation_blocks, b, b, device=x2.device, dtype=torch.float32)
    if tokens == 0:
        return out
    tile = block_tile(b) if INTERPRETED else min(64, block_tile(b))
    n_tiles = triton.cdiv(b, tile)
    block_t = min(512, max(16, next_pow2(tokens))) if INTERPRETED else 64
    grid = (rotation_blocks * n_tiles * n_tiles,)
    _block_atb_kernel[grid](
        x2, grad2, out, tokens, b, n_tiles, x2.stride(0), grad2.stride(0),
        BLOCK_M=tile, BLOCK_N=tile, BLOCK_T=block_t, PRECISION=dot_precision(x2, grad2),
    )
    return out
