"""Autograd wrapper of the Triton block rotation, with a fused backward.

Forward ``x' = x R`` block-wise. Backward: ``dX = dX' Rᵀ`` and ``dR_blk = Σ_tokens x_blkᵀ dX'_blk`` in one kernel
(``block_rotate_backward``); a shared ``[1, b, b]`` block also sums over blocks.
"""

from __future__ import annotations

import torch

from peftplug_kernels._function_guards import guarded_backward, guarded_forward
from peftplug_kernels._triton_available import load_kernel_module


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> contiguous ``[rows, d]``: the 2-D layout every kernel of this package reads.

    Args:
        t: Any tensor.
    """
    return t.reshape(-1, t.shape[-1]).contiguous()


class BlockRotateFunction(torch.autograd.Function):
    """``BlockRotateFunction.apply(x, rotation)``: the eager Triton path of :func:`peftplug_kernels.ops.block_rotate`
    (under ``torch.compile`` the custom op ``torch.ops.peftplug.block_rotate`` runs instead)."""

    @staticmethod
    @guarded_forward
    def forward(ctx, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        kernel = load_kernel_module("block_rotate")
        rotation_c = rotation.contiguous()
        x2 = flat_rows(x)
        ctx.save_for_backward(x2, rotation_c)
        ctx.x_shape = x.shape
        return kernel.block_matmul(x2, rotation_c).reshape(x.shape)

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_out: torch.Tensor):
        kernel = load_kernel_module("block_rotate")
        x2, rotation = ctx.saved_tensors
        # dX and dR in one pass over x and dX' (one launch, not two).
        grad_x, grad_rot = kernel.block_rotate_backward(x2, flat_rows(grad_out), rotation, *ctx.needs_input_grad[:2])
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        if grad_rot is not None:
            grad_rot = grad_rot.to(rotation.dtype)
        return grad_x, grad_rot
