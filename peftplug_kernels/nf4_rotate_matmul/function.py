"""Autograd wrapper of the fused rotate + 4-bit matmul.

Forward: the fused Triton kernel. Backward (the 4-bit weight is frozen): ``dX' = dY deq(W)`` through
``grad_rotated_input`` (a fused kernel for few tokens, else W dequantized once in the gradient's dtype and one
matmul, as bitsandbytes' backward does), then the block-rotation backward kernel gives ``dX = dX' Rᵀ`` and ``dR = Σ x_blkᵀ dX'_blk``;
``dbias = Σ dY`` when the bias is trainable.
"""

from __future__ import annotations

import torch

from peftplug_kernels._function_guards import guarded_backward, guarded_forward
from peftplug_kernels._triton_available import load_kernel_module
from peftplug_kernels.block_rotate.function import flat_rows


class NF4RotateMatmulFunction(torch.autograd.Function):
    """``NF4RotateMatmulFunction.apply(x, rotation, weight, quant_state, bias)`` -> ``[..., out]``."""

    @staticmethod
    @guarded_forward
    def forward(ctx, x, rotation, weight, quant_state, bias):
        fused = load_kernel_module("nf4_rotate_matmul")
        x2 = flat_rows(x)
        rotation_c = rotation.contiguous()
        y = fused.rotate_dequant_matmul(x2, rotation_c, weight, quant_state, bias)
        ctx.save_for_backward(x2, rotation_c, weight)
        ctx.quant_state, ctx.x_shape, ctx.has_bias = quant_state, x.shape, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_out):
        rotate = load_kernel_module("block_rotate")
        fused = load_kernel_module("nf4_rotate_matmul")
        x2, rotation, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_rot = grad_bias = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # dX' = dY deq(W): fused (no dequantized weight in memory) for few tokens on layers the W4A16 kernels
            # take, else one-launch dequantize + one matmul (the rule lives in grad_rotated_input).
            grad_rotated = fused.grad_rotated_input(g2.contiguous(), weight, ctx.quant_state).contiguous()
            grad_x, grad_rot = rotate.block_rotate_backward(x2, grad_rotated, rotation, *ctx.needs_input_grad[:2])
            if grad_x is not None:
                grad_x = grad_x.reshape(ctx.x_shape)
            if grad_rot is not None:
                grad_rot = grad_rot.to(rotation.dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_bias = g2.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_rot, None, None, grad_bias
