"""Public entry points of the kernels package, with implementation dispatch.

``impl="auto"`` uses the fused Triton kernel when Triton is available and the tensors are on CUDA, the pure
torch reference otherwise; ``"torch"`` and ``"triton"`` force one (tests and benchmarks).
"""

from __future__ import annotations

import torch

from kernels.block_rotate import reference as _rotate_ref
from kernels.cayley_neumann import reference as _cn_ref

IMPLS = ("auto", "torch", "triton")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """Chooses ``"torch"`` or ``"triton"`` for ``impl`` given the tensors an op will read.

    Args:
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        *tensors: The op's inputs (their device decides ``"auto"``).
    """
    _check_impl(impl)
    if impl == "auto":
        # Filled in by the Triton kernels: until then every op runs the reference.
        return "torch"
    if impl == "triton":
        raise NotImplementedError("the Triton kernels are not available in this build")
    return impl


def cayley_neumann(
    q_vec: torch.Tensor, block_size: int, terms: int = 5, form: str = "cayley_neumann", impl: str = "auto"
) -> torch.Tensor:
    """Triangle vectors ``[n_blocks, b(b-1)/2]`` -> rotation blocks ``[n_blocks, b, b]``.

    Args:
        q_vec: Strict-upper-triangle entries of each block's skew-symmetric Q.
        block_size: b.
        terms: Series length n (highest power n - 1) for the Neumann forms.
        form: ``"cayley_neumann"`` (Taylor), ``"cayley"`` (exact) or ``"peft_cn"`` (PEFT's product form).
        impl: See module docstring.
    """
    resolve_impl(impl, q_vec)
    return _cn_ref.cayley_neumann(q_vec, block_size, terms=terms, form=form)


def block_rotate(x: torch.Tensor, rotation: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x' = x R block-wise over the last dimension of ``x``.

    Args:
        x: ``[..., n_blocks * b]``.
        rotation: ``[n_blocks, b, b]`` or ``[1, b, b]`` (shared block).
        impl: See module docstring.
    """
    resolve_impl(impl, x, rotation)
    return _rotate_ref.block_rotate(x, rotation)
