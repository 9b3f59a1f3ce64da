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


def fit_tiles(block_t: int, block_n: int, num_warps: int, tokens: int, n: int, programs_wanted: int,
              bb: int = 32) -> tuple[int, int, int]:
    """Shrinks a GEMM's ``(BLOCK_T, BLOCK_N)`` tiles for small problems so the grid still fills the GPU.

    Decoding and small batches have few tokens: a 128-token tile would be mostly padding, and 128-wide output
    tiles over a 4096-wide layer make only 32 programs for 132 multiprocessors. The token tile shrinks to the
    token count (at least 16, ``tl.dot``'s minimum), then the output tile halves (down to 32) until there are
    ``programs_wanted`` programs. Small tiles get 4 warps when the rotation block is at most 32 wide; wider
    blocks keep every warp, since their ``[bb, bb]`` rotation tile alone fills the registers of 4 warps (it
    spilled in the sm_90 compile check).

    Args:
        block_t: Token tile for large problems.
        block_n: Output tile for large problems.
        num_warps: Warps for large problems.
        tokens: Rows of the activation.
        n: Output features.
        programs_wanted: Programs that fill the device (its multiprocessor count).
        bb: Rotation-block tile of the kernel.

    Returns:
        ``(block_t, block_n, num_warps)``.
    """
    block_t = min(block_t, max(16, next_pow2(tokens)))
    while block_n > 32 and -(-tokens // block_t) * -(-n // block_n) < programs_wanted:
        block_n //= 2
    return block_t, block_n, (4 if bb <= 32 and block_t * block_n <= 2048 else num_warps)
