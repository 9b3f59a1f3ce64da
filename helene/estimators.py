"""Diagonal Hessian estimates available to a zeroth-order step, one per parameter tensor.

Every estimator sees only what a two-point (or three-point) zeroth-order step measures: the direction ``z``
(fp32, the tensor's slice of the perturbation), the projected gradient ``c = (L+ − L−)/2ε``, the two perturbed
losses, the unperturbed loss when the estimator asks for it, ``ε`` and the batch size.

- ``"agnb"`` — the paper's asymptotic Gauss–Newton–Bartlett estimate: Sophia's GNB ``B·ĝ⊙ĝ`` with the model's
  sampled labels replaced by the true labels (asymptotically the same when the model fits the data) and the
  backprop gradient replaced by the SPSA estimate ``ĝ = c·z``. Caution (measured in docs/helene.md): with one
  shared scalar ``c``, ``E[ĝ_i²] = ‖∇L‖² + 2∇_i²`` is nearly isotropic.
- ``"agnb_layer"`` — the same quantity averaged over the tensor (one scalar per tensor): the only part of
  ``ĝ⊙ĝ`` that is not noise, at a memory cost of one float per tensor instead of one per parameter.
- ``"curvature"`` — HiZOO-style three-point estimate ``κ·(z⊙z − 1)``, ``κ = (L+ + L− − 2L0)/(2ε²)``, an unbiased
  estimate of the Hessian diagonal (``E[zᵀHz·(z_i² − 1)] = 2H_ii``); costs one more forward pass on refresh
  steps and can be negative (the clipping floor keeps the preconditioner positive).
- ``"curvature_layer"`` — its mean over the tensor: an unbiased estimate of the tensor's mean Hessian diagonal,
  one float per tensor. The benchmark found per-tensor curvature to be the only level at which a zeroth-order
  estimate carries signal.
- ``"none"`` — no Hessian at all (one float per tensor, always 0): with ``clip="layer"`` the denominator is the
  constant ``γ·λ``, so HELENE reduces to MeZO with annealed momentum — the "annealing only" ablation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HessianEstimator:
    """A named diagonal-Hessian estimator.

    Args:
        name: Registry key.
        fn: ``fn(z, projected, loss_plus, loss_minus, center, eps, batch_size) -> Tensor`` (same shape as ``z``,
            or a 0-dim tensor for per-tensor estimators).
        needs_center: Whether ``center`` (the loss at the unperturbed parameters) must be measured.
        per_tensor: Whether the estimate is one scalar per tensor (its EMA then costs one float).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    needs_center: bool = False
    per_tensor: bool = False

    def __call__(self, z, projected, loss_plus, loss_minus, center, eps, batch_size) -> torch.Tensor:
        return self.fn(z, projected, loss_plus, loss_minus, center, eps, batch_size)


def _agnb(z, projected, loss_plus, loss_minus, center, eps, batch_size):
    return z.square().mul_(batch_size * projected * projected)


def _agnb_layer(z, projected, loss_plus, loss_minus, center, eps, batch_size):
    return z.square().mean().mul_(batch_size * projected * projected)


def _curvature(z, projected, loss_plus, loss_minus, center, eps, batch_size):
    kappa = (loss_plus + loss_minus - 2.0 * center) / (2.0 * eps * eps)
    return z.square().sub_(1.0).mul_(kappa)


def _curvature_layer(z, projected, loss_plus, loss_minus, center, eps, batch_size):
    kappa = (loss_plus + loss_minus - 2.0 * center) / (2.0 * eps * eps)
    return z.square().mean().sub_(1.0).mul_(kappa)


def _none(z, projected, loss_plus, loss_minus, center, eps, batch_size):
    return torch.zeros((), dtype=torch.float32, device=z.device)


HESSIAN_ESTIMATORS: dict[str, HessianEstimator] = {
    "agnb": HessianEstimator("agnb", _agnb),
    "agnb_layer": HessianEstimator("agnb_layer", _agnb_layer, per_tensor=True),
    "curvature": HessianEstimator("curvature", _curvature, needs_center=True),
    "curvature_layer": HessianEstimator("curvature_layer", _curvature_layer, needs_center=True, per_tensor=True),
    "none": HessianEstimator("none", _none, per_tensor=True),
}


def get_estimator(name: str) -> HessianEstimator:
    """Looks up an estimator by name.

    Args:
        name: One of :data:`HESSIAN_ESTIMATORS`.
    """
    try:
        return HESSIAN_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"hessian must be one of {sorted(HESSIAN_ESTIMATORS)}, got {name!r}") from None
