"""Pure-torch reference for the Cayley / Cayley–Neumann map (the CPU path and the test oracle).

Conventions (row vectors, ``x' = x R``):
    Q is skew-symmetric, stored as its strict upper triangle (``triu_indices(b, b, 1)`` order): Q = U - Uᵀ.
    Exact Cayley: R = (I + Q)(I - Q)⁻¹. Orthogonal for every skew-symmetric Q; R = I at Q = 0.
    ``"cayley_neumann"`` (Taylor form): R ≈ I + 2 Σ_{k=1..n-1} Qᵏ, the Taylor series of the exact map
        truncated after ``n - 1`` powers; error O(‖Q‖ⁿ).
    ``"peft_cn"`` (PEFT's product form): R ≈ (I + Q)(I + Q + … + Q^{n-2}) = I + 2Q + … + 2Q^{n-2} + Q^{n-1};
        same cost, error O(‖Q‖^{n-1}). Identical to ``peft.tuners.oft`` with ``num_cayley_neumann_terms=n`` for
        n >= 4; PEFT 0.21 computes I + 2Q for n = 2 and the n = 4 polynomial for n = 3 (``oftv2.interop``
        maps those cases).
Both series converge only for ‖Q‖₂ < 1.
"""

from __future__ import annotations

import functools

import torch

FORMS = ("cayley_neumann", "cayley", "peft_cn")


def triangle_size(block_size: int) -> int:
    """Number of stored parameters of one ``block_size`` × ``block_size`` skew-symmetric block."""
    return block_size * (block_size - 1) // 2


def block_size_from_triangle(n_elements: int) -> int:
    """Inverse of :func:`triangle_size`.

    Args:
        n_elements: Length of a strict-upper-triangle vector.

    Raises:
        ValueError: If no block size has that many strict-upper-triangle entries.
    """
    b = round((1 + (1 + 8 * n_elements) ** 0.5) / 2)
    if triangle_size(b) != n_elements:
        raise ValueError(f"{n_elements} is not b(b-1)/2 for any block size b")
    return b


def _indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Under torch.compile: built inline (dynamo cannot trace the cache; Inductor folds the constant indices).
    if torch.compiler.is_compiling():
        rows, cols = torch.triu_indices(block_size, block_size, 1, device=device)
        return rows, cols
    return _triu_indices(block_size, device)


@functools.lru_cache(maxsize=64)
def _triu_indices(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached in eager mode: every forward of every adapted layer unpacks its triangles, and building the index
    # tensors is a measurable share of a small layer's step on CPU. Built outside inference mode whatever the
    # caller's mode: inference tensors in the cache could never be saved for backward by a later training forward.
    with torch.inference_mode(False):
        rows, cols = torch.triu_indices(block_size, block_size, 1, device=device)
    return rows, cols


def skew_from_triangle(q_vec: torch.Tensor, block_size: int) -> torch.Tensor:
    """Unpacks strict-upper-triangle vectors into skew-symmetric matrices.

    Args:
        q_vec: ``[..., b(b-1)/2]`` triangle entries.
        block_size: b.

    Returns:
        ``[..., b, b]`` with Q[i, j] = q for i < j and Q[j, i] = -q.
    """
    if q_vec.shape[-1] != triangle_size(block_size):
        raise ValueError(
            f"triangle vector has {q_vec.shape[-1]} entries; block size {block_size} needs "
            f"{triangle_size(block_size)}"
        )
    rows, cols = _indices(block_size, q_vec.device)
    upper = q_vec.new_zeros(*q_vec.shape[:-1], block_size, block_size)
    upper[..., rows, cols] = q_vec
    return upper - upper.transpose(-1, -2)


def triangle_from_skew(q: torch.Tensor) -> torch.Tensor:
    """Packs skew-symmetric matrices ``[..., b, b]`` into their strict upper triangles ``[..., b(b-1)/2]``."""
    rows, cols = _indices(q.shape[-1], q.device)
    return q[..., rows, cols]


def cayley_from_skew(q: torch.Tensor, form: str = "cayley_neumann", terms: int = 5) -> torch.Tensor:
    """Maps skew-symmetric matrices to rotation blocks.

    Args:
        q: ``[..., b, b]`` skew-symmetric matrices.
        form: ``"cayley_neumann"`` (Taylor), ``"cayley"`` (exact, via solve) or ``"peft_cn"`` (PEFT's form).
        terms: Series length n for the two Neumann forms (highest power n - 1); ignored by ``"cayley"``.

    Returns:
        ``[..., b, b]`` rotation blocks R, in the dtype of ``q``.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device).expand_as(q)
    if form == "cayley":
        # R = (I + Q)(I - Q)^-1  <=>  R (I - Q) = I + Q: solve from the right. Solve in fp32 at least.
        work = q if q.dtype in (torch.float32, torch.float64) else q.float()
        eye_w = eye.to(work.dtype)
        return torch.linalg.solve(eye_w - work, eye_w + work, left=False).to(q.dtype)
    result = eye
    power = None
    for k in range(1, terms):
        # bmm directly for the usual [n_blocks, b, b]: matmul's batched path adds expand/view ops per power.
        power = q if power is None else (torch.bmm(power, q) if q.dim() == 3 else power @ q)
        # Taylor: every power has coefficient 2. Product form: the last one has coefficient 1.
        coeff = 1.0 if (form == "peft_cn" and k == terms - 1) else 2.0
        # One op per term with alpha (``result + coeff * power`` is two, with their autograd nodes); out of place,
        # so the function stays usable under torch.func.vmap.
        result = torch.add(result, power, alpha=coeff)
    return result.contiguous()  # a copy only for terms == 1, where result is still the expanded identity


def cayley_neumann(q_vec: torch.Tensor, block_size: int, terms: int = 5, form: str = "cayley_neumann"):
    """Triangle vectors ``[n_blocks, b(b-1)/2]`` -> rotation blocks ``[n_blocks, b, b]``.

    Args:
        q_vec: Strict-upper-triangle entries of each block's Q.
        block_size: b.
        terms: Series length (see module docstring).
        form: One of :data:`FORMS`.
    """
    return cayley_from_skew(skew_from_triangle(q_vec, block_size), form=form, terms=terms)
