"""A bitsandbytes ``QuantState`` flattened into the tensors, ints and dtype a ``torch.library`` op can take.

Custom ops accept only tensors, scalars, strings, dtypes and lists of them, and a ``QuantState`` is a Python object.
:func:`flatten_quant_state` reads one (by attribute: bitsandbytes is never imported here) into a
:class:`FlatQuantState`; :func:`state_view` turns that back into an object with the attributes the Triton wrappers and
the torch reference read. Nothing here converts a tensor to a Python number, so flattening traces under
``torch.compile(fullgraph=True)``: the double-quantization offset stays a 0-d tensor until the kernel launch.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch


class FlatQuantState(NamedTuple):
    """The fields of a 4-bit quant state a kernel reads.

    Attributes:
        absmax: Per-block scales, or their uint8 codes when double-quantized.
        code: The 16-entry NF4/FP4 table.
        absmax2: Scales of the scales when double-quantized, else ``None``.
        code2: The 256-entry table of the scales when double-quantized, else ``None``.
        offset: 0-d tensor added to dequantized scales when double-quantized, else ``None``.
        blocksize: Elements per quantization block.
        blocksize2: Scales per second-level block when double-quantized, else 0.
        shape: ``[out, in]`` of the dequantized weight.
        dtype: The dequantized weight's default dtype.
    """

    absmax: torch.Tensor
    code: torch.Tensor
    absmax2: torch.Tensor | None
    code2: torch.Tensor | None
    offset: torch.Tensor | None
    blocksize: int
    blocksize2: int
    shape: list[int]
    dtype: torch.dtype


def flatten_quant_state(quant_state) -> FlatQuantState:
    """Reads a bitsandbytes ``QuantState`` of a 4-bit weight into a :class:`FlatQuantState`.

    Args:
        quant_state: ``Linear4bit.weight.quant_state`` (or any object with its attributes).
    """
    shape = [int(s) for s in quant_state.shape]
    if not getattr(quant_state, "nested", False):
        return FlatQuantState(quant_state.absmax, quant_state.code, None, None, None, int(quant_state.blocksize), 0,
                              shape, quant_state.dtype)
    inner = quant_state.state2
    offset = quant_state.offset
    if not isinstance(offset, torch.Tensor):
        offset = torch.tensor(float(offset), device=quant_state.absmax.device)
    return FlatQuantState(quant_state.absmax, quant_state.code, inner.absmax, inner.code, offset,
                          int(quant_state.blocksize), int(inner.blocksize), shape, quant_state.dtype)


def state_view(absmax: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor | None, code2: torch.Tensor | None,
               offset: torch.Tensor | None, blocksize: int, blocksize2: int, shape: list[int],
               dtype: torch.dtype) -> SimpleNamespace:
    """An object with a ``QuantState``'s attributes, rebuilt from the fields of a :class:`FlatQuantState`.

    Args:
        absmax: See :class:`FlatQuantState` (same for the other arguments).
        code: The 4-bit code table.
        absmax2: Second-level scales or ``None``.
        code2: Second-level table or ``None``.
        offset: Double-quantization offset or ``None``.
        blocksize: Quantization block size.
        blocksize2: Second-level block size.
        shape: ``[out, in]``.
        dtype: Default output dtype.
    """
    nested = absmax2 is not None
    state2 = SimpleNamespace(absmax=absmax2, code=code2, blocksize=blocksize2) if nested else None
    return SimpleNamespace(absmax=absmax, code=code, blocksize=blocksize, shape=torch.Size(shape), dtype=dtype,
                           nested=nested, offset=offset if nested else None, state2=state2)
