"""Second review of the zeroth-order base: fp32 master copies follow parameters written outside the optimizer
(weights loaded after it was built, masters lost to a checkpoint of another dtype, a parameter unfrozen later),
and misused closures and out-of-range seeds are refused in one line."""

from __future__ import annotations

import pytest
import torch

from helene import FZOO, ZOSGD, Helene
from tests.helene.zo_testing import closure as _closure
from tests.helene.zo_testing import data as _data
from tests.helene.zo_testing import mlp as _mlp
from tests.helene.zo_testing import params as _params

MAKERS = {
    "zosgd": lambda ps: ZOSGD(ps, lr=1e-2, seed=4),
    "fzoo": lambda ps: FZOO(ps, lr=1e-2, n_probes=3, seed=4),
    "helene": lambda ps: Helene(ps, lr=1e-2, hessian="agnb", hessian_interval=1, anneal_horizon=5.0, seed=4),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_weights_loaded_after_the_optimizer_was_built_are_the_ones_stepped(name, dtype):
    """Loading weights into the model before or after building the optimizer must give the same steps; a stale
    master used to put the construction-time weights back at the first step."""
    x, y = _data()
    loaded = _mlp(seed=5, dtype=dtype).state_dict()
    late = _mlp(seed=0, dtype=dtype)
    late_opt = MAKERS[name](late.parameters())
    late.load_state_dict(loaded)
    early = _mlp(seed=0, dtype=dtype)
    early.load_state_dict(loaded)
    early_opt = MAKERS[name](early.parameters())
    for _ in range(2):
        late_opt.step(_closure(late, x, y))
        early_opt.step(_closure(early, x, y))
    moved = 0.0
    for (n, p), q in zip(late.named_parameters(), early.parameters()):
        assert torch.equal(p, q), n
        moved = max(moved, (p.float() - loaded[n].float()).abs().max().item())
    assert moved > 0  # both stepped away from the loaded weights, alike


def test_an_fp32_master_kept_for_an_fp32_parameter_follows_a_load_too():
    x, y = _data()
    model = _mlp()
    opt = ZOSGD(model.parameters(), lr=0.0, master_weights=True)
    loaded = _mlp(seed=5).state_dict()
    model.load_state_dict(loaded)
    opt.step(_closure(model, x, y))
    for n, p in model.named_parameters():
        assert torch.equal(p, loaded[n]), n  # lr 0 and a bit-exact restore: the loaded weights, unchanged


def test_masters_missing_from_a_loaded_state_are_made_again():
    """A state saved over fp32 parameters (no masters under "auto") loaded over bf16 ones: the bf16 parameters
    must still get masters (bit-exact restore) rather than an in-place perturbation that drifts."""
    x, y = _data()
    fp32 = _mlp()
    opt32 = ZOSGD(fp32.parameters(), lr=0.0, seed=2)
    opt32.step(_closure(fp32, x, y))
    half = _mlp(dtype=torch.bfloat16)
    before = _params(half)
    opt = ZOSGD(half.parameters(), lr=0.0, seed=2)
    opt.load_state_dict(opt32.state_dict())
    for _ in range(3):
        opt.step(_closure(half, x, y))
    for n, p in half.named_parameters():
        assert torch.equal(p, before[n]), n
        assert opt.state[p]["master"].dtype == torch.float32


def test_a_half_parameter_made_trainable_later_gets_its_master():
    x, y = _data()
    model = _mlp(dtype=torch.bfloat16)
    model[0].weight.requires_grad_(False)
    opt = ZOSGD(model.parameters(), lr=0.0, seed=1)
    model[0].weight.requires_grad_(True)
    before = _params(model)
    for _ in range(3):
        opt.step(_closure(model, x, y))
    assert "master" in opt.state[model[0].weight]
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_parameter_cast_to_half_without_masters_is_refused_at_the_step():
    x, y = _data()
    model = _mlp()
    opt = ZOSGD(model.parameters(), master_weights=False)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="cannot be perturbed and restored exactly"):
        opt.step(_closure(model, x, y))


@pytest.mark.parametrize("result", [None, {"loss": torch.tensor(1.0)}, "1.0"], ids=["none", "dict", "str"])
def test_a_closure_that_returns_no_loss_is_refused_in_one_line_and_theta_is_restored(result):
    x, _ = _data()
    model = _mlp(dtype=torch.bfloat16)
    before = _params(model)
    opt = ZOSGD(model.parameters(), lr=1e-2)

    def closure():
        model(x.bfloat16())
        return result

    with pytest.raises(TypeError, match=r"closure must return the batch loss .*got "):
        opt.step(closure)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert opt.step_count == 0


def test_a_model_output_closure_is_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    model = _mlp()
    opt = ZOSGD(model.parameters())
    out = transformers.modeling_outputs.SequenceClassifierOutput(loss=torch.tensor(1.0), logits=torch.zeros(1, 3))
    with pytest.raises(TypeError, match="got SequenceClassifierOutput; e.g. return model"):
        opt.step(lambda: out)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_outside_the_generator_range_names_the_field(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[-9223372036854775808, 18446744073709551615\]"):
        ZOSGD(_mlp().parameters(), seed=seed)
    ZOSGD(_mlp().parameters(), seed=2**64 - 1).step(_closure(_mlp(), *_data()))  # the largest is accepted


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (a model split over GPUs)")
def test_same_shape_tensors_on_two_devices_get_independent_directions():
    a = torch.nn.Parameter(torch.zeros(64, 64, device="cuda:0"))
    b = torch.nn.Parameter(torch.zeros(64, 64, device="cuda:1"))
    opt = ZOSGD([a, b], lr=1.0, eps=1.0, seed=0)
    draw = opt._z_stream(123)
    za, zb = draw(a), draw(b)
    assert not torch.equal(za.cpu(), zb.cpu())
    # The first device keeps the step seed's stream, as on one device.
    assert torch.equal(za, torch.randn(64, 64, generator=torch.Generator("cuda:0").manual_seed(123), device="cuda:0"))
