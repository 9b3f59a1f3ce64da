"""Public entry points of the kernels package, with implementation dispatch.

``impl="auto"`` uses the fused Triton kernel when Triton is available and the tensors are on CUDA, the pure
torch reference otherwise; ``"torch"`` and ``"triton"`` force one (tests and benchmarks). ``"triton"`` on CPU
works only in interpreter mode (``TRITON_INTERPRET=1`` set before the first kernel import). Kernel modules are
imported lazily, on first use, so importing this module never imports Triton.
"""

from __future__ import annotations

import math

import torch

from peftplug_kernels._triton_available import load_kernel_module, triton_available, triton_usable
from peftplug_kernels.block_rotate import reference as _rotate_ref
from peftplug_kernels.cayley_neumann import reference as _cn_ref
from peftplug_kernels.nf4_dequantize import reference as _deq_ref
from peftplug_kernels.nf4_rotate_matmul import reference as _nf4_ref

IMPLS = ("auto", "torch", "triton")
# Largest rotation blocks the register-resident Cayley–Neumann and fused NF4 kernels handle.
CN_TRITON_MAX_BLOCK = 64
NF4_TRITON_MAX_BLOCK = 128
# The fused kernel indexes the packed weight with int32 (int64 would cost registers on every tile); no 4-bit layer
# of a released model comes near this (a 128k-vocabulary × 16k head would, and bitsandbytes skips heads).
NF4_TRITON_MAX_ELEMENTS = 2**31 - 1


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def resolve_impl(impl: str, *tensors: torch.Tensor, op: str = "block_rotate") -> str:
    """Chooses ``"torch"`` or ``"triton"`` for ``impl`` given the tensors an op will read.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        *tensors: The op's inputs (their device decides ``"auto"``).
        op: Kernel sub-package whose Triton module would run (checked for interpreter mode on CPU).

    Raises:
        ValueError: For an unknown ``impl``.
        RuntimeError: If ``impl="triton"`` is forced where the kernel cannot run (says why).
    """
    _check_impl(impl)
    if impl == "torch":
        return "torch"
    if impl == "auto":
        on_cuda = all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
        return "triton" if on_cuda and triton_available() else "torch"
    ok, why = triton_usable(op, *tensors)
    if not ok:
        raise RuntimeError(f"impl='triton' cannot run here: {why}")
    return "triton"


def cayley_neumann(
    q_vec: torch.Tensor, block_size: int, terms: int = 5, form: str = "cayley_neumann", impl: str = "auto"
) -> torch.Tensor:
    """Triangle vectors ``[n_blocks, b(b-1)/2]`` -> rotation blocks ``[n_blocks, b, b]``.

    The exact ``"cayley"`` form needs a linear solve and always runs the reference (``impl="triton"`` with it is
    an error); the two Neumann forms have a fused kernel for blocks up to :data:`CN_TRITON_MAX_BLOCK`.

    Args:
        q_vec: Strict-upper-triangle entries of each block's skew-symmetric Q.
        block_size: b.
        terms: Series length n (highest power n - 1) for the Neumann forms.
        form: ``"cayley_neumann"`` (Taylor), ``"cayley"`` (exact) or ``"peft_cn"`` (PEFT's product form).
        impl: See module docstring.
    """
    if form not in _cn_ref.FORMS:
        raise ValueError(f"form must be one of {_cn_ref.FORMS}, got {form!r}")
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    if q_vec.dim() != 2 or q_vec.shape[-1] != _cn_ref.triangle_size(block_size):
        raise ValueError(
            f"q_vec must be [n_blocks, {_cn_ref.triangle_size(block_size)}] for block_size {block_size}, "
            f"got {tuple(q_vec.shape)}"
        )
    kernel_fits = form != "cayley" and 2 <= block_size <= CN_TRITON_MAX_BLOCK
    if impl == "triton" and not kernel_fits:
        raise ValueError(
            f"the Triton Cayley-Neumann kernel supports forms 'cayley_neumann'/'peft_cn' and block_size in "
            f"[2, {CN_TRITON_MAX_BLOCK}]; got form={form!r}, block_size={block_size}"
        )
    if kernel_fits and resolve_impl(impl, q_vec, op="cayley_neumann") == "triton":
        from peftplug_kernels.cayley_neumann.function import cayley_neumann as fused

        return fused(q_vec, block_size, terms, form)
    _check_impl(impl)
    return _cn_ref.cayley_neumann(q_vec, block_size, terms=terms, form=form)


def _check_rotation(width: int, rotation: torch.Tensor) -> None:
    if rotation.dim() != 3 or rotation.shape[1] != rotation.shape[2]:
        raise ValueError(f"rotation must be [n_blocks, b, b], got {tuple(rotation.shape)}")
    n_blocks, b = rotation.shape[0], rotation.shape[1]
    if width % b != 0:
        raise ValueError(f"input width {width} is not a multiple of the block size {b}")
    if n_blocks not in (1, width // b):
        raise ValueError(f"{n_blocks} rotation blocks do not fit input width {width} with block size {b}")


def block_rotate(x: torch.Tensor, rotation: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x' = x R block-wise over the last dimension of ``x``.

    Args:
        x: ``[..., n_blocks * b]``.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` (shared block).
        impl: See module docstring.
    """
    _check_rotation(x.shape[-1], rotation)
    if resolve_impl(impl, x, rotation, op="block_rotate") == "triton":
        from peftplug_kernels.block_rotate.function import block_rotate as fused

        return fused(x, rotation)
    return _rotate_ref.block_rotate(x, rotation)


def nf4_kernel_unfit(block_size: int, weight_shape: tuple[int, ...]) -> str:
    """Why the fused NF4 kernel cannot take a layer (``""`` when it can).

    Args:
        block_size: Rotation block size b.
        weight_shape: ``(out, in)`` of the 4-bit weight.
    """
    if block_size > NF4_TRITON_MAX_BLOCK:
        return f"it supports rotation blocks up to {NF4_TRITON_MAX_BLOCK}, got {block_size}"
    if math.prod(weight_shape) > NF4_TRITON_MAX_ELEMENTS:
        return f"its int32 weight offsets cover up to 2³¹ - 1 elements, got {weight_shape}"
    return ""


def nf4_rotate_matmul(
    x: torch.Tensor,
    rotation: torch.Tensor,
    weight: torch.Tensor,
    quant_state,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """y = (x R) deq(W)ᵀ + bias for a bitsandbytes 4-bit (NF4 or FP4) weight, rotation fused in the GEMM.

    Args:
        x: ``[..., in]`` activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` blocks.
        weight: Packed 4-bit weight (``Linear4bit.weight``) of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute; bitsandbytes is not imported here).
        bias: Optional ``[out]`` bias.
        impl: See module docstring.

    Returns:
        ``[..., out]`` in ``x``'s dtype.
    """
    shape = tuple(quant_state.shape)
    if len(shape) != 2 or shape[1] != x.shape[-1]:
        raise ValueError(f"quant_state.shape {shape} does not match input width {x.shape[-1]}")
    _check_rotation(x.shape[-1], rotation)
    tensors = (x, rotation, weight) + (() if bias is None else (bias,))
    why_not = nf4_kernel_unfit(rotation.shape[-1], shape)
    if why_not:
        if impl == "triton":
            raise ValueError(f"the fused NF4 kernel cannot run this layer: {why_not}")
        _check_impl(impl)
        return _nf4_ref.nf4_rotate_matmul(x, rotation, weight, quant_state, bias)
    if resolve_impl(impl, *tensors, op="nf4_rotate_matmul") == "triton":
        from peftplug_kernels.nf4_rotate_matmul.function import nf4_rotate_matmul as fused

        return fused(x, rotation, weight, quant_state, bias)
    return _nf4_ref.nf4_rotate_matmul(x, rotation, weight, quant_state, bias)


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """deq(W) of a bitsandbytes 4-bit (NF4 or FP4) weight, with or without double quantization.

    Not differentiable (the codes are frozen). The Triton kernel writes only the output (2 bytes per element in
    half precision); the torch reference holds ≈19 bytes per element at its peak.

    Args:
        weight: Packed 4-bit weight (``Linear4bit.weight``).
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        dtype: Output dtype; the state's dtype by default.
        impl: See module docstring.

    Returns:
        ``quant_state.shape`` tensor.
    """
    if len(tuple(quant_state.shape)) != 2:
        raise ValueError(f"quant_state.shape must be (out, in), got {tuple(quant_state.shape)}")
    if resolve_impl(impl, weight, op="nf4_dequantize") == "triton":
        return load_kernel_module("nf4_dequantize").dequantize_4bit(weight, quant_state, dtype)
    return _deq_ref.dequantize_4bit(weight, quant_state, dtype)
