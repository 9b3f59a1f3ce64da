"""Pure-torch reference for y = (x R) deq(W)ᵀ + bias over a bitsandbytes 4-bit weight (the oracle, the CPU path).

The 4-bit format and its dequantization live in :mod:`peftplug_kernels.nf4_dequantize.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from peftplug_kernels.block_rotate.reference import block_rotate
from peftplug_kernels.nf4_dequantize.reference import dequantize_4bit


def nf4_rotate_matmul(x: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                      bias: torch.Tensor | None = None, rotate=block_rotate, dequantize=dequantize_4bit) -> torch.Tensor:
    """``y = block_rotate(x, R) @ deq(W)ᵀ + bias`` in ``x``'s dtype (what rotate + ``bnb.matmul_4bit`` computes).

    Args:
        x: ``[..., in]`` activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its ``QuantState``.
        bias: Optional ``[out]`` bias.
        rotate: ``rotate(x, rotation)``; the torch reference by default (``peftplug_kernels.ops`` passes its
            dispatching op when ``auto`` leaves this layer unfused).
        dequantize: ``dequantize(weight, quant_state, dtype)``; the torch reference by default.
    """
    rotated = rotate(x, rotation)
    w = dequantize(weight, quant_state, x.dtype)
    return F.linear(rotated, w, None if bias is None else bias.to(x.dtype))
