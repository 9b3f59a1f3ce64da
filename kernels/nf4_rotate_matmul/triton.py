"""Triton kernel: y = (x R) deq(W)ᵀ + bias with the rotation in the GEMM prologue and 4-bit dequant on the fly.

Program (t-tile, n-tile). The K loop walks the rotation blocks: load the x tile of block ``blk``
([BLOCK_T, b]), rotate it by R_blk in registers, dequantize the matching [b, BLOCK_N] slice of Wᵀ from the
packed nibbles (code table lookup × absmax, undoing double quantization when nested) and accumulate the product
in fp32. Neither x R nor deq(W) is ever written to memory. Formats: see ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tiles import block_tile, dot_precision, next_pow2
from kernels.nf4_rotate_matmul.reference import packed_bytes


@triton.jit
def _rotate_dequant_matmul_kernel(
    x_ptr, r_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, bias_ptr, y_ptr,
    T, N, K, B, stride_xt, stride_rb, stride_yt, QBLOCK, QBLOCK2,
    NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, HALF_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BB: tl.constexpr,
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
        qblock = flat // QBLOCK
        if NESTED:
            qa = tl.load(absmax_ptr + qblock, mask=w_mask, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + qa, mask=w_mask, other=0.0) * tl.load(
                absmax2_ptr + qblock // QBLOCK2, mask=w_mask, other=0.0) + offset
        else:
            scale = tl.load(absmax_ptr + qblock, mask=w_mask, other=0.0)
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


def rotate_dequant_matmul(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Fused forward on a 2-D input.

    Args:
        x2: ``[tokens, in]`` contiguous activations (fp32/fp16/bf16).
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` contiguous blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        bias: Optional ``[out]`` bias.

    Returns:
        ``[tokens, out]`` in ``x2``'s dtype.
    """
    tokens, k = x2.shape
    n = int(quant_state.shape[0])
    b = rotation.shape[-1]
    y = torch.empty(tokens, n, device=x2.device, dtype=x2.dtype)
    if tokens == 0:
        return y
    device = x2.device
    code = quant_state.code.to(device=device, dtype=torch.float32).contiguous()
    nested = bool(getattr(quant_state, "nested", False))
    if nested:
        absmax = quant_state.absmax.to(device).contiguous()
        absmax2 = quant_state.state2.absmax.to(device=device, dtype=torch.float32).contiguous()
        code2 = quant_state.state2.code.to(device=device, dtype=torch.float32).contiguous()
        offset, qblock2 = float(quant_state.offset), int(quant_state.state2.blocksize)
    else:
        absmax = quant_state.absmax.to(device=device, dtype=torch.float32).contiguous()
        absmax2, code2, offset, qblock2 = absmax, code, 0.0, 1
    half_dot = (not INTERPRETED) and x2.dtype in (torch.float16, torch.bfloat16)
    bb = block_tile(b)
    if INTERPRETED:
        block_t, block_n = min(128, max(16, next_pow2(tokens))), min(128, max(16, next_pow2(n)))
        launch = {}
    else:
        # Shared memory per config, compiled for sm_90 (limit 227 KB): bb 32 -> 119 KB (bf16, 3 stages);
        # bb 64 -> 262 KB at 3 stages, 147 KB at 2; bb 128 -> 66 KB with 64-wide tiles and 1 stage.
        if bb <= 32:
            block_t = block_n = 128
            stages = 3
        elif bb <= 64:
            block_t = block_n = 128 if half_dot else 64
            stages = 2
        else:
            block_t = block_n = 64
            stages = 1
        launch = {"num_warps": 8, "num_stages": stages}
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(n, block_n))
    _rotate_dequant_matmul_kernel[grid](
        x2, rotation, packed_bytes(weight), absmax, code, absmax2, code2, offset,
        bias if bias is not None else y, y,
        tokens, n, k, b, x2.stride(0), b * b if rotation.shape[0] > 1 else 0, y.stride(0),
        int(quant_state.blocksize), qblock2,
        NESTED=nested, HAS_BIAS=bias is not None, HALF_DOT=half_dot, PRECISION=dot_precision(x2, rotation),
        BLOCK_T=block_t, BLOCK_N=block_n, BB=bb, **launch,
    )
    return y
