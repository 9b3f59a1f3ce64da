"""The negative control of ``ptx_check``: a 4-bit GEMM whose decode gathers ``code[nibble]`` from global memory
per weight element, as the first, retired fused NF4 kernel did (docs/kernels.md). ``ptx_check`` counts this
loop's scalar global reads with the same rule it applies to the W4A16 kernel; the rule must fail it, or the count
proves nothing. Compiled for sm_90 only, never launched.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_decode_kernel(x_ptr, w_ptr, code_ptr, y_ptr, N, K,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_T)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + kk)[None, :])
        flat = cols[None, :] * K + (k0 + kk)[:, None]  # Wᵀ tile [BLOCK_K, BLOCK_N], two codes per byte
        byte = tl.load(w_ptr + flat // 2).to(tl.int32)
        nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 0xF)
        w = tl.load(code_ptr + nibble)  # the per-element global gather the check must catch
        acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty))
