"""The composition the fused torch path must equal: rotation blocks from the triangles, block dropout, rotation.

The test oracle of :mod:`peftplug_kernels.cayley_rotate.function`, and the path of every form it has no program for.
"""

from __future__ import annotations

import torch

from peftplug_kernels.block_rotate.reference import block_rotate
from peftplug_kernels.cayley_neumann.reference import cayley_neumann


def drop_blocks(rotation: torch.Tensor, keep: torch.Tensor | None, n_blocks: int) -> torch.Tensor:
    """Replaces the dropped blocks of ``rotation`` by the identity.

    Args:
        rotation: ``[n_blocks, b, b]`` or one shared ``[1, b, b]`` block.
        keep: ``None`` (no dropout) or a ``[n_blocks, 1, 1]`` 0/1 mask; 0 drops the block.
        n_blocks: Blocks across the width.
    """
    if keep is None:
        return rotation
    b = rotation.shape[-1]
    eye = torch.eye(b, dtype=rotation.dtype, device=rotation.device)
    return torch.where(keep.bool(), rotation.expand(n_blocks, b, b), eye)


def cayley_rotate(
    x: torch.Tensor,
    q_vec: torch.Tensor,
    block_size: int,
    terms: int = 5,
    form: str = "cayley_neumann",
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x R`` block-wise with ``R`` the rotation of the triangles ``q_vec`` (dropped blocks ``I``).

    Args:
        x: ``[..., n_blocks · b]``.
        q_vec: ``[n_blocks, b(b-1)/2]`` or ``[1, b(b-1)/2]`` (shared block).
        block_size: b.
        terms: Series length of the Neumann forms.
        form: ``"cayley_neumann"``, ``"cayley"`` or ``"peft_cn"``.
        keep: ``None`` or a ``[n_blocks, 1, 1]`` 0/1 block-dropout mask.
    """
    rotation = cayley_neumann(q_vec, block_size, terms=terms, form=form)
    return block_rotate(x, drop_blocks(rotation, keep, x.shape[-1] // block_size))
