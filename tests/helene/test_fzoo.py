"""FZOO against references computed here: the update from independently evaluated probes, exact loss-scale
invariance, the σ = 0 and non-finite skips, restore between probes, resume, and that it trains."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from helene import FZOO
from tests.helene.zo_testing import checkpoint_round_trip, closure, data, directions, mlp, params, step_seeds


def _loss_at(model, theta, x, y):
    return torch.nn.functional.cross_entropy(functional_call(model, theta, (x,)), y).item()


@pytest.mark.parametrize("n_probes,weight_decay,master", [(8, 0.0, "auto"), (3, 0.1, True)],
                         ids=["n8", "n3-wd-masters"])
def test_update_equals_the_written_out_probes(n_probes, weight_decay, master):
    model = mlp()
    x, y = data()
    lr, eps, seed = 1e-2, 1e-3, 5
    opt = FZOO(model.parameters(), lr=lr, eps=eps, n_probes=n_probes, weight_decay=weight_decay, seed=seed,
               master_weights=master)
    for t in range(3):
        theta = params(model)  # each step's reference starts from where the optimizer is
        calls = []
        returned = opt.step(lambda calls=calls: calls.append(1) or closure(model, x, y)())
        assert len(calls) == n_probes + 1 and opt.forward_passes == (t + 1) * (n_probes + 1)
        probes = [directions(model, s, "rademacher") for s in step_seeds(seed, t, n_probes)]
        l0 = _loss_at(model, theta, x, y)
        losses = torch.tensor([_loss_at(model, {n: theta[n] + eps * u[n] for n in theta}, x, y) for u in probes],
                              dtype=torch.float64)
        sigma = losses.std(unbiased=False).item()  # population std, as the authors' torch.std(unbiased=False)
        assert opt.last_probe_std == pytest.approx(sigma, rel=1e-6)
        assert returned.item() == pytest.approx(l0, rel=1e-6)
        for n in theta:
            step = sum((li - l0) / (n_probes * sigma) * u[n] for li, u in zip(losses.tolist(), probes))
            theta[n] = theta[n] * (1 - lr * weight_decay) - lr * step
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), theta[n], rtol=0, atol=2e-6, msg=n)
    assert opt.update_count == 3 and opt.skipped_zero_std == 0


def test_no_state_beyond_masters():
    model = mlp()
    x, y = data()
    opt = FZOO(model.parameters(), lr=1e-2, seed=0)
    opt.step(closure(model, x, y))
    assert all(len(st) == 0 for st in opt.state.values())  # fp32 parameters: not even a master copy


def _trajectory(scale, steps=4, **kw):
    model = mlp()
    x, y = data()
    opt = FZOO(model.parameters(), lr=1e-2, seed=3, **kw)
    out = []
    for _ in range(steps):
        opt.step(closure(model, x, y, scale))
        out.append(params(model))
    return out


def test_update_is_exactly_invariant_to_the_loss_scale():
    start = params(mlp())
    for ref, exact, near in zip(_trajectory(1.0, weight_decay=0.1), _trajectory(16.0, weight_decay=0.1),
                                _trajectory(3.7, weight_decay=0.1)):
        for n in ref:
            assert torch.equal(ref[n], exact[n]), n  # power of two: bit for bit
            assert (near[n] - ref[n]).abs().max() <= 1e-2 * (ref[n] - start[n]).abs().max(), n


@pytest.mark.parametrize("master", ["auto", True])
def test_equal_probe_losses_skip_the_step_and_count_it(master):
    model = mlp()
    theta = params(model)
    opt = FZOO(model.parameters(), lr=1.0, n_probes=4, master_weights=master, seed=0)
    calls = []

    def flat():  # the probes all see 0.25; the centre differs, so a division by σ = 0 would blow up
        calls.append(1)
        return torch.tensor(0.5 if len(calls) == 1 else 0.25)

    loss = opt.step(flat)
    assert loss.item() == 0.5 and len(calls) == 5
    assert opt.skipped_zero_std == 1 and opt.update_count == 0 and opt.step_count == 1 and opt.skipped_nonfinite == 0
    assert opt.last_probe_std == 0.0 and opt.counters()["zo_skipped_zero_std"] == 1.0
    for n, p in model.named_parameters():
        if master is True:
            assert torch.equal(p.detach(), theta[n]), n
        else:  # four in-place ±ε round trips: a few ulps at most
            assert (p.detach() - theta[n]).abs().max() <= 8 * torch.finfo(torch.float32).eps * (theta[n].abs().max() + 1)


def test_nonfinite_loss_restores_skips_counts_and_still_calls_every_probe():
    model = mlp()
    x, y = data()
    opt = FZOO(model.parameters(), lr=1e-2, n_probes=4, master_weights=True, seed=0)
    theta = params(model)
    calls = []

    def bad():
        calls.append(1)
        return torch.tensor(float("inf")) if len(calls) == 3 else closure(model, x, y)()

    assert torch.isnan(opt.step(bad))
    assert len(calls) == 5 and opt.skipped_nonfinite == 1 and opt.update_count == 0 and opt.forward_passes == 5
    assert all(torch.equal(p.detach(), theta[n]) for n, p in model.named_parameters())
    assert torch.isfinite(opt.step(closure(model, x, y))) and opt.update_count == 1


def test_parameters_are_restored_exactly_between_probes():
    model = mlp()
    x, y = data()
    theta = params(model)
    seed, eps, n = 2, 1e-3, 3
    opt = FZOO(model.parameters(), lr=0.0, eps=eps, n_probes=n, master_weights=True, seed=seed)
    seen = []

    def recording():
        seen.append(params(model))
        return closure(model, x, y)()

    opt.step(recording)
    probes = [directions(model, s, "rademacher") for s in step_seeds(seed, 0, n)]
    assert all(torch.equal(seen[0][k], theta[k]) for k in theta)  # l0 at θ itself
    for i, u in enumerate(probes):
        for k in theta:
            assert torch.equal(seen[i + 1][k], theta[k] + eps * u[k]), (i, k)  # each probe from the restored θ
    assert all(torch.equal(p.detach(), theta[k]) for k, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_mid_run_is_bit_exact(dtype):
    x, y = data()

    def make(model):
        return FZOO(model.parameters(), lr=1e-2, n_probes=4, weight_decay=0.01, seed=11)

    full = mlp(dtype=dtype)
    opt = make(full)
    for _ in range(6):
        opt.step(closure(full, x, y))
    first = mlp(dtype=dtype)
    opt = make(first)
    for _ in range(3):
        opt.step(closure(first, x, y))
    opt.skipped_zero_std = 7  # counters travel too
    resumed, saved = checkpoint_round_trip(first, opt, dtype)
    opt = make(resumed)
    opt.load_state_dict(saved)
    assert (opt.step_count, opt.forward_passes, opt.skipped_zero_std) == (3, 15, 7)
    for _ in range(3):
        opt.step(closure(resumed, x, y))
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_it_trains_a_tiny_regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 10, generator=g)
    y = x @ torch.randn(10, 1, generator=g) + 0.01 * torch.randn(64, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    loss = lambda: torch.nn.functional.mse_loss(model(x), y)
    first = loss().item()
    opt = FZOO(model.parameters(), lr=2e-2, seed=0)
    for _ in range(150):
        last = opt.step(loss).item()
    assert last < 0.05 * first, (first, last)
    assert opt.update_count == 150 and opt.forward_passes == 150 * 9


def test_bad_input_names_the_argument():
    ps = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, field in [({"n_probes": 1}, "n_probes"), ({"n_probes": 2.0}, "n_probes"), ({"n_probes": True},
                          "n_probes"), ({"lr": -1.0}, "lr"), ({"eps": 0.0}, "eps"), ({"weight_decay": -1}, "weight_decay"),
                          ({"perturbation": "x"}, "perturbation")]:
        with pytest.raises(ValueError, match=field):
            FZOO(ps, **kwargs)
    with pytest.raises(ValueError, match="closure"):
        FZOO(ps).step()
    assert FZOO.is_zeroth_order
    assert FZOO(ps, n_probes=2).n_probes == 2
