"""Pure-torch reference for the block-diagonal input rotation x' = x R.

``x`` is ``[..., n_blocks * b]``; ``R`` is ``[n_blocks, b, b]`` (or ``[1, b, b]``, shared by every block).
Each length-b slice of x is multiplied by its block: ``x'[..., i, :] = x[..., i, :] @ R[i]``.
"""

from __future__ import annotations

import torch


def block_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotates the last dimension of ``x`` block-wise.

    Accumulates in fp32 for half-precision inputs (as the fused kernel does) and returns ``x``'s dtype.

    Args:
        x: ``[..., n_blocks * b]`` input.
        rotation: ``[n_blocks, b, b]`` blocks, or ``[1, b, b]`` to share one block across the width.

    Returns:
        ``[..., n_blocks * b]`` rotated input, dtype of ``x``.
    """
    n_blocks, b, b2 = rotation.shape
    if b != b2:
        raise ValueError(f"rotation blocks must be square, got {tuple(rotation.shape)}")
    width = x.shape[-1]
    if width % b != 0:
        raise ValueError(f"input width {width} is not a multiple of the block size {b}")
    # Not ``n_blocks not in (1, width // b)``: dynamo (torch 2.13) evaluates ``in`` over a tuple holding a symbolic
    # width as False, so that form refused every valid input under torch.compile(dynamic=True).
    if n_blocks != 1 and n_blocks != width // b:
        raise ValueError(f"{n_blocks} rotation blocks do not fit input width {width} with block size {b}")
    compute = torch.promote_types(x.dtype, torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xb = x.reshape(*x.shape[:-1], width // b, b).to(compute)
    rb = rotation.to(compute)
    if n_blocks == 1:
        out = xb @ rb[0]
    else:
        out = torch.einsum("...rk,rkc->...rc", xb, rb)
    return out.reshape(x.shape).to(x.dtype)
