"""HELENE / ZO-SGD / ZO-Adam against references computed here: finite differences, explicit update formulas,
exact restore, determinism, resume, non-finite handling, memory."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from helene import ZOSGD, Helene, ZOAdam, layerwise_param_groups
from tests.helene.zo_testing import checkpoint_round_trip
from tests.helene.zo_testing import closure as _closure
from tests.helene.zo_testing import data as _data
from tests.helene.zo_testing import mlp as _mlp
from tests.helene.zo_testing import params as _params
from tests.helene.zo_testing import reference_directions as _reference_directions


def test_spsa_matches_directional_finite_difference_and_autograd():
    model = _mlp()
    x, y = _data()
    eps, lr = 1e-3, 0.05
    theta = _params(model)
    z = _reference_directions(model, opt_seed=7)

    def loss_at(sign):
        p = {n: theta[n] + sign * eps * z[n] for n in theta}
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y).item()

    c_ref = (loss_at(+1) - loss_at(-1)) / (2 * eps)
    # The true directional derivative from backprop agrees up to O(ε²).
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    c_true = sum((g * z[n]).sum() for (n, _), g in zip(model.named_parameters(), grads)).item()
    assert abs(c_ref - c_true) < 1e-3 * max(1.0, abs(c_true))

    opt = ZOSGD(model.parameters(), lr=lr, eps=eps, seed=7)
    returned = opt.step(_closure(model, x, y))
    assert opt.last_projected_grad == pytest.approx(c_ref, rel=1e-4, abs=1e-5)
    assert returned.item() == pytest.approx(0.5 * (loss_at(1) + loss_at(-1)), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[n] - lr * opt.last_projected_grad * z[n], rtol=0, atol=1e-6)


def test_helene_first_steps_match_written_out_formula():
    model = _mlp()
    x, y = _data()
    eps, lr, gamma, lam, b1, b2, batch = 1e-3, 1e-2, 2.0, 0.05, 0.9, 0.99, 16
    theta = _params(model)
    opt = Helene(model.parameters(), lr=lr, eps=eps, betas=(b1, b2), gamma=gamma, lam=lam, hessian_interval=2,
                 preconditioner="hessian",
                 anneal_horizon=5.0, batch_size=batch, seed=3)
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    h = {n: torch.zeros_like(t) for n, t in theta.items()}
    for t in range(3):
        opt.step(_closure(model, x, y))
        c = opt.last_projected_grad
        z = _reference_directions(model, 3, t)
        alpha = b1 + (1 - b1) * math.exp(-t / 5.0)
        for n in theta:
            m[n] = b1 * m[n] + alpha * c * z[n]
            if t % 2 == 0:
                h[n] = b2 * h[n] + (1 - b2) * batch * (c * z[n]) ** 2
            theta[n] = theta[n] - lr * m[n] / (gamma * torch.clamp(h[n], min=lam))
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), theta[n], rtol=0, atol=2e-6)
            torch.testing.assert_close(opt.state[p]["exp_avg"], m[n], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(opt.state[p]["hessian"], h[n], rtol=1e-5, atol=1e-7)


def test_clip_modes_and_annealing_switch():
    x, y = _data()
    results = {}
    for clip in ("layer", "coordinate", "none"):
        model = _mlp()
        theta = _params(model)
        opt = Helene(model.parameters(), lr=1e-2, clip=clip, lam=0.5, gamma=1.0, anneal=False, seed=0,
                     preconditioner="hessian")
        opt.step(_closure(model, x, y))
        c = opt.last_projected_grad
        z = _reference_directions(model, 0)
        for n, p in model.named_parameters():
            m = 0.9 * c * z[n]  # anneal off: α ≡ β1
            h = 0.01 * (c * z[n]) ** 2
            if clip == "layer":
                u = m / h.clamp(min=0.5)
            elif clip == "coordinate":
                u = (m / h.clamp(min=0.5)).clamp(-1, 1)
            else:
                u = m / (h + 1e-12)
            torch.testing.assert_close(p.detach(), theta[n] - 1e-2 * u, rtol=1e-5, atol=1e-6)
        results[clip] = _params(model)
    assert opt.alpha(0, 0.9) == 0.9
    annealed = Helene([torch.nn.Parameter(torch.zeros(2))], anneal=True, anneal_horizon=10.0)
    assert annealed.alpha(0, 0.9) == pytest.approx(1.0)
    assert annealed.alpha(10, 0.9) == pytest.approx(0.9 + 0.1 / math.e)
    annealed.anneal_horizon = "auto"
    annealed.set_total_steps(200)
    assert annealed.horizon() == 20.0


def test_zoadam_matches_adam_on_the_spsa_gradient():
    model = _mlp()
    ref = _mlp()
    x, y = _data()
    opt = ZOAdam(model.parameters(), lr=1e-2, seed=5)
    adam = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for t in range(3):
        opt.step(_closure(model, x, y))
        z = _reference_directions(model, 5, t)
        for n, p in ref.named_parameters():
            p.grad = opt.last_projected_grad * z[n]
        adam.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_restore_fp32_in_place_is_within_rounding_and_masters_are_bit_exact():
    x, y = _data()
    model = _mlp()
    theta = _params(model)
    ZOSGD(model.parameters(), lr=0.0, eps=1e-3).step(_closure(model, x, y))
    for n, p in model.named_parameters():
        # Three fp32 roundings of θ ± εz: at most a few ulps of the perturbed magnitude, never more.
        bound = 4 * torch.finfo(torch.float32).eps * (theta[n].abs() + 0.01)
        assert torch.all((p.detach() - theta[n]).abs() <= bound), n
    model = _mlp()
    ZOSGD(model.parameters(), lr=0.0, eps=1e-3, master_weights=True).step(_closure(model, x, y))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), theta[n]), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_needs_masters_and_then_restores_exactly(dtype):
    x, y = _data()
    model = _mlp(dtype=dtype)
    with pytest.raises(ValueError, match="master_weights"):
        ZOSGD(model.parameters(), master_weights=False)
    theta = _params(model)
    opt = Helene(model.parameters(), lr=0.0, eps=1e-3, seed=1)
    opt.step(_closure(model, x, y))
    for n, p in model.named_parameters():
        assert p.dtype == dtype and torch.equal(p.detach(), theta[n]), n
        assert opt.state[p]["master"].dtype == torch.float32
    # Without masters the same perturbation would not come back: the reason for the error above.
    p = torch.randn(1000).to(dtype)
    z = torch.randn(1000)
    q = p.clone()
    q.add_(z, alpha=1e-3)
    q.add_(z, alpha=-2e-3)
    q.add_(z, alpha=1e-3)
    assert not torch.equal(p, q)


def test_half_precision_updates_go_through_fp32_masters():
    x, y = _data()
    model16, model32 = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16).float()
    o16 = ZOSGD(model16.parameters(), lr=0.1, seed=2)
    o32 = ZOSGD(model32.parameters(), lr=0.1, seed=2, master_weights=True)
    for _ in range(3):
        o16.step(_closure(model16, x, y))
        o32.step(_closure(model32, x, y))
    for p16, p32 in zip(model16.parameters(), model32.parameters()):
        torch.testing.assert_close(p16.detach(), o16.state[p16]["master"].to(torch.bfloat16), rtol=0, atol=0)
        # Small updates accumulate in the master, not lost to bf16 rounding.
        assert not torch.equal(o16.state[p16]["master"], o16.state[p16]["master"].bfloat16().float())
        assert p32.dtype == torch.float32


def test_determinism_private_generator_and_global_rng_untouched():
    x, y = _data()
    runs = []
    for seed in (4, 4, 5):
        model = _mlp()
        opt = Helene(layerwise_param_groups(model), lr=1e-2, seed=seed, anneal_horizon=10.0)
        torch.manual_seed(123)
        before = torch.get_rng_state()
        for _ in range(3):
            opt.step(_closure(model, x, y))
        assert torch.equal(torch.get_rng_state(), before)
        runs.append(_params(model))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    assert not all(torch.equal(runs[0][n], runs[2][n]) for n in runs[0])


@pytest.mark.parametrize("make", [
    lambda ps: Helene(ps, lr=1e-2, hessian_interval=2, anneal_horizon="auto", seed=9),
    lambda ps: Helene(ps, lr=1e-2, hessian="curvature", clip="coordinate", hessian_interval=2, seed=9),
    lambda ps: ZOAdam(ps, lr=1e-2, seed=9),
    lambda ps: ZOSGD(ps, lr=1e-2, weight_decay=0.1, seed=9),
    lambda ps: Helene(ps, lr=1e-2, hessian_interval=2, seed=9, perturbation="rademacher"),
], ids=["helene", "helene-curvature", "zoadam", "zosgd", "helene-rademacher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_reproduces_uninterrupted_run(make, dtype):
    x, y = _data()

    def train(steps):
        model = _mlp(dtype=dtype)
        opt = make(model.parameters())
        if isinstance(opt, Helene):
            opt.set_total_steps(6)
        for _ in range(steps):
            opt.step(_closure(model, x, y))
        return model, opt

    full, _ = train(6)
    first, opt = train(3)
    resumed, saved = checkpoint_round_trip(first, opt, dtype)
    opt = make(resumed.parameters())
    opt.load_state_dict(saved)
    assert opt.step_count == 3
    for _ in range(3):
        opt.step(_closure(resumed, x, y))
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_load_rejects_foreign_state_dict():
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="zeroth_order"):
        ZOSGD(model.parameters()).load_state_dict(sgd.state_dict())


def test_nonfinite_loss_restores_skips_and_counts():
    x, y = _data()
    model = _mlp()
    opt = Helene(model.parameters(), lr=1e-2, seed=0, anneal_horizon=10.0, preconditioner="hessian")
    opt.step(_closure(model, x, y))
    theta = _params(model)
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    calls = []

    def bad():
        calls.append(1)
        return torch.tensor(float("nan")) if len(calls) == 2 else _closure(model, x, y)()

    loss = opt.step(bad)
    assert not torch.isfinite(loss)
    assert opt.skipped_nonfinite == 1 and opt.update_count == 1 and opt.step_count == 2
    assert opt.counters()["zo_skipped_nonfinite"] == 1.0
    for n, p in model.named_parameters():
        assert (p.detach() - theta[n]).abs().max() <= 1e-6
        for k, v in state[n].items():
            assert torch.equal(opt.state[p][k], v)
    # Training continues normally afterwards.
    assert torch.isfinite(opt.step(_closure(model, x, y)))


def test_no_grad_no_graph_and_state_memory():
    x, y = _data()
    model = _mlp()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    frozen_before = frozen.detach().clone()
    opt = Helene(model.parameters(), lr=1e-2, seed=0, anneal_horizon=10.0, preconditioner="hessian")
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        return _closure(model, x, y)()

    loss = opt.step(closure)
    assert seen == [False, False]
    assert not loss.requires_grad and loss.grad_fn is None
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(frozen, frozen_before) and frozen not in opt.state
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_state = sum(v.numel() for s in opt.state.values() for v in s.values())
    assert n_state == 2 * n_trainable  # m and h, nothing else
    layer = Helene(model.parameters(), hessian="agnb_layer", seed=0, anneal_horizon=10.0)
    layer.step(_closure(model, x, y))
    assert all(layer.state[p]["hessian"].dim() == 0 for p in model.parameters() if p.requires_grad)


def test_curvature_estimator_calls_center_loss_only_on_refresh_steps():
    x, y = _data()
    model = _mlp()
    opt = Helene(model.parameters(), hessian="curvature", hessian_interval=3, seed=0, anneal_horizon=10.0)
    counts = []
    for _ in range(4):
        calls = []
        opt.step(lambda calls=calls: calls.append(1) or _closure(model, x, y)())
        counts.append(len(calls))
    assert counts == [3, 2, 2, 3]


def test_invalid_values_name_the_field():
    ps = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, field in [({"eps": 0.0}, "eps"), ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
                          ({"clip": "x"}, "clip"), ({"hessian": "x"}, "hessian"), ({"lam": -1.0}, "lam"),
                          ({"hessian_interval": 0}, "hessian_interval"), ({"gamma": 0.0}, "gamma"),
                          ({"anneal_horizon": -1}, "anneal_horizon"), ({"master_weights": "x"}, "master_weights"),
                          ({"perturbation": "x"}, "perturbation")]:
        with pytest.raises(ValueError, match=field):
            Helene(ps, **kwargs)
    with pytest.raises(ValueError, match="closure"):
        ZOSGD(ps).step()
    assert Helene.is_zeroth_order and ZOSGD.is_zeroth_order and ZOAdam.is_zeroth_order


def test_hessian_none_is_annealed_momentum_sgd():
    """The "annealing only" ablation: h ≡ 0 (one float per tensor), so θ −= lr·m/(γ·λ) with the annealed m."""
    model = _mlp()
    x, y = _data()
    lr, lam, gamma, b1 = 1e-2, 2.0, 0.5, 0.9
    theta = _params(model)
    opt = Helene(model.parameters(), lr=lr, lam=lam, gamma=gamma, betas=(b1, 0.99), hessian="none",
                 anneal_horizon=4.0, seed=6)
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    for t in range(3):
        opt.step(_closure(model, x, y))
        z = _reference_directions(model, 6, t)
        alpha = b1 + (1 - b1) * math.exp(-t / 4.0)
        for n in theta:
            m[n] = b1 * m[n] + alpha * opt.last_projected_grad * z[n]
            theta[n] = theta[n] - lr * m[n] / (gamma * lam)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[n], rtol=0, atol=2e-6)
        assert opt.state[p]["hessian"].shape == () and opt.state[p]["hessian"].item() == 0.0
