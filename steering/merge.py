"""Weighted merging of steering vectors (EasyEdit2's linear / TIES / DARE merge), via PEFT's merge utilities."""

from __future__ import annotations

import torch
from peft.utils import merge_utils

from peftplug.validation import check_real

COMBINATIONS = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")


def merge_vectors(
    vectors: list[torch.Tensor],
    weights: list[float],
    combination_type: str = "linear",
    density: float = 1.0,
    majority_sign_method: str = "total",
    seed: int = 0,
) -> torch.Tensor:
    """Merges same-shaped vectors into one.

    ``"linear"`` is ``sum_i w_i v_i``; ``"ties"`` trims each vector to its ``density`` largest-magnitude
    entries, elects a sign per entry and averages the agreeing ones (PEFT's TIES; a negative weight ``-w`` merges
    ``-v`` with weight ``w``, so signs are elected on what each vector adds); ``"dare_*"`` drops entries at random
    with probability ``1 - density`` and rescales the rest (then linear or TIES); ``"magnitude_prune"``
    trims by magnitude and sums.

    Args:
        vectors: The vectors (same shape).
        weights: One weight per vector.
        combination_type: One of :data:`COMBINATIONS`.
        density: Fraction of entries kept by pruning, in (0, 1].
        majority_sign_method: ``"total"`` or ``"frequency"``.
        seed: Seed of DARE's random drop (a private generator state; the global RNG is restored).
    """
    if combination_type not in COMBINATIONS:
        raise ValueError(f"combination_type must be one of {COMBINATIONS}, got {combination_type!r}")
    if not vectors or len(vectors) != len(weights):
        raise ValueError(f"need one weight per vector, got {len(vectors)} vectors and {len(weights)} weights")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if majority_sign_method not in ("total", "frequency"):
        raise ValueError(f"majority_sign_method must be 'total' or 'frequency', got {majority_sign_method!r}")
    shapes = {tuple(v.shape) for v in vectors}
    if len(shapes) != 1:
        raise ValueError(f"vectors to merge have different shapes: {sorted(shapes)}")
    # A NaN or infinite weight made a NaN/inf vector that steered every forward to NaN logits, silently.
    weights = [check_real(f"weights[{i}]", x) for i, x in enumerate(weights)]
    tensors = [v.detach().float() for v in vectors]
    w = torch.tensor(weights, dtype=torch.float32)
    if combination_type in ("ties", "dare_ties"):
        # PEFT elects each entry's sign from the *unweighted* vectors but sums the weighted ones, so a vector merged
        # with a negative weight (steering away from a concept) is kept where it disagrees with the merge and
        # dropped where it agrees. Merging v with weight -w is merging -v with weight w: elect on what is added.
        tensors = [-t if x < 0 else t for t, x in zip(tensors, w.tolist())]
        w = w.abs()
    if combination_type == "linear":
        return merge_utils.task_arithmetic(tensors, w)
    if combination_type == "magnitude_prune":
        return merge_utils.magnitude_prune(tensors, w, density)
    if combination_type == "ties":
        return merge_utils.ties(tensors, w, density, majority_sign_method)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if combination_type == "dare_linear":
            return merge_utils.dare_linear(tensors, w, density)
        return merge_utils.dare_ties(tensors, w, density, majority_sign_method)
