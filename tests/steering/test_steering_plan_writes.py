"""Steering's decoding plan (the scaled vectors reused by forwards without autograd) follows every write to a vector:
fused optimizer steps, which do not bump the version counter, and ``param.data`` writes marked by
``peftplug.parameter_writes.parameters_written``."""

from __future__ import annotations

import peft
import pytest
import torch

from peftplug import parameter_writes
from steering import SteeringConfig


def _model(tiny_model):
    pm = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(0)
    hidden = pm.base_model.peft_config["default"].hidden_size
    pm.base_model.set_vectors({layer: torch.randn(hidden, generator=gen) for layer in (0, 1)})
    return pm.eval()


def _planned(pm, ids):
    """Logits from the decoding hot path (no autograd: the cached plan)."""
    with torch.no_grad():
        return pm(input_ids=ids).logits


def _fresh(pm, ids):
    """Logits with autograd on, which computes the vectors' contribution every forward (no plan)."""
    with torch.enable_grad():
        return pm(input_ids=ids).logits.detach()


def _vectors(pm):
    return [p for n, p in pm.named_parameters() if "steer_vector" in n]


@pytest.mark.parametrize("make_optimizer", [
    pytest.param(lambda params: torch.optim.AdamW(params, lr=0.5, fused=True), id="adamw-fused"),
    pytest.param(lambda params: torch.optim.SGD(params, lr=5.0, momentum=0.9, fused=True), id="sgd-fused"),
    pytest.param(lambda params: torch.optim.Adam(params, lr=0.5, foreach=True), id="adam-foreach"),
])
def test_optimizer_step_between_evaluations_is_seen(tiny_model, make_optimizer):
    torch.manual_seed(0)
    pm = _model(tiny_model)
    ids = torch.randint(1, 50, (2, 8))
    before = _planned(pm, ids)  # fills the plan
    optimizer = make_optimizer(_vectors(pm))
    pm.train()
    pm(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    pm.eval()
    after = _planned(pm, ids)
    assert not torch.allclose(after, before), "the step did not change the evaluated model"
    torch.testing.assert_close(after, _fresh(pm, ids), rtol=1e-5, atol=1e-6)


def test_data_writes_marked_by_parameters_written_are_seen(tiny_model):
    torch.manual_seed(0)
    pm = _model(tiny_model)
    ids = torch.randint(1, 50, (2, 8))
    before = _planned(pm, ids)
    for p in _vectors(pm):
        p.data.add_(1.0)  # bypasses the version counter, as some zeroth-order scripts perturb
    parameter_writes.parameters_written()
    after = _planned(pm, ids)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, _fresh(pm, ids), rtol=1e-5, atol=1e-6)


def test_unchanged_vectors_keep_the_plan(tiny_model):
    """The plan is reused while nothing was written (the point of having one: no rebuild per decoded token)."""
    pm = _model(tiny_model)
    ids = torch.randint(1, 50, (1, 4))
    _planned(pm, ids)
    layer = next(m for m in pm.modules() if getattr(m, "_plan", None) is not None)
    plan = layer._plan
    _planned(pm, ids)
    assert layer._plan is plan


def test_a_replaced_vector_parameter_is_seen(tiny_model):
    """``load_state_dict(assign=True)`` (and PEFT's dtype/device moves) put a new parameter in the vector's place."""
    pm = _model(tiny_model)
    ids = torch.randint(1, 50, (2, 8))
    before = _planned(pm, ids)
    layer = pm.base_model.steering_layers()[0]
    old = layer.steer_vector["default"]
    state = {k: v + 1.0 for k, v in layer.steer_vector.state_dict().items()}
    layer.steer_vector.load_state_dict(state, assign=True)
    assert layer.steer_vector["default"] is not old
    after = _planned(pm, ids)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, _fresh(pm, ids), rtol=1e-5, atol=1e-6)


def test_fsdp2_writes_to_the_shards_are_seen_by_eval_forwards(tmp_path, tiny_model):
    # FSDP2 gathers the vectors into the same tensor every forward (its version never moves) and frees its memory
    # afterwards, so a later gather can land at the old address: a write to the shards between two no-grad forwards
    # (a zeroth-order perturbation) looked like no write, and the plan of the old vectors was reused (0.14 off; when
    # the address comes back depends on the allocator, hence a dozen perturbations).
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        pm = _model(tiny_model)
        reference = copy.deepcopy(pm)  # unsharded, evaluated with autograd on: no plan
        inner = pm.get_base_model()
        for block in inner.model.layers:
            fully_shard(block)
        fully_shard(inner)
        pm.eval()
        ids = torch.randint(1, 50, (2, 8))
        shards, plain = _vectors(pm), _vectors(reference)
        assert shards and type(shards[0]).__name__ == "DTensor"
        for delta in (0.0,) + (0.5, -0.5) * 6:
            with torch.no_grad():
                for p in shards + plain:
                    p.add_(delta)
            torch.testing.assert_close(_planned(pm, ids), _fresh(reference, ids), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, d=delta: f"after adding {d}: {m}")
    finally:
        dist.destroy_process_group()
