"""Pure-torch reference for y = (x R) deq(W)ᵀ + bias over a bitsandbytes 4-bit weight (the oracle, the CPU path).

The 4-bit format and its dequantization live in :mod:`peftplug_kernels.nf4_dequantize.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from peftplug_kernels.block_rotate.reference import block_rotate
from peftplug_kernels.nf4_dequantize.reference import dequantize_4bit


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
