"""The Rademacher perturbation (z = ±1, 64 signs per 64-bit draw) against references computed here: the documented
bit-to-sign mapping, balance, the SPSA step it drives, and the estimators it makes degenerate or refuses."""

from __future__ import annotations

import sys

import pytest
import torch

from helene import ZOSGD, Helene
from helene.zo import rademacher


def _reference_signs(numel: int, generator: torch.Generator) -> torch.Tensor:
    """Signs the documented way, in plain Python: 64-bit words, bytes in memory order, bit j of byte b → ±1."""
    words = torch.empty((numel + 63) // 64, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    signs = []
    for word in words.tolist():
        for byte in word.to_bytes(8, sys.byteorder, signed=True):
            signs += [1.0 if (byte >> j) & 1 else -1.0 for j in range(8)]
    return torch.tensor(signs[:numel], dtype=torch.float32)


@pytest.mark.parametrize("shape", [(3, 5, 7), (64,), (129,), (), (0, 4)], ids=str)
def test_rademacher_follows_the_documented_bit_mapping(shape):
    z = rademacher(torch.Size(shape), torch.Generator().manual_seed(11), torch.device("cpu"))
    ref = _reference_signs(z.numel(), torch.Generator().manual_seed(11))
    assert z.shape == torch.Size(shape) and z.dtype == torch.float32 and z.is_contiguous()
    assert torch.equal(z.reshape(-1), ref)


def test_rademacher_is_balanced_and_uncorrelated():
    n = 1 << 20
    z = rademacher(torch.Size([n]), torch.Generator().manual_seed(0), torch.device("cpu"))
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    bound = 5.0 / n**0.5  # five standard errors of a mean of n independent ±1
    assert abs(z.mean().item()) < bound
    for lag in (1, 7, 8, 63, 64):  # within a byte, across bytes, across words
        assert abs((z[:-lag] * z[lag:]).mean().item()) < bound
    # Consecutive draws from one generator differ (it advances), and the same seed repeats.
    gen = torch.Generator().manual_seed(0)
    a, b = rademacher(torch.Size([256]), gen, z.device), rademacher(torch.Size([256]), gen, z.device)
    assert not torch.equal(a, b) and torch.equal(a, z[:256])


def _model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    return model, (lambda: torch.nn.functional.cross_entropy(model(x), y))


def _step_directions(model, opt_seed):
    """z of the first step: the step seed from the optimizer's seed stream, then signs tensor by tensor."""
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(opt_seed)).item())
    gen = torch.Generator().manual_seed(seed)
    return {n: _reference_signs(p.numel(), gen).view(p.shape) for n, p in model.named_parameters()}


def test_zosgd_rademacher_step_is_spsa_along_the_signs():
    model, closure = _model_and_batch()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    z = _step_directions(model, opt_seed=5)
    eps, lr = 1e-3, 0.1

    def loss_at(sign):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n] + sign * eps * z[n])
            value = closure().item()
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        return value

    c_ref = (loss_at(+1) - loss_at(-1)) / (2 * eps)
    opt = ZOSGD(model.parameters(), lr=lr, eps=eps, seed=5, perturbation="rademacher")
    opt.step(closure)
    assert opt.last_projected_grad == pytest.approx(c_ref, rel=1e-4, abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[n] - lr * opt.last_projected_grad * z[n], rtol=0, atol=1e-6)


def test_helene_agnb_under_rademacher_is_the_same_for_every_coordinate():
    """z⊙z ≡ 1, so A-GNB's refresh B·c²·z⊙z is B·c² in every coordinate (what agnb_layer stores as one float)."""
    model, closure = _model_and_batch()
    batch, b2 = 12, 0.99
    opt = Helene(model.parameters(), lr=1e-3, betas=(0.9, b2), batch_size=batch, anneal_horizon=5.0, seed=2,
                 perturbation="rademacher", preconditioner="hessian")
    opt.step(closure)
    expected = (1 - b2) * batch * opt.last_projected_grad**2
    for p in model.parameters():
        h = opt.state[p]["hessian"]
        assert h.shape == p.shape
        torch.testing.assert_close(h, torch.full_like(h, expected), rtol=1e-5, atol=0)


def test_bad_perturbation_values_are_refused_with_the_field_named():
    ps = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"perturbation must be one of \('gaussian', 'rademacher'\)"):
        ZOSGD(ps, perturbation="uniform")
    for hessian in ("curvature", "curvature_layer"):  # they weigh z⊙z − 1, identically 0 for ±1
        with pytest.raises(ValueError, match="needs a Gaussian perturbation"):
            Helene(ps, hessian=hessian, perturbation="rademacher")
    Helene(ps, hessian="agnb_layer", perturbation="rademacher")  # the estimators that stay meaningful are allowed
