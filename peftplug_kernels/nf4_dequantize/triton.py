"""Triton kernel: deq(W) of a bitsandbytes 4-bit weight, written once in the output dtype, at memory speed.

Program ``p`` decodes ``ROWS`` whole quantization blocks (flat elements ``[p * ROWS * QBLOCK, ...)`` of the
row-major weight): it loads their packed bytes as a ``[ROWS, QBLOCK / 2]`` tile (16-byte vector loads), decodes
both nibbles with the code table in registers (:mod:`peftplug_kernels.nf4_dequantize.tile`), multiplies by one
scale per block and stores ``[ROWS, QBLOCK]``. It reads 0.5 byte per element plus one scale per block and writes
2 bytes per element in bf16/fp16: 40 MiB for a 4096 × 4096 weight, ≈ 9 µs at an H200's 4.8 TB/s. The first
version gathered the code value and the nested scale per element (0.140 ms on the H200). Formats: see
``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels._tiles import next_pow2
from peftplug_kernels.nf4_dequantize.reference import packed_bytes
from peftplug_kernels.nf4_dequantize.tile import block_scales, cached_state, load_table, unpack


@triton.jit
def _dequantize_4bit_kernel(
    w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, out_ptr, n,
    QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, ROWS: tl.constexpr,
):
    t = load_table(code_ptr)
    # int64: a 4-bit weight can pass 2³¹ elements (e.g. a 128k-vocabulary head), where int32 offsets wrap.
    qblock = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    start = qblock * QBLOCK
    half = tl.arange(0, QBLOCK // 2)
    e_byte = (start // 2)[:, None] + half[None, :]
    byte = tl.load(w_ptr + e_byte, mask=e_byte * 2 < n, other=0).to(tl.int32)
    scale = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset, qblock, start < n, NESTED, QBLOCK2)
    vals = unpack(byte, t, ROWS, QBLOCK) * scale[:, None]
    e = start[:, None] + tl.arange(0, QBLOCK)[None, :]
    tl.store(out_ptr + e, vals.to(out_ptr.dtype.element_ty), mask=e < n)


INTERPRETED = type(_dequantize_4bit_kernel).__name__ == "InterpretedFunction"
# Elements per program: 4096 on GPU (16 KiB of bf16 out, a few thousand programs for a 4096² weight); the
# interpreter pays per program, so it takes up to 2¹⁶.
GPU_ELEMENTS, INTERPRETER_ELEMENTS = 4096, 1 << 16


def launch(n: int, qblock: int) -> tuple[int, dict]:
    """``(ROWS, launch options)`` for ``n`` elements in quantization blocks of ``qblock``.

    Args:
        n: Elements of the weight.
        qblock: Quantization block size (a power of two).
    """
    if INTERPRETED:
        return max(1, min(next_pow2(-(-n // qblock)), INTERPRETER_ELEMENTS // qblock)), {}
    # No FMA contraction: the nested scale code2 * absmax2 + offset must round like bitsandbytes' (multiply,
    # then add) for the result to be bit-exact; this kernel is memory-bound, so the extra instruction is free.
    return max(1, GPU_ELEMENTS // qblock), {"num_warps": 4, "enable_fp_fusion": False}


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantizes a bitsandbytes 4-bit weight with one kernel launch.

    Args:
        weight: Packed weight (``Params4bit`` data) on the kernel's device.
        quant_state: Its ``QuantState`` (read by attribute).
        dtype: Output dtype; the state's dtype by default.

    Returns:
        ``quant_state.shape`` tensor.
    """
    out = torch.empty(tuple(quant_state.shape), device=weight.device, dtype=dtype or quant_state.dtype)
    n = out.numel()
    if n == 0:
        return out
    qs = cached_state(quant_state, weight.device)
    rows, options = launch(n, qs.blocksize)
    _dequantize_4bit_kernel[(triton.cdiv(triton.cdiv(n, qs.blocksize), rows),)](
        packed_bytes(weight), qs.absmax, qs.code, qs.absmax2, qs.code2, qs.offset, out, n,
        QBLOCK=qs.blocksize, QBLOCK2=qs.blocksize2, NESTED=qs.nested, ROWS=rows, **options,
    )
    return out
