"""Robustness of the zeroth-order optimizers, against references computed here: θ restored when the closure
raises, ``add_param_group`` equal to giving the group at construction, per-group options kept by
``Helene(layerwise=...)``, every numeric option validated, and masters that never lower precision."""

from __future__ import annotations

import math

import pytest
import torch

from helene import FZOO, ZOSGD, Helene, ZOAdam, layerwise_param_groups
from tests.helene.zo_testing import closure, data, directions, mlp, params, step_seeds

EPS = 1e-2  # large enough that a parameter left perturbed is far from θ


class _Boom(RuntimeError):
    """Stands for an OOM or a data error inside the closure."""


def _failing(model, x, y, at: int, exc: type[BaseException] = _Boom, nan: bool = False):
    """The usual closure, except that call number ``at`` raises ``exc`` (or returns nan when ``nan``)."""
    inner = closure(model, x, y)
    calls = []

    def f():
        calls.append(1)
        if len(calls) == at:
            if nan:
                return torch.tensor(float("nan"))
            raise exc("closure failed")
        return inner()

    return f


# (name, class, options, closure calls before the first perturbation)
OPTIMIZERS = [
    ("zosgd", ZOSGD, {"lr": 1e-2}, 0),
    ("zoadam", ZOAdam, {"lr": 1e-2}, 0),
    ("helene", Helene, {"lr": 1e-2, "anneal_horizon": 10.0}, 0),
    ("helene-curvature", Helene, {"lr": 1e-2, "anneal_horizon": 10.0, "hessian": "curvature",
                                  "hessian_interval": 1}, 1),
    ("fzoo", FZOO, {"lr": 1e-2, "n_probes": 3}, 1),
]
IDS = [o[0] for o in OPTIMIZERS]


def _in_place_reference(model, moves_by_seed, perturbation):
    """θ after the in-place moves ``θ += a·z`` the optimizer made before the failure, each undone in place."""
    theta = params(model)
    for seed, alphas in moves_by_seed:
        z = directions(model, seed, perturbation)
        for name in theta:
            for a in alphas:
                theta[name].add_(z[name], alpha=a)
    return theta


def _expected_after_failure(name, model, at, center_calls, seed=0):
    """θ a failure at closure call ``at`` must leave without master weights, by the optimizer's own arithmetic."""
    perturbed = at - center_calls  # FZOO: probes perturbed (the last one failed); else 1: L+ failed, 2: L− failed
    if name == "fzoo":
        seeds = step_seeds(seed, 0, n=3)
        return _in_place_reference(model, [(s, [EPS, -EPS]) for s in seeds[:perturbed]], "rademacher")
    moves = {0: [], 1: [EPS, -EPS], 2: [EPS, -2 * EPS, EPS]}[perturbed]
    return _in_place_reference(model, [(step_seeds(seed, 0)[0], moves)], "gaussian")


#: Every closure call that can fail: the centre loss (if measured), then each perturbed one.
FAILURES = [(*o, at) for o in OPTIMIZERS for at in range(1, o[3] + (4 if o[0] == "fzoo" else 3))]


@pytest.mark.parametrize("name,cls,options,center_calls,at", FAILURES, ids=[f"{f[0]}-call{f[4]}" for f in FAILURES])
@pytest.mark.parametrize("master", ["auto", True])
def test_parameters_are_restored_when_the_closure_raises(name, cls, options, center_calls, at, master):
    model = mlp()
    x, y = data()
    before = params(model)
    expected = before if master is True else _expected_after_failure(name, mlp(), at, center_calls)
    opt = cls(model.parameters(), eps=EPS, seed=0, master_weights=master, **options)
    with pytest.raises(_Boom):
        opt.step(_failing(model, x, y, at))
    after = params(model)
    for n in before:
        assert torch.equal(after[n], expected[n]), n
    if master is True or at <= center_calls:
        for n in before:
            assert torch.equal(after[n], before[n]), n
    else:  # in place: back to θ within the documented few ulps
        for n in before:
            assert torch.allclose(after[n], before[n], rtol=0, atol=8 * 2**-23 * (before[n].abs().max() + 1)), n
    assert opt.step_count == 0 and opt.update_count == 0


@pytest.mark.parametrize("name,cls,options,center_calls", [o for o in OPTIMIZERS if o[0] != "fzoo"],
                         ids=[i for i in IDS if i != "fzoo"])
def test_a_raise_at_l_minus_restores_like_a_nonfinite_l_minus(name, cls, options, center_calls):
    """Without masters, bit for bit the in-place restore of a step skipped for a non-finite loss."""
    restored = {}
    for nan in (False, True):
        model = mlp()
        x, y = data()
        opt = cls(model.parameters(), eps=EPS, seed=0, **options)
        failing = _failing(model, x, y, at=center_calls + 2, nan=nan)
        if nan:
            assert math.isnan(opt.step(failing).item()) and opt.skipped_nonfinite == 1
        else:
            with pytest.raises(_Boom):
                opt.step(failing)
        restored[nan] = params(model)
    for n in restored[True]:
        assert torch.equal(restored[False][n], restored[True][n]), n


@pytest.mark.parametrize("name,cls,options,center_calls", OPTIMIZERS, ids=IDS)
def test_a_retried_step_equals_the_uninterrupted_step(name, cls, options, center_calls):
    """Ctrl-C mid-step, then the same batch again: the seed generator was rewound, so nothing differs."""
    x, y = data()
    reference = mlp()
    cls(reference.parameters(), eps=EPS, seed=0, master_weights=True, **options).step(closure(reference, x, y))
    model = mlp()
    opt = cls(model.parameters(), eps=EPS, seed=0, master_weights=True, **options)
    with pytest.raises(KeyboardInterrupt):
        opt.step(_failing(model, x, y, at=center_calls + 2, exc=KeyboardInterrupt))
    opt.step(closure(model, x, y))
    want, got = params(reference), params(model)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_bf16_parameters_are_restored_exactly_when_the_closure_raises():
    model = mlp(dtype=torch.bfloat16)
    x, y = data()
    before = params(model)
    opt = Helene(model.parameters(), lr=1e-2, eps=EPS, anneal_horizon=10.0)
    with pytest.raises(_Boom):
        opt.step(_failing(model, x, y, at=2))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert torch.equal(opt.state[p]["master"], before[n].float()), n


# ------------------------------------------------------------------------------------------ add_param_group
def _split(model):
    """The MLP's parameters as two groups: the first layer, and the rest with its own options."""
    ps = list(model.parameters())
    return {"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.1}


ADDED = [
    ("zosgd", ZOSGD, {"lr": 1e-2}),
    ("zoadam", ZOAdam, {"lr": 1e-2}),
    ("fzoo", FZOO, {"lr": 1e-2, "n_probes": 3}),
    ("helene-scalar", Helene, {"lr": 1e-2, "anneal_horizon": 10.0}),
    ("helene-scalar-global", Helene, {"lr": 1e-2, "anneal_horizon": 10.0, "preconditioner": "scalar_global"}),
    ("helene-hessian", Helene, {"lr": 1e-2, "anneal_horizon": 10.0, "hessian": "agnb_layer"}),
]


@pytest.mark.parametrize("name,cls,options", ADDED, ids=[a[0] for a in ADDED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_param_group_equals_the_group_given_at_construction(name, cls, options, dtype):
    x, y = data()
    reference, model = mlp(dtype=dtype), mlp(dtype=dtype)
    ref_opt = cls(list(_split(reference)), eps=EPS, seed=0, **options)
    first, second = _split(model)
    opt = cls([first], eps=EPS, seed=0, **options)
    opt.add_param_group(second)
    assert [set(g) for g in opt.param_groups] == [set(g) for g in ref_opt.param_groups]
    for _ in range(3):
        ref_opt.step(closure(reference, x, y))
        opt.step(closure(model, x, y))
    want, got = params(reference), params(model)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        assert set(opt.state[p]) == set(ref_opt.state[p_ref])
        for key, value in ref_opt.state[p_ref].items():
            assert torch.equal(opt.state[p][key], value), key
    if isinstance(opt, Helene):
        assert opt.second_moment == ref_opt.second_moment
        assert len(opt.second_moment) == (2 if opt.preconditioner == "scalar" else
                                          1 if opt.preconditioner == "scalar_global" else 0)


def test_a_bf16_parameter_added_later_gets_its_master_and_restores_exactly():
    fp32 = torch.nn.Parameter(torch.ones(2))
    half = torch.nn.Parameter(torch.full((1000,), 1.2345, dtype=torch.bfloat16))
    before = half.detach().clone()
    opt = ZOSGD([fp32], lr=0.0, eps=EPS)
    opt.add_param_group({"params": [half]})
    assert opt.state[half]["master"].dtype == torch.float32
    opt.step(lambda: (half.float() ** 2).sum() + (fp32**2).sum())
    assert torch.equal(half.detach(), before)


@pytest.mark.parametrize("cls,group,field", [
    (ZOSGD, {"lr": float("nan")}, "lr"),
    (FZOO, {"weight_decay": float("inf")}, "weight_decay"),
    (ZOAdam, {"betas": 0.9}, "betas"),
    (ZOAdam, {"adam_eps": 0.0}, "adam_eps"),
    (Helene, {"gamma": "1"}, "gamma"),
    (Helene, {"lam": {"default": 0.5}}, "lam"),
])
def test_an_invalid_added_group_is_refused_like_at_construction(cls, group, field):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=field) as at_construction:
        cls([{"params": [a]}, {"params": [b], **group}])
    opt = cls([a])
    moments = list(getattr(opt, "second_moment", []))
    with pytest.raises(ValueError, match=field) as added:
        opt.add_param_group({"params": [b], **group})
    assert str(added.value) == str(at_construction.value)
    assert len(opt.param_groups) == 1 and list(getattr(opt, "second_moment", [])) == moments
    opt.add_param_group({"params": [b]})  # the optimizer is as it was: b can still be added


def test_an_added_half_group_without_masters_is_refused_and_rolled_back():
    opt = ZOSGD([torch.nn.Parameter(torch.ones(2))], master_weights=False)
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="master_weights"):
        opt.add_param_group({"params": [half]})
    assert len(opt.param_groups) == 1 and half not in opt.state


# ------------------------------------------------------------------------------------------------ layerwise
def test_layerwise_keeps_the_options_of_each_given_group():
    model = mlp()
    named = list(model.named_parameters())
    first = {"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]], "lr": 0.0,
             "betas": (0.5, 0.9), "weight_decay": 0.2}
    rest = {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]], "gamma": 2.0,
            "lam": {r"^3\.": 0.25, "default": 4.0}}
    opt = Helene([first, rest], lr=1e-2, eps=EPS, anneal_horizon=10.0, layerwise="tensor", weight_decay=0.05,
                 master_weights=True)  # bit-exact restore, so lr = 0 leaves θ exactly
    # The reference: each given group split by layerwise_param_groups with that group's own options.
    expected = (layerwise_param_groups(named[:2], "tensor", lam=1.0, weight_decay=0.2, lr=0.0, betas=(0.5, 0.9))
                + layerwise_param_groups(named[2:], "tensor", lam=rest["lam"], weight_decay=0.05, gamma=2.0))
    assert len(opt.param_groups) == len(expected)
    for got, want in zip(opt.param_groups, expected):
        assert got["param_names"] == want["names"]
        for key in ("lam", "weight_decay", "lr", "betas", "gamma"):
            assert got[key] == want.get(key, opt.defaults[key]), (want["names"], key)
    x, y = data()
    before = params(model)
    for _ in range(2):
        opt.step(closure(model, x, y))
    after = params(model)
    assert all(torch.equal(after[n], before[n]) for n, _ in named[:2])  # lr = 0 kept: first layer frozen
    assert not any(torch.equal(after[n], before[n]) for n, _ in named[2:])


def test_layerwise_groups_of_named_pairs_and_plain_parameters_still_work():
    model = mlp()
    opt = Helene(model.named_parameters(), layerwise="block", lam={"default": 0.5})
    assert all(g["lam"] == 0.5 for g in opt.param_groups) and opt.defaults["lam"] == 0.5
    plain = Helene(model.parameters(), layerwise="tensor")
    assert len(plain.param_groups) == len(list(model.parameters()))


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("cls,kwargs,field", [
    (ZOSGD, {"weight_decay": float("inf")}, "weight_decay"),
    (ZOAdam, {"weight_decay": float("inf")}, "weight_decay"),
    (FZOO, {"weight_decay": float("inf")}, "weight_decay"),
    (Helene, {"weight_decay": float("inf")}, "weight_decay"),
    (Helene, {"weight_decay": "0.1"}, "weight_decay"),
    (ZOSGD, {"eps": True}, "eps"),
    (ZOSGD, {"eps": float("inf")}, "eps"),
    (ZOAdam, {"adam_eps": float("nan")}, "adam_eps"),
    (ZOAdam, {"betas": (0.9, float("nan"))}, "betas"),
    (Helene, {"gamma": "1"}, "gamma"),
    (Helene, {"gamma": float("inf")}, "gamma"),
    (Helene, {"rho": "x"}, "rho"),
    (Helene, {"rho": float("inf")}, "rho"),
    (Helene, {"betas": 0.9}, "betas"),
    (Helene, {"betas": (0.9,)}, "betas"),
    (Helene, {"lam": {"default": 0.5}}, "lam"),
    (Helene, {"lam": float("inf")}, "lam"),
    (Helene, {"lam": float("nan")}, "lam"),
    (Helene, {"anneal_horizon": float("inf")}, "anneal_horizon"),
    (Helene, {"batch_size": True}, "batch_size"),
    (Helene, {"hessian_interval": 2.0}, "hessian_interval"),
    (Helene, {"layerwise": "bogus"}, "layerwise"),
    (Helene, {"layerwise": "tensor", "lam": "x"}, "lam"),
    (FZOO, {"n_probes": True}, "n_probes"),
    (FZOO, {"seed": 1.5}, "seed"),
])
def test_every_numeric_option_is_checked_with_a_value_error_naming_it(cls, kwargs, field):
    model = mlp()
    with pytest.raises(ValueError, match=field) as info:
        cls(model.named_parameters() if "layerwise" in kwargs else model.parameters(), **kwargs)
    if field not in ("layerwise",):
        assert "must be" in str(info.value)


def test_weight_decay_inf_never_reaches_the_parameters():
    with pytest.raises(ValueError, match=r"weight_decay must be a finite real number >= 0, got inf"):
        ZOSGD([torch.nn.Parameter(torch.ones(3))], lr=1e-3, weight_decay=float("inf"))
    with pytest.raises(ValueError, match="weight_decay"):
        layerwise_param_groups(mlp(), weight_decay=float("nan"))


# ------------------------------------------------------------------------------------------------- masters
def test_fp64_masters_keep_fp64_precision():
    theta = torch.tensor([1.0 + 1e-12, 0.1, -3.0 + 2e-13], dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = ZOSGD([p], lr=0.0, eps=EPS, master_weights=True)
    assert opt.state[p]["master"].dtype == torch.float64
    opt.step(lambda: (p**2).sum())
    assert torch.equal(p.detach(), theta)
    # One update, against the step written out here in fp64 (losses in fp32, as the optimizer reads them).
    lr = 1e-2
    opt = ZOSGD([p], lr=lr, eps=EPS, master_weights=True)
    z = torch.randn(3, generator=torch.Generator().manual_seed(step_seeds(0)[0]), dtype=torch.float32)
    losses = [float(((theta + a * EPS * z) ** 2).sum().to(torch.float32)) for a in (1.0, -1.0)]
    expected = theta.clone().add_(z, alpha=-lr * (losses[0] - losses[1]) / (2.0 * EPS))
    opt.step(lambda: (p**2).sum())
    assert torch.equal(p.detach(), expected)
    assert torch.equal(opt.state[p]["master"], expected)


@pytest.mark.parametrize("dtype,master_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.float32), (torch.float64, torch.float64)])
def test_a_master_is_never_less_precise_than_its_parameter(dtype, master_dtype):
    p = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    assert Helene([p], master_weights=True).state[p]["master"].dtype == master_dtype


@pytest.mark.parametrize("cls", [ZOAdam, Helene])
def test_values_the_earlier_checks_accepted_still_step_alike(cls):
    # torch.optim.Adam takes tensor betas, and an integral float seed (3.0) was accepted before validation existed:
    # both must give the step of their plain counterparts.
    runs = []
    tensor_betas = (torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.999, dtype=torch.float64))
    for betas, seed in (((0.9, 0.999), 3), (tensor_betas, 3.0)):
        model = mlp()
        opt = cls(model.parameters(), lr=1e-2, betas=betas, seed=seed)
        opt.step(closure(model, *data()))
        runs.append([p.detach().clone() for p in model.parameters()])
    for plain, other in zip(*runs):
        torch.testing.assert_close(other, plain)
