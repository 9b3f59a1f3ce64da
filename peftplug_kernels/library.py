"""The Triton kernels as PyTorch custom ops (``torch.ops.peftplug.*``), so ``torch.compile`` traces OFTv2 whole.

Registered with :func:`torch.library.custom_op` plus ``register_fake`` (shapes for tracing) and
``register_autograd`` (backward through more custom ops), not ``triton_op``: ``triton_op`` uses its body as the fake
kernel, and under ``TRITON_INTERPRET=1`` (our CPU tests) ``wrap_triton`` hands back the interpreted kernel, which
would then launch on fake tensors. An opaque custom op compiles the same on CPU and GPU, Inductor keeps our (already
fused) kernels as they are, and CUDA graphs capture them.

Ops (every tensor argument on one device; the kernel modules are imported on first call, so importing this module
imports no Triton):
    ``block_rotate(x, rotation, transpose)``                             ``x R`` (``x Rᵀ``) block-wise
    ``block_rotate_grad_rotation(x, grad, rotation_blocks, block_size)`` ``dR_blk = Σ x_blkᵀ dX'_blk`` (fp32)
    ``block_rotate_backward(x, grad, rotation)``                         ``(dX, dR)`` in one pass (dR fp32)
    ``cayley_neumann(q_vec, block_size, terms, form)``                   triangles → rotation blocks
    ``cayley_neumann_backward(q_vec, grad_r, terms, form)``              dL/dq (fp32)
    ``dequantize_4bit(weight, <flat state>, dtype)``                     deq(W), not differentiable
    ``nf4_rotate_matmul(x, rotation, weight, <flat state>, bias)``       ``(x R) deq(W)ᵀ + bias``
    ``nf4_grad_rotated_input(grad, weight, <flat state>)``               its backward's ``dY deq(W)``, ``[tokens, in]``
where ``<flat state>`` are the fields of :class:`peftplug_kernels.quant_state.FlatQuantState`.

The public functions at the bottom are what :mod:`peftplug_kernels.ops` calls for ``impl="triton"``. In eager mode
they call the autograd Functions of ``*/function.py`` directly when :data:`EAGER_BYPASS` is set: the dispatcher costs
CPU time per call (docs/kernels.md, "Dispatch"), and OFTv2 on a GPU is bound by CPU time per layer. Under
``torch.compile`` they call the ops.
"""

from __future__ import annotations

import torch

from peftplug_kernels._triton_available import load_kernel_module
from peftplug_kernels.block_rotate.function import BlockRotateFunction, flat_rows
from peftplug_kernels.cayley_neumann.function import CayleyNeumannFunction
from peftplug_kernels.nf4_rotate_matmul.function import NF4RotateMatmulFunction
from peftplug_kernels.quant_state import flatten_quant_state, state_view

# Eager calls skip the dispatcher (docs/kernels.md, "Dispatch": measured cheaper per call).
EAGER_BYPASS = True


# ------------------------------------------------------------------------------------------------ block_rotate
@torch.library.custom_op("peftplug::block_rotate", mutates_args=())
def _block_rotate_op(x: torch.Tensor, rotation: torch.Tensor, transpose: bool) -> torch.Tensor:
    kernel = load_kernel_module("block_rotate")
    return kernel.block_matmul(flat_rows(x), rotation.contiguous(), transpose=transpose).reshape(x.shape)


@_block_rotate_op.register_fake
def _(x, rotation, transpose):
    return x.new_empty(x.shape)


@torch.library.custom_op("peftplug::block_rotate_grad_rotation", mutates_args=())
def _grad_rotation_op(x: torch.Tensor, grad: torch.Tensor, rotation_blocks: int, block_size: int) -> torch.Tensor:
    kernel = load_kernel_module("block_rotate")
    return kernel.block_grad_rotation(flat_rows(x), flat_rows(grad), rotation_blocks, block_size)


@_grad_rotation_op.register_fake
def _(x, grad, rotation_blocks, block_size):
    return x.new_empty(rotation_blocks, block_size, block_size, dtype=torch.float32)


@torch.library.custom_op("peftplug::block_rotate_backward", mutates_args=())
def _rotate_backward_op(x: torch.Tensor, grad: torch.Tensor,
                        rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = load_kernel_module("block_rotate")
    grad_x, grad_rot = kernel.block_rotate_backward(flat_rows(x), flat_rows(grad), rotation.contiguous())
    return grad_x.reshape(x.shape), grad_rot


@_rotate_backward_op.register_fake
def _(x, grad, rotation):
    return x.new_empty(x.shape), x.new_empty(rotation.shape, dtype=torch.float32)


def _rotate_setup(ctx, inputs, output):
    x, rotation, transpose = inputs
    ctx.save_for_backward(x, rotation)
    ctx.transpose = transpose


def _rotate_backward(ctx, grad):
    x, rotation = ctx.saved_tensors
    if not ctx.transpose and ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
        # The usual case: dX and dR in one pass over x and dX' (one launch).
        grad_x, grad_m = _rotate_backward_op(x, grad, rotation)
        return grad_x, grad_m.to(rotation.dtype), None
    grad_x = grad_rot = None
    if ctx.needs_input_grad[0]:
        # y = x M with M = R or Rᵀ, so dX = dY Mᵀ.
        grad_x = _block_rotate_op(grad, rotation, not ctx.transpose)
    if ctx.needs_input_grad[1]:
        grad_m = _grad_rotation_op(x, grad, rotation.shape[0], rotation.shape[-1])
        grad_rot = (grad_m.transpose(-1, -2) if ctx.transpose else grad_m).to(rotation.dtype)
    return grad_x, grad_rot, None


_block_rotate_op.register_autograd(_rotate_backward, setup_context=_rotate_setup)


# ---------------------------------------------------------------------------------------------- cayley_neumann
@torch.library.custom_op("peftplug::cayley_neumann", mutates_args=())
def _cayley_neumann_op(q_vec: torch.Tensor, block_size: int, terms: int, form: str) -> torch.Tensor:
    return load_kernel_module("cayley_neumann").cayley_neumann_forward(q_vec.contiguous(), block_size, terms, form)


@_cayley_neumann_op.register_fake
def _(q_vec, block_size, terms, form):
    return q_vec.new_empty(q_vec.shape[0], block_size, block_size)


@torch.library.custom_op("peftplug::cayley_neumann_backward", mutates_args=())
def _cayley_neumann_backward_op(q_vec: torch.Tensor, grad_r: torch.Tensor, terms: int, form: str) -> torch.Tensor:
    kernel = load_kernel_module("cayley_neumann")
    return kernel.cayley_neumann_backward(q_vec.contiguous(), grad_r.float().contiguous(), terms, form)


@_cayley_neumann_backward_op.register_fake
def _(q_vec, grad_r, terms, form):
    return q_vec.new_empty(q_vec.shape, dtype=torch.float32)


def _cn_setup(ctx, inputs, output):
    q_vec, _, terms, form = inputs
    ctx.save_for_backward(q_vec)
    ctx.terms, ctx.form = terms, form


def _cn_backward(ctx, grad_r):
    (q_vec,) = ctx.saved_tensors
    grad_q = None
    if ctx.needs_input_grad[0]:
        grad_q = _cayley_neumann_backward_op(q_vec, grad_r, ctx.terms, ctx.form).to(q_vec.dtype)
    return grad_q, None, None, None


_cayley_neumann_op.register_autograd(_cn_backward, setup_context=_cn_setup)


# ----------------------------------------------------------------------------------------------------- 4-bit
@torch.library.custom_op("peftplug::dequantize_4bit", mutates_args=())
def _dequantize_op(weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor | None,
                   code2: torch.Tensor | None, offset: torch.Tensor | None, blocksize: int, blocksize2: int,
                   shape: list[int], state_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    state = state_view(absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype)
    return load_kernel_module("nf4_dequantize").dequantize_4bit(weight, state, dtype)


@_dequantize_op.register_fake
def _(weight, absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype, dtype):
    return weight.new_empty(shape, dtype=dtype)


@torch.library.custom_op("peftplug::nf4_rotate_matmul", mutates_args=())
def _nf4_op(x: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
            absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: torch.Tensor | None, blocksize: int,
            blocksize2: int, shape: list[int], state_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    state = state_view(absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype)
    kernel = load_kernel_module("nf4_rotate_matmul")
    y = kernel.rotate_dequant_matmul(flat_rows(x), rotation.contiguous(), weight, state, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@_nf4_op.register_fake
def _(x, rotation, weight, absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype, bias):
    return x.new_empty(*x.shape[:-1], shape[0])


@torch.library.custom_op("peftplug::nf4_grad_rotated_input", mutates_args=())
def _nf4_grad_op(grad: torch.Tensor, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                 absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: torch.Tensor | None, blocksize: int,
                 blocksize2: int, shape: list[int], state_dtype: torch.dtype) -> torch.Tensor:
    state = state_view(absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype)
    return load_kernel_module("nf4_rotate_matmul").grad_rotated_input(flat_rows(grad), weight, state)


@_nf4_grad_op.register_fake
def _(grad, weight, absmax, code, absmax2, code2, offset, blocksize, blocksize2, shape, state_dtype):
    return grad.new_empty(grad.numel() // grad.shape[-1], shape[1])


def _nf4_setup(ctx, inputs, output):
    x, rotation, weight, *state, bias = inputs
    ctx.save_for_backward(x, rotation, weight, *state[:5])
    ctx.scalars = state[5:]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _nf4_backward(ctx, grad):
    x, rotation, weight, *tensors = ctx.saved_tensors
    grad_x = grad_rot = grad_bias = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        # dX' = dY deq(W), [tokens, in] (the 4-bit codes are frozen): fused for few tokens, else W dequantized once
        # in the gradient's dtype and one matmul (the rule lives in the kernel module's grad_rotated_input).
        grad_rotated = _nf4_grad_op(grad, weight, *tensors, *ctx.scalars).reshape(x.shape)
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            grad_x, grad_rot = _rotate_backward_op(x, grad_rotated, rotation)
            grad_rot = grad_rot.to(rotation.dtype)
        elif ctx.needs_input_grad[0]:
            grad_x = _block_rotate_op(grad_rotated, rotation, True)
        else:
            grad_rot = _grad_rotation_op(x, grad_rotated, rotation.shape[0], rotation.shape[-1]).to(rotation.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[-1]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)
    return (grad_x, grad_rot) + (None,) * 10 + (grad_bias,)


_nf4_op.register_autograd(_nf4_backward, setup_context=_nf4_setup)


# ---------------------------------------------------------------------------------------- what ops.py calls
def _eager() -> bool:
    return EAGER_BYPASS and not torch.compiler.is_compiling()


def block_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Differentiable Triton block rotation ``x R`` (shapes validated by :func:`peftplug_kernels.ops.block_rotate`).

    Args:
        x: ``[..., n_blocks * b]``.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]``.
    """
    if _eager():
        return BlockRotateFunction.apply(x, rotation)
    return _block_rotate_op(x, rotation, False)


def cayley_neumann(q_vec: torch.Tensor, block_size: int, terms: int, form: str) -> torch.Tensor:
    """Differentiable Triton Cayley–Neumann map (arguments validated by :func:`peftplug_kernels.ops.cayley_neumann`).

    Args:
        q_vec: ``[n_blocks, b(b-1)/2]``.
        block_size: b.
        terms: Series length n.
        form: ``"cayley_neumann"`` or ``"peft_cn"``.
    """
    if _eager():
        return CayleyNeumannFunction.apply(q_vec, block_size, terms, form)
    return _cayley_neumann_op(q_vec, block_size, terms, form)


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None) -> torch.Tensor:
    """Triton deq(W) of a bitsandbytes 4-bit weight (see :func:`peftplug_kernels.ops.dequantize_4bit`).

    Args:
        weight: Packed 4-bit weight.
        quant_state: Its ``QuantState`` (read by attribute).
        dtype: Output dtype; the state's dtype when ``None``.
    """
    if _eager():
        return load_kernel_module("nf4_dequantize").dequantize_4bit(weight, quant_state, dtype)
    flat = flatten_quant_state(quant_state)
    return _dequantize_op(weight, *flat, dtype or flat.dtype)


def nf4_rotate_matmul(x: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """Differentiable fused ``(x R) deq(W)ᵀ + bias`` (see :func:`peftplug_kernels.ops.nf4_rotate_matmul`).

    Args:
        x: ``[..., in]``.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]``.
        weight: Packed 4-bit weight.
        quant_state: Its ``QuantState``.
        bias: Optional ``[out]``.
    """
    if _eager():
        return NF4RotateMatmulFunction.apply(x, rotation, weight, quant_state, bias)
    return _nf4_op(x, rotation, weight, *flatten_quant_state(quant_state), bias)
