"""HELENE, MeZO and FZOO against the papers' equations, written out here in plain torch on a tiny quadratic.

The model is a linear regression (an MSE loss, so exactly quadratic in its parameters): the two-point difference
``(L(θ+εz) − L(θ−εz)) / 2ε`` then equals ``∇L(θ)·z`` up to rounding, which pins the SPSA estimate's sign, its
``2ε`` scale and the use of one ``z`` for both passes against a backprop gradient. The HELENE reference follows
the reconstruction in DESIGN §6 (annealed momentum, A-GNB EMA every k steps, per-layer floor λ, decoupled weight
decay), with every loss and gradient computed here rather than read from the optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from helene import FZOO, ZOSGD, Helene
from tests.helene.zo_testing import directions, step_seeds


class _Regression(torch.nn.Module):
    """``x ↦ W x + b + f``: W and b trainable, the offset f frozen (it must never move nor get state)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(3, 4, generator=gen))
            self.lin.bias.copy_(torch.randn(3, generator=gen))
        self.frozen = torch.nn.Parameter(torch.randn(3, generator=gen), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.frozen


def _problem():
    gen = torch.Generator().manual_seed(1)
    return _Regression(), torch.randn(16, 4, generator=gen), torch.randn(16, 3, generator=gen)


def _loss(model, theta, x, y):
    """The MSE at parameters ``theta`` (trainable ones; the frozen offset comes from the model)."""
    out = functional_call(model, {**theta, "frozen": model.frozen.detach()}, (x,))
    return torch.nn.functional.mse_loss(out, y)


def _trainable(model):
    return {n: p.detach().clone().double() for n, p in model.named_parameters() if p.requires_grad}


def _grad(model, theta, x, y):
    """∇L(θ) by backprop in float64."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
    loss = _loss(model.double(), leaves, x.double(), y.double())
    model.float()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads))


def _closure(model, x, y):
    return lambda: torch.nn.functional.mse_loss(model(x), y)


def _z(model, opt_seed, t, perturbation="gaussian"):
    return {n: v.double() for n, v in directions(model, step_seeds(opt_seed, t)[0], perturbation).items()}


def test_two_point_estimate_is_the_directional_derivative_along_one_z():
    """c = (L+ − L−)/2ε: on a quadratic it is ∇L·z exactly (right sign, 2ε, the same z in both passes)."""
    model, x, y = _problem()
    theta = _trainable(model)
    opt = ZOSGD(model.parameters(), lr=0.0, eps=1e-2, seed=11)
    opt.step(_closure(model, x, y))
    z = _z(model, 11, 0)
    grad = _grad(model, theta, x, y)
    c_true = sum((grad[n] * z[n]).sum() for n in z).item()
    assert abs(c_true) > 0.1  # a direction with a clear slope: a flipped sign or a factor 2 cannot hide
    assert opt.last_projected_grad == pytest.approx(c_true, rel=1e-4)


@pytest.mark.parametrize("interval", [1, 3])
def test_helene_trajectory_matches_the_papers_equations(interval):
    """Five steps of HELENE (A-GNB, layer floor λ per layer, decoupled weight decay off for the bias, frozen offset
    untouched, an lr change mid-run) against the update written out from the equations."""
    model, x, y = _problem()
    lr, eps, b1, b2, gamma, batch, horizon, wd, seed = 0.05, 0.1, 0.8, 0.9, 1.5, 4, 3.0, 0.2, 5
    lam = {"weight": 0.3, "default": 0.02}  # λ_i per layer: the weight's floor is active, the bias's mostly not
    frozen = model.frozen.detach().clone()
    opt = Helene(model.named_parameters(), lr=lr, eps=eps, betas=(b1, b2), gamma=gamma, lam=lam,
                 weight_decay=wd, hessian_interval=interval, anneal_horizon=horizon, batch_size=batch,
                 layerwise="tensor", preconditioner="hessian", seed=seed)
    assert [g["lam"] for g in opt.param_groups] == [0.3, 0.02]
    assert [g["weight_decay"] for g in opt.param_groups] == [wd, 0.0]  # no decay on the bias
    floor = {"lin.weight": 0.3, "lin.bias": 0.02}
    decay = {"lin.weight": wd, "lin.bias": 0.0}
    theta = _trainable(model)
    m = {n: torch.zeros_like(v) for n, v in theta.items()}
    h = {n: torch.zeros_like(v) for n, v in theta.items()}
    for t in range(5):
        if t == 3:  # a scheduler's change of the group lr applies from this step on
            lr = 0.02
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step(_closure(model, x, y))
        z = _z(model, seed, t)
        grad = _grad(model, theta, x, y)
        c = sum((grad[n] * z[n]).sum() for n in z).item()  # two-point SPSA on a quadratic, exactly
        assert opt.last_projected_grad == pytest.approx(c, rel=1e-4, abs=1e-5)
        alpha = b1 + (1 - b1) * math.exp(-t / horizon)  # annealed from 1 down to β1, per update
        for n in theta:
            g = c * z[n]
            m[n] = b1 * m[n] + alpha * g
            if t % interval == 0:
                h[n] = b2 * h[n] + (1 - b2) * batch * g * g  # A-GNB: B·ĝ⊙ĝ, its EMA refreshed every k steps
            theta[n] = theta[n] - lr * (m[n] / (gamma * h[n].clamp(min=floor[n])) + decay[n] * theta[n])
        for n, p in model.named_parameters():
            if p.requires_grad:
                # fp32 losses and states: errors relative to each tensor's scale (an entry of m can cross 0)
                torch.testing.assert_close(p.detach().double(), theta[n], rtol=0, atol=1e-5 * theta[n].abs().max(),
                                           msg=n)
                torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m[n], rtol=0,
                                           atol=1e-4 * m[n].abs().max(), msg=n)
                torch.testing.assert_close(opt.state[p]["hessian"].double(), h[n], rtol=0,
                                           atol=1e-4 * h[n].abs().max(), msg=n)
    assert torch.equal(model.frozen.detach(), frozen) and model.frozen not in opt.state


def test_helene_without_hessian_and_momentum_is_mezo():
    """The docs' reduction: h ≡ 0 ("none"), γ·λ = 1, β1 = 0 and α ≡ 1 (an infinite horizon) give MeZO's steps."""
    runs = []
    for make in (lambda ps: ZOSGD(ps, lr=0.05, eps=1e-2, weight_decay=0.1, seed=2),
                 lambda ps: Helene(ps, lr=0.05, eps=1e-2, weight_decay=0.1, seed=2, hessian="none", lam=2.0,
                                   gamma=0.5, betas=(0.0, 0.99), anneal_horizon=1e300)):
        model, x, y = _problem()
        opt = make(model.parameters())
        for _ in range(4):
            opt.step(_closure(model, x, y))
        runs.append(_trainable(model))
    for n in runs[0]:
        torch.testing.assert_close(runs[1][n], runs[0][n], rtol=0, atol=1e-7)


def test_fzoo_update_has_no_one_over_eps_and_follows_the_written_out_probes():
    """FZOO (the authors' zo_step/zo_update): weights (l_i − l0)/(N·σ) with σ the population std of the N probe
    losses, no 1/ε. On a linear loss l_i − l0 and σ both scale with ε, so the step does not depend on ε."""
    n_probes, lr, seed = 4, 0.1, 9
    w0 = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5])
    a = torch.tensor([1.0, 2.0, -3.0, 0.5, -1.0])
    steps = []
    for eps in (1e-2, 4e-2):
        w = torch.nn.Parameter(w0.clone())
        opt = FZOO([w], lr=lr, eps=eps, n_probes=n_probes, seed=seed)
        opt.step(lambda w=w: a @ w)
        probes = [directions(torch.nn.ParameterDict({"w": w}), s, "rademacher")["w"].double()
                  for s in step_seeds(seed, 0, n_probes)]
        l0 = (a.double() @ w0.double()).item()
        losses = torch.tensor([(a.double() @ (w0.double() + eps * u)).item() for u in probes], dtype=torch.float64)
        sigma = losses.std(unbiased=False).item()
        expected = w0.double() - lr * sum((li - l0) / (n_probes * sigma) * u for li, u in zip(losses.tolist(), probes))
        torch.testing.assert_close(w.detach().double(), expected, rtol=0, atol=1e-6)
        steps.append(w.detach().double() - w0.double())
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-4, atol=1e-6)



@pytest.mark.parametrize("kwargs", [{"hessian": "none", "clip": "none"}, {"hessian": "none", "lam": 0.0},
                                    {"hessian": "curvature", "lam": 0.0}, {"hessian": "curvature_layer", "lam": 0.0}],
                         ids=["none-noclip", "none-lam0", "curv-lam0", "curvlayer-lam0"])
def test_a_denominator_left_to_1e_12_is_refused(kwargs):
    """h ≡ 0 ("none") or h <= 0 (curvature) with no floor would divide the momentum by 1e-12: a 1e12× step."""
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match="clip|lam"):
        Helene([p], **kwargs)
    opt = Helene([p], hessian=kwargs["hessian"], lam=1.0)  # with a floor: fine, and a group added later is checked
    with pytest.raises(ValueError, match="lam"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "lam": 0.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("kwargs, field", [({"hessian": "none", "clip": "none"}, "clip"),
                                           ({"hessian": "curvature", "lam": 0.0}, "lam")])
def test_the_cli_names_the_field_of_a_degenerate_denominator(kwargs, field):
    # The CLI names the recipe field from the message; the first wording named model.optimizer.init_args.seed.
    from peftplug.config_errors import _named_in

    with pytest.raises(ValueError) as raised:
        Helene([torch.nn.Parameter(torch.randn(3))], **kwargs)
    leaves = {f"model.optimizer.init_args.{k}": v for k, v in {"seed": 0, "lam": 0.0, **kwargs}.items()}
    assert _named_in(str(raised.value), leaves) == f"model.optimizer.init_args.{field}"
