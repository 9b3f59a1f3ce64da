"""The fused NF4 forward and backward wrappers, and the first, general fused kernel.

``rotate_dequant_matmul`` (what ``function.py`` calls) picks, for a layer the W4A16 kernels take
(:func:`peftplug_kernels.nf4_rotate_matmul.fit.w4a16_unfit`):
  - up to :data:`FUSED_MAX_TOKENS` tokens, :func:`fused_forward`: one launch of the W4A16 kernel
    (``w4a16.py``), which rotates the x tile in its prologue and streams the packed weight once;
  - above, :func:`unfused_forward`: rotate x once, dequantize W once, one cuBLAS matmul. Decoding the weight
    inside a GEMM's K loop costs once per token tile, which at many tokens outweighs the GEMM itself
    (docs/kernels.md, "The NF4 forward from its FLOP/byte table").
Other layers (fp32 activations, quantization blocks straddling rows or narrower than 64) run
``_rotate_dequant_matmul_kernel`` below: K steps of one rotation block, the x tile rotated per output tile,
code-table gathers (correct everywhere, slow: 0.46 ms at 16 tokens on an H200).
:func:`grad_rotated_input` is the backward's ``dX' = dY deq(W)`` on the same rule.

The general kernel: program (t-tile, n-tile). The K loop walks the rotation blocks: load the x tile of block ``blk``
([BLOCK_T, b]), rotate it by R_blk in registers, dequantize the matching [b, BLOCK_N] slice of Wᵀ from the
packed nibbles (code table lookup × absmax, undoing double quantization when nested) and accumulate the product
in fp32. Neither x R nor deq(W) is ever written to memory. Formats: see ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels._tiles import block_tile, dot_precision, fit_tiles, next_pow2
from peftplug_kernels.nf4_dequantize.reference import packed_bytes
from peftplug_kernels.nf4_dequantize.tile import cached_state
from peftplug_kernels.nf4_rotate_matmul.fit import w4a16_unfit
from peftplug_kernels.nf4_rotate_matmul.w4a16 import (  # noqa: F401  (re-exported for function.py, benchmarks)
    DECODE_CANDIDATES,
    FUSED_GRAD_MAX_TOKENS,
    FUSED_MAX_TOKENS,
    GEMM_CANDIDATES,
    GRAD_CANDIDATES,
    W4A16Config,
    _multiprocessors,
    forward_config,
    fused_forward,
    grad_config,
    grad_rotated_input,
    unfused_forward,
)


@triton.jit
def _rotate_dequant_matmul_kernel(
    x_ptr, r_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, bias_ptr, y_ptr,
    T, N, K, B, stride_xt, stride_rb, stride_yt,
    QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, SCALE_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr, HALF_DOT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BB: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows: tokens × width can exceed 2³¹ elements, where int32 offsets wrap.
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BB)
    row_ok = rows < T
    col_ok = cols < N
    k_ok = kk < B
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for blk in range(K // B):
        # Prologue: rotate this block of the x tile.
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + (blk * B + kk)[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        rt = tl.load(r_ptr + blk * stride_rb + kk[:, None] * B + kk[None, :],
                     mask=k_ok[:, None] & k_ok[None, :], other=0.0)
        xr = tl.dot(xt.to(tl.float32), rt.to(tl.float32), input_precision=PRECISION)
        # Round like the unfused path (block_rotate returns x's dtype).
        xr = xr.to(x_ptr.dtype.element_ty)
        # Dequantize Wᵀ[blk*B + k, n] = W[n, blk*B + k]; flat index n*K + k, high nibble first.
        flat = cols[None, :] * K + (blk * B + kk)[:, None]
        w_mask = k_ok[:, None] & col_ok[None, :]
        byte = tl.load(w_ptr + flat // 2, mask=w_mask, other=0).to(tl.int32)
        nib = tl.where(flat % 2 == 0, byte >> 4, byte & 0xF)
        val = tl.load(code_ptr + nib, mask=w_mask, other=0.0)
        if SCALE_PER_COL:
            # The rotation block lies inside one quantization block of each column: one scale per column
            # instead of a gather per element (the common case, e.g. b = 32 and blocksize 64).
            qblock = (cols * K + blk * B) // QBLOCK
            s_mask = col_ok
        else:
            qblock = flat // QBLOCK
            s_mask = w_mask
        if NESTED:
            qa = tl.load(absmax_ptr + qblock, mask=s_mask, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + qa, mask=s_mask, other=0.0) * tl.load(
                absmax2_ptr + qblock // QBLOCK2, mask=s_mask, other=0.0) + offset
        else:
            scale = tl.load(absmax_ptr + qblock, mask=s_mask, other=0.0)
        if SCALE_PER_COL:
            w = (val * scale[None, :]).to(x_ptr.dtype.element_ty)
        else:
            w = (val * scale).to(x_ptr.dtype.element_ty)
        if HALF_DOT:
            acc += tl.dot(xr, w)
        else:
            acc += tl.dot(xr.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


INTERPRETED = type(_rotate_dequant_matmul_kernel).__name__ == "InterpretedFunction"


# GPU tiles per rotation-block tile, chosen by compiling every candidate for sm_90 with Triton's ptxas
# (benchmarks/gpu/compile_check.py): the largest tiles that fit shared memory (227 KB) with the fewest spills.
# A [BB, BB] fp32 rotation block lives in registers next to the accumulator, so tiles shrink as BB grows; fp32 inputs
# (fp32 tiles, exact dots) need smaller tiles than bf16/fp16. These are the tiles for many tokens; fit_tiles
# shrinks them for few. Untimed until a GPU run (benchmarks/gpu/run_all.sh).
#   (BB, half inputs) -> (BLOCK_T, BLOCK_N, num_stages, num_warps)   shared KB, spilled bytes per thread with one
#   scale per column (the usual case) / with per-element scales, as docs/benchmarks/kernels_sm90.md last measured
_GPU_LAUNCH = {
    (32, True): (128, 128, 3, 8),  # 54 KB, 0 / 0
    (32, False): (64, 128, 3, 8),  # 82 KB, 0 / 0
    (64, True): (64, 128, 2, 8),  # 81 KB, 0 / 56-112   (128 × 128 spilled 224 B with one scale per column)
    (64, False): (32, 64, 2, 8),  # 64 KB, 24-32 / 0
    (128, True): (16, 64, 1, 8),  # 64 KB, 56-128 (every 128-wide candidate spills)
    (128, False): (32, 64, 1, 8),  # 80 KB, ~8 KB: fp32 with 128-wide blocks is slow; prefer bf16 compute
}


def gpu_launch(bb: int, half: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_N, num_stages, num_warps)`` for a rotation-block tile ``bb`` (16, 32, 64 or 128).

    Args:
        bb: Power-of-two tile holding one rotation block (:func:`peftplug_kernels._tiles.block_tile`).
        half: Whether the inputs are fp16/bf16 (half-precision main dot).
    """
    return _GPU_LAUNCH[(max(32, bb), half)]


def rotate_dequant_matmul(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Forward on a 2-D input by the rule in the module docstring.

    Args:
        x2: ``[tokens, in]`` contiguous activations (fp32/fp16/bf16).
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` contiguous blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        bias: Optional ``[out]`` bias.

    Returns:
        ``[tokens, out]`` in ``x2``'s dtype.
    """
    if w4a16_unfit(x2.dtype, tuple(quant_state.shape), quant_state):
        return general_forward(x2, rotation, weight, quant_state, bias)
    if x2.shape[0] <= FUSED_MAX_TOKENS:
        return fused_forward(x2, rotation, weight, quant_state, bias)
    return unfused_forward(x2, rotation, weight, quant_state, bias)


def general_forward(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The general fused kernel (any dtype, any 4-bit layout; slow); arguments as :func:`rotate_dequant_matmul`."""
    tokens, k = x2.shape
    n = int(quant_state.shape[0])
    b = rotation.shape[-1]
    y = torch.empty(tokens, n, device=x2.device, dtype=x2.dtype)
    if tokens == 0:
        return y
    qs = cached_state(quant_state, x2.device)
    half_dot = (not INTERPRETED) and x2.dtype in (torch.float16, torch.bfloat16)
    bb = block_tile(b)
    if INTERPRETED:
        block_t, block_n = min(128, max(16, next_pow2(tokens))), min(128, max(16, next_pow2(n)))
        launch = {}
    else:
        block_t, block_n, stages, warps = gpu_launch(bb, half_dot)
        block_t, block_n, warps = fit_tiles(block_t, block_n, warps, tokens, n, _multiprocessors(x2.device), bb)
        launch = {"num_warps": warps, "num_stages": stages}
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(n, block_n))
    _rotate_dequant_matmul_kernel[grid](
        x2, rotation, packed_bytes(weight), qs.absmax, qs.code, qs.absmax2, qs.code2, qs.offset,
        bias if bias is not None else y, y,
        tokens, n, k, b, x2.stride(0), b * b if rotation.shape[0] > 1 else 0, y.stride(0),
        # Block sizes as constexpr: divisions by them compile to shifts (they are powers of two).
        QBLOCK=qs.blocksize, QBLOCK2=qs.blocksize2, NESTED=qs.nested, SCALE_PER_COL=k % qs.blocksize == 0 and qs.blocksize % b == 0, HAS_BIAS=bias is not None,
        HALF_DOT=half_dot, PRECISION=dot_precision(x2, rotation), BLOCK_T=block_t, BLOCK_N=block_n, BB=bb, **launch,
    )
    return y
