"""Tile-size helpers shared by the Triton kernels (no Triton import: the wrappers call these)."""

from __future__ import annotations

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def block_tile(b: int) -> int:
    """Tile edge holding one rotation block: a power of two >= 16 (``tl.dot`` needs every dimension >= 16).

    Non-power-of-two block sizes (e.g. 12, 24) are padded and masked.
    """
    return max(16, next_pow2(b))


def dot_precision(*tensors: torch.Tensor) -> str:
    """``tl.dot`` input precision on GPU: exact fp32 (``"ieee"``) for fp32 inputs, TF32 when the result is
    rounded to a half type anyway (its error is below the output's rounding)."""
    return "ieee" if all(t.dtype in (torch.float32, torch.float64) for t in tensors) else "tf32"
