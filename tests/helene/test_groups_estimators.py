"""Layer-wise groups on real (tiny) transformers and adapters; the Hessian estimators' statistics vs the truth."""

from __future__ import annotations

import pytest
import torch

from helene import HESSIAN_ESTIMATORS, Helene, layerwise_param_groups
from helene.groups import is_no_decay, layer_key


def test_tensor_and_block_groups_on_tiny_bert(tiny_model):
    model = tiny_model("bert", "seq_cls", seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = layerwise_param_groups(model, "tensor", lam=0.3, weight_decay=0.01)
    assert sorted(n for g in groups for n in g["names"]) == sorted(trainable)
    assert all(len(g["params"]) == 1 and g["lam"] == 0.3 for g in groups)
    for g in groups:
        name = g["names"][0]
        expect_wd = 0.0 if ("bias" in name or "LayerNorm" in name or g["params"][0].ndim == 1) else 0.01
        assert g["weight_decay"] == expect_wd, name

    blocks = layerwise_param_groups(model, "block", lam={r"layer\.1": 2.0, "default": 0.5})
    layers = {g["layer"] for g in blocks}
    assert {"bert.encoder.layer.0", "bert.encoder.layer.1"} <= layers
    for g in blocks:
        assert g["lam"] == (2.0 if g["layer"] == "bert.encoder.layer.1" else 0.5)
        assert len({is_no_decay(n, p) for n, p in zip(g["names"], g["params"])}) == 1
    assert len(layerwise_param_groups(model, "model")) == 2  # decayed + not decayed
    assert layer_key("model.layers.3.self_attn.q_proj.weight", "block") == "model.layers.3"
    assert layer_key("transformer.h.0.attn.c_attn.weight", "block") == "transformer.h.0"
    with pytest.raises(ValueError, match="granularity"):
        layerwise_param_groups(model, "row")


def test_groups_follow_requires_grad_for_lora(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", "causal_lm", seed=0),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    groups = layerwise_param_groups(model, "block")
    names = [n for g in groups for n in g["names"]]
    assert names and all("lora_" in n for n in names)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = Helene(groups, lr=1e-3, seed=0, anneal_horizon=10.0)
    ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step(lambda: model(input_ids=ids, labels=ids).loss)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    frozen = tiny_model("llama", "causal_lm", seed=0).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        layerwise_param_groups(frozen)


class _Quadratic(torch.nn.Module):
    """L(θ) = ½ (θ−θ*)ᵀ A (θ−θ*) with a known Hessian A and gradient A(θ−θ*)."""

    def __init__(self, n=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(n, n, generator=g, dtype=torch.float64)
        self.register_buffer("A", q @ q.T / n + torch.diag(torch.linspace(0.5, 4.0, n, dtype=torch.float64)))
        self.register_buffer("target", torch.randn(n, generator=g, dtype=torch.float64))
        self.theta = torch.nn.Parameter(torch.zeros(n))

    def forward(self):
        d = self.theta.double() - self.target
        return 0.5 * d @ self.A @ d


def _estimates(name, n_draws=6000):
    """Independent draws of the estimator at a fixed θ (lr = 0, β2 = 0 so h = ĥ), via the optimizer's own path."""
    model = _Quadratic()
    opt = Helene(model.parameters(), lr=0.0, eps=1e-2, hessian=name, hessian_interval=1, betas=(0.9, 0.0),
                 seed=0, anneal_horizon=10.0)
    draws = []
    for _ in range(n_draws):
        opt.step(model)
        draws.append(opt.state[model.theta]["hessian"].double().clone())
    draws = torch.stack(draws)
    return model, draws.mean(0), draws.std(0) / n_draws**0.5


def test_curvature_estimator_is_unbiased_for_the_hessian_diagonal():
    model, mean, stderr = _estimates("curvature")
    diag = torch.diagonal(model.A)
    assert torch.all((mean - diag).abs() < 4 * stderr + 1e-3), (mean, diag, stderr)
    assert torch.all(stderr < 0.25 * diag)  # the test has the power to see a wrong diagonal


def test_agnb_estimate_is_nearly_isotropic_as_designed():
    """E[c²z_i²] = ‖∇L‖² + 2∇_i² (B = 1): the per-coordinate signal is a small correction to a constant."""
    model, mean, stderr = _estimates("agnb")
    grad = model.A @ (-model.target)
    expected = grad.square().sum() + 2 * grad.square()
    assert torch.all((mean - expected).abs() < 4 * stderr + 1e-3 * expected), (mean, expected, stderr)
    assert torch.all(stderr < 0.05 * expected)
    assert set(HESSIAN_ESTIMATORS) == {"agnb", "agnb_layer", "curvature", "curvature_layer", "none"}


def test_layer_curvature_is_the_mean_of_the_coordinate_estimate():
    z = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    args = (0.3, 1.2, 1.0, 0.9, 1e-2, 4)  # projected, L+, L-, L0, eps, batch
    full = HESSIAN_ESTIMATORS["curvature"](z, *args)
    layer = HESSIAN_ESTIMATORS["curvature_layer"](z, *args)
    assert layer.dim() == 0 and torch.allclose(layer, full.mean())
    assert HESSIAN_ESTIMATORS["curvature_layer"].needs_center and HESSIAN_ESTIMATORS["curvature_layer"].per_tensor


def test_helene_layerwise_regroups_named_and_plain_parameters(tiny_model):
    model = tiny_model("bert", "seq_cls", seed=0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = Helene(named, layerwise="block", lam={r"layer\.0": 3.0, "default": 0.5}, weight_decay=0.1)
    by_layer = {g["layer"]: g for g in opt.param_groups}
    assert by_layer["bert.encoder.layer.0"]["lam"] == 3.0 and by_layer["classifier"]["lam"] == 0.5
    for g in opt.param_groups:
        assert g["weight_decay"] in (0.0, 0.1)
        assert (g["weight_decay"] == 0.0) == all(is_no_decay(n, p) for n, p in zip(g["param_names"], g["params"]))
    plain = Helene([p for _, p in named], layerwise="tensor", lam=0.2)
    assert len(plain.param_groups) == len(named) and all(g["lam"] == 0.2 for g in plain.param_groups)
    with pytest.raises(ValueError, match="names"):
        Helene([p for _, p in named], layerwise="block")


def _adapter_model(kind, tiny_model):
    from peft import PromptTuningConfig, get_peft_model

    base = tiny_model("llama", "causal_lm", seed=0)
    if kind == "oftv2":
        oftv2 = pytest.importorskip("oftv2")
        return get_peft_model(base, oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"]))
    return get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


@pytest.mark.parametrize("kind", ["oftv2", "prompt_tuning"])
def test_helene_trains_only_the_adapter(kind, tiny_model):
    """Other adapters work unchanged: the groups hold exactly the trainable tensors; the loss goes down."""
    model = _adapter_model(kind, tiny_model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    groups = layerwise_param_groups(model, "tensor")
    assert {n for g in groups for n in g["names"]} == trainable
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.randint(4, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    opt = Helene(groups, lr=3e-3, eps=1e-2, batch_size=4, seed=0, anneal_horizon=10.0)

    def closure():
        return model(input_ids=ids, labels=ids).loss

    with torch.no_grad():
        before = closure().item()
    for _ in range(30):
        opt.step(closure)
    with torch.no_grad():
        after = closure().item()
    assert after < before
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
