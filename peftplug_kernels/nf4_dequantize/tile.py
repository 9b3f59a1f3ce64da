"""Triton helpers that decode bitsandbytes 4-bit (NF4/FP4) tiles in registers, shared by the 4-bit kernels.

The 16-entry code table is read once per program into 16 scalars (:func:`load_table`) and every nibble is
decoded by a 4-level select tree over them (:func:`lookup`): no per-element gather from global memory, which is
what made the first fused kernel slow. Scales are read once per row of a tile (:func:`block_scales`): a tile
``[rows, BLOCK_K]`` with ``BLOCK_K`` dividing the quantization block and rows starting on a block boundary
has one scale per row. Formats: :mod:`peftplug_kernels.nf4_dequantize.reference`.

Import only from ``peftplug_kernels/*/triton.py`` modules (after ``TRITON_INTERPRET`` has its final value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peftplug_kernels.nf4_dequantize.reference import KernelQuantState, kernel_quant_state


@triton.jit
def load_table(code_ptr):
    """The 16 fp32 code values as scalars (registers), loaded once per program."""
    return (tl.load(code_ptr + 0), tl.load(code_ptr + 1), tl.load(code_ptr + 2), tl.load(code_ptr + 3),
            tl.load(code_ptr + 4), tl.load(code_ptr + 5), tl.load(code_ptr + 6), tl.load(code_ptr + 7),
            tl.load(code_ptr + 8), tl.load(code_ptr + 9), tl.load(code_ptr + 10), tl.load(code_ptr + 11),
            tl.load(code_ptr + 12), tl.load(code_ptr + 13), tl.load(code_ptr + 14), tl.load(code_ptr + 15))


@triton.jit
def lookup(nib, t):
    """``t[nib]`` for int32 nibbles 0..15 by a select tree (15 selects): bit 0 picks within pairs, bit 3 last."""
    b0 = (nib & 1) != 0
    a0 = tl.where(b0, t[1], t[0])
    a1 = tl.where(b0, t[3], t[2])
    a2 = tl.where(b0, t[5], t[4])
    a3 = tl.where(b0, t[7], t[6])
    a4 = tl.where(b0, t[9], t[8])
    a5 = tl.where(b0, t[11], t[10])
    a6 = tl.where(b0, t[13], t[12])
    a7 = tl.where(b0, t[15], t[14])
    b1 = (nib & 2) != 0
    c0 = tl.where(b1, a1, a0)
    c1 = tl.where(b1, a3, a2)
    c2 = tl.where(b1, a5, a4)
    c3 = tl.where(b1, a7, a6)
    b2 = (nib & 4) != 0
    d0 = tl.where(b2, c1, c0)
    d1 = tl.where(b2, c3, c2)
    return tl.where((nib & 8) != 0, d1, d0)


@triton.jit
def block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset, qblock, mask, NESTED: tl.constexpr,
                 QBLOCK2: tl.constexpr):
    """fp32 scales of quantization blocks ``qblock`` (undoing double quantization: code2[q] * absmax2 + offset)."""
    if NESTED:
        qa = tl.load(absmax_ptr + qblock, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qa, mask=mask, other=0.0) * tl.load(absmax2_ptr + qblock // QBLOCK2, mask=mask,
                                                                        other=0.0) + offset
    else:
        scale = tl.load(absmax_ptr + qblock, mask=mask, other=0.0).to(tl.float32)
    return scale


@triton.jit
def unpack(byte, t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, COLS // 2]`` int32 packed bytes -> ``[ROWS, COLS]`` fp32 code values, high nibble first."""
    return tl.reshape(tl.join(lookup(byte >> 4, t), lookup(byte & 0xF, t)), (ROWS, COLS))


@triton.jit
def weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset, t, rows, row_ok, k0, K,
                QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """fp32 ``W[rows, k0 : k0 + BLOCK_K]`` of an ``N × K`` 4-bit weight, decoded in registers.

    Needs ``K % QBLOCK == 0`` and ``QBLOCK % BLOCK_K == 0`` with ``k0`` a multiple of ``BLOCK_K``: then every row
    of the tile lies in one quantization block (one scale per row) and no column mask is needed. ``rows`` are
    int64 (an ``N × K`` weight may pass 2³¹ elements).
    """
    start = rows * K + k0
    half = tl.arange(0, BLOCK_K // 2)
    byte = tl.load(w_ptr + (start // 2)[:, None] + half[None, :], mask=row_ok[:, None], other=0).to(tl.int32)
    scale = block_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset, start // QBLOCK, row_ok, NESTED, QBLOCK2)
    return unpack(byte, t, ROWS, BLOCK_K) * scale[:, None]


def cached_state(quant_state, device: torch.device) -> KernelQuantState:
    """:func:`kernel_quant_state`, kept on the quant state per device (reading ``offset`` syncs with the GPU).

    Args:
        quant_state: A bitsandbytes ``QuantState`` (read by attribute).
        device: Where the kernel runs.
    """
    # Stale when the scales or the double-quant offset are replaced or changed in place (a requantize builds a new
    # state anyway); writes through ``.data`` bump no version and are not seen.
    offset = getattr(quant_state, "offset", None)
    key = (str(device), quant_state.absmax.data_ptr(), quant_state.absmax._version,
           (offset.data_ptr(), offset._version) if isinstance(offset, torch.Tensor) else offset)
    cached = getattr(quant_state, "_peftplug_kernel_state", None)
    if cached is None or cached[0] != key:
        cached = (key, kernel_quant_state(quant_state, device))
        try:
            quant_state._peftplug_kernel_state = cached
        except AttributeError:  # a state object that takes no attributes: convert on every call
            pass
    return cached[1]
