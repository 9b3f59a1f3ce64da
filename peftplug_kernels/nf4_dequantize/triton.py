"""Triton kernel: deq(W) of a bitsandbytes 4-bit weight, written once in the output dtype.

The pure-torch reference materialises uint8 nibbles, int32 indices and fp32 values on the way (≈19 bytes per
weight element at its peak); this kernel reads the packed bytes and the scales and writes 2 bytes per element
(bf16/fp16), which is what bitsandbytes' own CUDA dequantize costs. Program ``p`` handles flat elements
``[p * BLOCK, (p + 1) * BLOCK)`` of the row-major weight. Formats: see ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels._tiles import next_pow2
from peftplug_kernels.nf4_dequantize.reference import kernel_quant_state, packed_bytes


@triton.jit
def _dequantize_4bit_kernel(
    w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, out_ptr, n,
    QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64: a 4-bit weight can pass 2³¹ elements (e.g. a 128k-vocabulary head), where int32 offsets wrap.
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = e < n
    byte = tl.load(w_ptr + e // 2, mask=ok, other=0).to(tl.int32)
    nib = tl.where(e % 2 == 0, byte >> 4, byte & 0xF)  # high nibble first
    val = tl.load(code_ptr + nib, mask=ok, other=0.0)
    qblock = e // QBLOCK
    if NESTED:
        qa = tl.load(absmax_ptr + qblock, mask=ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qa, mask=ok, other=0.0) * tl.load(absmax2_ptr + qblock // QBLOCK2, mask=ok,
                                                                      other=0.0) + offset
    else:
        scale = tl.load(absmax_ptr + qblock, mask=ok, other=0.0)
    tl.store(out_ptr + e, (val * scale).to(out_ptr.dtype.element_ty), mask=ok)


INTERPRETED = type(_dequantize_4bit_kernel).__name__ == "InterpretedFunction"


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantizes a bitsandbytes 4-bit weight with one kernel launch.

    Args:
        weight: Packed weight (``Params4bit`` data) on the kernel's device.
        quant_state: Its ``QuantState`` (read by attribute).
        dtype: Output dtype; the state's dtype by default.

    Returns:
        ``quant_state.shape`` tensor.
    """
    shape = tuple(quant_state.shape)
    out = torch.empty(shape, device=weight.device, dtype=dtype or quant_state.dtype)
    n = out.numel()
    if n == 0:
        return out
    qs = kernel_quant_state(quant_state, weight.device)
    # The interpreter runs each program as numpy calls: few large programs are fastest there.
    block = min(next_pow2(n), 1 << 16) if INTERPRETED else 1024
    # No FMA contraction: the nested scale code2 * absmax2 + offset must round like bitsandbytes' (multiply, then
    # add) for the result to be bit-exact; this kernel is memory-bound, so the extra instruction costs nothing.
    launch = {} if INTERPRETED else {"num_warps": 4, "enable_fp_fusion": False}
    _dequantize_4bit_kernel[(triton.cdiv(n, block),)](
        packed_bytes(weight), qs.absmax, qs.code, qs.absmax2, qs.code2, qs.offset, out, n,
        QBLOCK=qs.blocksize, QBLOCK2=qs.blocksize2, NESTED=qs.nested, BLOCK=block, **launch,
    )
    return out
