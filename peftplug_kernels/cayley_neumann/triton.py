"""Triton kernels for the Cayley–Neumann map: triangle vector -> rotation block, and its backward.

One program per block. The forward unpacks the strict upper triangle into Q (Q[i, j] = q, Q[j, i] = -q) in
registers and evaluates R = I + Σ_{k=1..n-1} c_k Qᵏ (c_k = 2, except c_{n-1} = 1 for PEFT's product form).
The backward evaluates dL/dQ = Σ_k c_k M_k with M_1 = G, M_{k+1} = Qᵀ M_k + G (Qᵀ)ᵏ and folds it back onto the
triangle: dq[i<j] = dQ[i, j] − dQ[j, i]. Everything is fp32 in registers, so blocks are limited to
``peftplug_kernels.ops.CN_TRITON_MAX_BLOCK`` (64; a 128-wide tile took minutes to compile for sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels._tiles import block_tile


@triton.jit
def _skew_tile(q_ptr, pid, stride_q, B, BB: tl.constexpr):
    i = tl.arange(0, BB)[:, None]
    j = tl.arange(0, BB)[None, :]
    upper = i < j
    iu = tl.where(upper, i, j)
    ju = tl.where(upper, j, i)
    idx = iu * B - (iu * (iu + 1)) // 2 + (ju - iu - 1)
    valid = (i != j) & (i < B) & (j < B)
    v = tl.load(q_ptr + pid * stride_q + tl.where(valid, idx, 0), mask=valid, other=0.0).to(tl.float32)
    return tl.where(upper, v, -v)


@triton.jit
def _cn_forward_kernel(q_ptr, r_ptr, B, stride_q, TERMS: tl.constexpr, LAST_COEFF: tl.constexpr,
                       BB: tl.constexpr):
    pid = tl.program_id(0)
    q = _skew_tile(q_ptr, pid, stride_q, B, BB)
    i = tl.arange(0, BB)[:, None]
    j = tl.arange(0, BB)[None, :]
    r = tl.where((i == j) & (i < B), 1.0, 0.0)
    power = q
    for k in tl.static_range(1, TERMS):
        if k > 1:
            power = tl.dot(power, q, input_precision="ieee")
        if k == TERMS - 1:
            r += LAST_COEFF * power
        else:
            r += 2.0 * power
    tl.store(r_ptr + pid * B * B + i * B + j, r.to(r_ptr.dtype.element_ty), mask=(i < B) & (j < B))


@triton.jit
def _cn_backward_kernel(q_ptr, g_ptr, dq_ptr, B, stride_q, stride_dq, TERMS: tl.constexpr,
                        LAST_COEFF: tl.constexpr, BB: tl.constexpr):
    pid = tl.program_id(0)
    qt = -_skew_tile(q_ptr, pid, stride_q, B, BB)  # Qᵀ = −Q
    i = tl.arange(0, BB)[:, None]
    j = tl.arange(0, BB)[None, :]
    inside = (i < B) & (j < B)
    g = tl.load(g_ptr + pid * B * B + i * B + j, mask=inside, other=0.0).to(tl.float32)
    grad = tl.full((BB, BB), 0.0, tl.float32)
    m = g
    qt_pow = qt
    for k in tl.static_range(1, TERMS):
        if k > 1:
            m = tl.dot(qt, m, input_precision="ieee") + tl.dot(g, qt_pow, input_precision="ieee")
            qt_pow = tl.dot(qt_pow, qt, input_precision="ieee")
        if k == TERMS - 1:
            grad += LAST_COEFF * m
        else:
            grad += 2.0 * m
    folded = grad - tl.trans(grad)
    upper = (i < j) & inside
    idx = i * B - (i * (i + 1)) // 2 + (j - i - 1)
    tl.store(dq_ptr + pid * stride_dq + tl.where(upper, idx, 0), folded, mask=upper)


INTERPRETED = type(_cn_forward_kernel).__name__ == "InterpretedFunction"


def _last_coeff(form: str) -> float:
    return 1.0 if form == "peft_cn" else 2.0


# Warps per program by block tile, chosen by compiling for sm_90 (benchmarks/gpu/compile_check.py): the
# register-resident powers of a [BB, BB] block spill at Triton's default 4 warps from BB = 32 on (backward: 3.5 KB
# per thread); more warps spread them. BB = 64 still spills (forward ~1.2 KB, backward ~6.3 KB at 16 warps).
_GPU_WARPS = {16: (4, 4), 32: (8, 8), 64: (8, 16)}  # BB -> (forward, backward)


def gpu_num_warps(bb: int, backward: bool) -> int:
    """Warps per program of the forward or backward kernel for block tile ``bb`` (16, 32 or 64).

    Args:
        bb: Power-of-two tile holding one rotation block.
        backward: The backward kernel's count, else the forward's.
    """
    return _GPU_WARPS[bb][int(backward)]


def _launch(bb: int, backward: bool) -> dict:
    return {} if INTERPRETED else {"num_warps": gpu_num_warps(bb, backward)}


def cayley_neumann_forward(q_vec: torch.Tensor, block_size: int, terms: int, form: str) -> torch.Tensor:
    """``[n_blocks, b(b-1)/2]`` -> ``[n_blocks, b, b]`` in ``q_vec``'s dtype (fp32 inside).

    Args:
        q_vec: Contiguous triangle vectors.
        block_size: b (<= ``peftplug_kernels.ops.CN_TRITON_MAX_BLOCK``).
        terms: Series length n.
        form: ``"cayley_neumann"`` or ``"peft_cn"``.
    """
    n_blocks = q_vec.shape[0]
    out = torch.empty(n_blocks, block_size, block_size, device=q_vec.device, dtype=q_vec.dtype)
    if n_blocks:
        _cn_forward_kernel[(n_blocks,)](q_vec, out, block_size, q_vec.stride(0), TERMS=terms,
                                        LAST_COEFF=_last_coeff(form), BB=block_tile(block_size),
                                        **_launch(block_tile(block_size), backward=False))
    return out


def cayley_neumann_backward(q_vec: torch.Tensor, grad_r: torch.Tensor, terms: int, form: str) -> torch.Tensor:
    """Gradient of the triangle vectors given dL/dR ``[n_blocks, b, b]``; fp32.

    Args:
        q_vec: Contiguous triangle vectors of the forward.
        grad_r: Contiguous fp32 gradient of the rotation blocks.
        terms: Series length n.
        form: ``"cayley_neumann"`` or ``"peft_cn"``.
    """
    n_blocks, b = grad_r.shape[0], grad_r.shape[-1]
    out = torch.empty(q_vec.shape, device=q_vec.device, dtype=torch.float32)
    if n_blocks:
        _cn_backward_kernel[(n_blocks,)](q_vec, grad_r, out, b, q_vec.stride(0), out.stride(0), TERMS=terms,
                                         LAST_COEFF=_last_coeff(form), BB=block_tile(b),
                                         **_launch(block_tile(b), backward=True))
    return out
