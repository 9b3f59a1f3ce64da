"""Autograd wrapper of the Triton Cayley–Neumann map; the backward is folded to the triangle in the kernel."""

from __future__ import annotations

import torch

from peftplug_kernels._function_guards import guarded_backward, guarded_forward
from peftplug_kernels._triton_available import load_kernel_module


class CayleyNeumannFunction(torch.autograd.Function):
    """``CayleyNeumannFunction.apply(q_vec, block_size, terms, form)`` -> ``[n_blocks, b, b]``."""

    @staticmethod
    @guarded_forward
    def forward(ctx, q_vec: torch.Tensor, block_size: int, terms: int, form: str) -> torch.Tensor:
        kernel = load_kernel_module("cayley_neumann")
        q_c = q_vec.contiguous()
        ctx.save_for_backward(q_c)
        ctx.terms, ctx.form = terms, form
        return kernel.cayley_neumann_forward(q_c, block_size, terms, form)

    @staticmethod
    @guarded_backward
    def backward(ctx, grad_r: torch.Tensor):
        (q_c,) = ctx.saved_tensors
        grad_q = None
        if ctx.needs_input_grad[0]:
            kernel = load_kernel_module("cayley_neumann")
            grad_q = kernel.cayley_neumann_backward(q_c, grad_r.float().contiguous(), ctx.terms, ctx.form)
            grad_q = grad_q.to(q_c.dtype)
        return grad_q, None, None, None
