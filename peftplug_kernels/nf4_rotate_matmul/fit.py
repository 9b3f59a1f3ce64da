"""Which 4-bit layers the W4A16 kernels take, as a rule (no Triton import: dispatch code asks before loading).

The rule and the fallback for each case are tabled in docs/kernels.md ("Inputs the W4A16 kernels do not take").
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
MIN_QBLOCK = 64  # the kernels' smallest K step; a 4-bit tile row must lie in one quantization block


def w4a16_unfit(dtype: torch.dtype, weight_shape: tuple[int, ...], quant_state) -> str:
    """Why the W4A16 kernels cannot take a layer (``""`` when they can).

    Args:
        dtype: Activation dtype.
        weight_shape: ``(out, in)`` of the 4-bit weight.
        quant_state: Its bitsandbytes ``QuantState`` (``blocksize`` and ``code`` are read).
    """
    if dtype not in HALF_DTYPES:
        return f"its tensor-core dots take float16/bfloat16 activations, got {dtype}"
    code = getattr(quant_state, "code", None)
    if code is None or code.numel() != 16:
        return "it decodes 4-bit codes (a 16-entry NF4/FP4 table); this quant state has none"
    qblock = int(quant_state.blocksize)
    if qblock < MIN_QBLOCK or qblock & (qblock - 1):
        return f"it needs a quantization blocksize that is a power of two >= {MIN_QBLOCK}, got {qblock}"
    if len(weight_shape) != 2 or weight_shape[1] % qblock:
        return (f"the input width {weight_shape[-1]} is not a multiple of the quantization blocksize {qblock} "
                "(blocks would straddle rows)")
    return ""
