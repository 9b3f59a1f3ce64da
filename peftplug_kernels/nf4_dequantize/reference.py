"""Pure-torch dequantization of a bitsandbytes 4-bit (NF4/FP4) weight (the oracle and the CPU path).

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
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F


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


class KernelQuantState(NamedTuple):
    """A 4-bit quant state flattened into what the Triton kernels read (fp32 tables, int block sizes).

    Attributes:
        absmax: Per-block scales (fp32), or their uint8 codes when ``nested``.
        code: The 16-entry NF4/FP4 table (fp32).
        absmax2: Scales of the scales when nested (fp32), else ``absmax`` again (unused).
        code2: The 256-entry table of the scales when nested (fp32), else ``code`` again (unused).
        offset: Added to dequantized scales when nested, else 0.
        blocksize: Elements per quantization block.
        blocksize2: Scales per second-level block when nested, else 1.
        nested: Whether the scales are double-quantized.
    """

    absmax: torch.Tensor
    code: torch.Tensor
    absmax2: torch.Tensor
    code2: torch.Tensor
    offset: float
    blocksize: int
    blocksize2: int
    nested: bool


# offset tensor -> (its version counter, its value): see _offset_value.
_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _offset_value(offset) -> float:
    """``float(offset)`` without a device-to-host copy on every call.

    The kernels take the double-quantization offset as a scalar, and reading a CUDA tensor's value waits for the GPU
    to finish all queued work: on every fused forward and every dequantize that stalled the CPU of a launch-bound
    step, and it is not allowed while a CUDA graph is captured. A quant state's offset tensor lives as long as the
    layer, so its value is read once and cached; the version counter catches an in-place change.
    (``nf4_dequantize.tile.cached_state`` keeps the whole converted state on a bitsandbytes state object; this cache
    also covers the state that ``peftplug_kernels.library``'s ops rebuild from their flat arguments on every call.)

    Args:
        offset: The state's offset (a 0-d tensor in bitsandbytes, or a number).
    """
    if not isinstance(offset, torch.Tensor):
        return float(offset)
    try:
        version = offset._version
    except RuntimeError:  # inference tensors have no version counter: read it every time
        return float(offset)
    cached = _OFFSETS.get(offset)
    if cached is None or cached[0] != version:
        cached = (version, float(offset))
        _OFFSETS[offset] = cached
    return cached[1]


def kernel_quant_state(quant_state, device: torch.device) -> KernelQuantState:
    """Reads a bitsandbytes ``QuantState`` (by attribute) into the tensors the Triton kernels take.

    Args:
        quant_state: A bitsandbytes ``QuantState`` of a 4-bit weight.
        device: Where the kernel runs.
    """
    code = quant_state.code.to(device=device, dtype=torch.float32).contiguous()
    nested = bool(getattr(quant_state, "nested", False))
    if not nested:
        absmax = quant_state.absmax.to(device=device, dtype=torch.float32).contiguous()
        return KernelQuantState(absmax, code, absmax, code, 0.0, int(quant_state.blocksize), 1, False)
    inner = quant_state.state2
    return KernelQuantState(
        quant_state.absmax.to(device).contiguous(), code,
        inner.absmax.to(device=device, dtype=torch.float32).contiguous(),
        inner.code.to(device=device, dtype=torch.float32).contiguous(),
        _offset_value(quant_state.offset), int(quant_state.blocksize), int(inner.blocksize), True,
    )
