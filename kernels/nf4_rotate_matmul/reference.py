"""Pure-torch reference for y = (x R) deq(W)ᵀ + bias over a bitsandbytes 4-bit weight (the oracle, the CPU path).

The 4-bit format (bitsandbytes ``quantize_4bit``; checked against 0.50): ``W`` (out × in) is flattened row-major
and packed two codes per byte, the *high* nibble first. Element ``e`` dequantizes to
``code[nibble(e)] * absmax[e // blocksize]`` in fp32, then is cast to the state's dtype. ``code`` is the 16-entry
NF4 or FP4 table. With double quantization ("nested", ``compress_statistics=True``) ``absmax`` is itself stored
as uint8 codes: ``absmax[j] = state2.code[qabsmax[j]] * state2.absmax[j // state2.blocksize] + offset``.

The quant state is read by attribute (``absmax, code, blocksize, shape, dtype, nested, offset, state2``), so this
module never imports bitsandbytes; the tests check it equals ``bitsandbytes.functional.dequantize_4bit``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.block_rotate.reference import block_rotate


def packed_bytes(weight: torch.Tensor) -> torch.Tensor:
    """The packed 4-bit weight as a flat uint8 tensor (bitsandbytes may store it in another ``quant_storage``).

    Args:
        weight: ``Params4bit`` data, ``[(out*in + 1) // 2, 1]``.
    """
    flat = weight.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def dequantize_absmax(quant_state) -> torch.Tensor:
    """The per-block fp32 scales, undoing double quantization when the state is nested.

    Args:
        quant_state: A bitsandbytes ``QuantState`` of a 4-bit weight.
    """
    if not getattr(quant_state, "nested", False):
        return quant_state.absmax.float()
    inner = quant_state.state2
    codes = quant_state.absmax.reshape(-1).long()
    scales = inner.absmax.float().repeat_interleave(inner.blocksize)[: codes.numel()]
    return inner.code.float().to(codes.device)[codes] * scales + quant_state.offset


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantizes a bitsandbytes 4-bit (NF4 or FP4) weight in pure torch.

    Args:
        weight: Packed weight (``Params4bit`` data).
        quant_state: Its ``QuantState``.
        dtype: Output dtype; the state's dtype by default.

    Returns:
        ``quant_state.shape`` tensor.
    """
    shape = tuple(quant_state.shape)
    n = math.prod(shape)
    packed = packed_bytes(weight)
    # Lean on memory (this also runs in the fused kernel's backward on GPU): uint8 nibbles, int32 indices and a
    # per-block broadcast of the scales instead of int64 codes and an n-long repeated scale vector.
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:n]
    values = quant_state.code.float().to(packed.device)[codes.int()]
    absmax = dequantize_absmax(quant_state)
    blocksize = int(quant_state.blocksize)
    values = F.pad(values, (0, absmax.numel() * blocksize - n)).view(-1, blocksize)
    return (values * absmax.view(-1, 1)).reshape(-1)[:n].reshape(shape).to(dtype or quant_state.dtype)


def nf4_rotate_matmul(x: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = block_rotate(x, R) @ deq(W)ᵀ + bias`` in ``x``'s dtype (what rotate + ``bnb.matmul_4bit`` computes).

    Args:
        x: ``[..., in]`` activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its ``QuantState``.
        bias: Optional ``[out]`` bias.
    """
    rotated = block_rotate(x, rotation)
    w = dequantize_4bit(weight, quant_state, dtype=x.dtype)
    return F.linear(rotated, w, None if bias is None else bias.to(x.dtype))
