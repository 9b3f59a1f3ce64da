"""Dispatch once: an OFTv2 layer resolves its kernels when the adapter is created and when the layer moves, never in
the forward (the first GPU run measured the per-call dispatch as a large part of a launch-bound step)."""

from __future__ import annotations

import peft
import torch
from oftv2_helpers import MixedLayers, randomize_q
from torch import nn

import oftv2
from oftv2 import dispatch
from oftv2.layer import Linear


def _counting_resolve(monkeypatch, answer_auto: str | None = None) -> list:
    """Counts ``peftplug_kernels.ops.resolve_impl`` calls (optionally answering ``auto`` with ``answer_auto``)."""
    calls = []
    real = dispatch.ops.resolve_impl

    def resolve(impl, *tensors, **kwargs):
        calls.append(impl)
        return answer_auto if (impl == "auto" and answer_auto) else real(impl, *tensors, **kwargs)

    monkeypatch.setattr(dispatch.ops, "resolve_impl", resolve)
    return calls


def test_forward_and_backward_resolve_nothing(monkeypatch):
    model = peft.get_peft_model(MixedLayers(), oftv2.OFTv2Config(block_size=4, target_modules=["embed", "conv",
                                                                                                "proj"]))
    randomize_q(model)
    calls = _counting_resolve(monkeypatch)
    ids = torch.randint(0, 10, (2, 5))
    for _ in range(3):
        model(ids).square().mean().backward()
    assert calls == []
    # A move (here a dtype change; .to("cuda") takes the same path) re-resolves every adapter once, eagerly.
    model.double()
    n_layers = sum(isinstance(m, oftv2.layer.OFTv2Layer) for m in model.modules())
    assert len(calls) == 2 * n_layers  # Cayley-Neumann and the block rotation, per layer
    calls.clear()
    model(ids).sum().backward()
    assert calls == []


def test_plan_follows_settings_and_device(monkeypatch):
    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(8, 8)), oftv2.OFTv2Config(block_size=4,
                                                                                   target_modules=["0"]))
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    plan = layer.kernel_plan("default")
    assert (plan.cayley, plan.rotate, plan.device) == ("torch", "torch", torch.device("cpu"))  # auto on CPU
    assert layer.kernel_plan("default") is plan  # cached
    # A device whose table chooses Triton: picked up by refresh_kernels, as after a move.
    _counting_resolve(monkeypatch, answer_auto="triton")
    layer.refresh_kernels()
    assert (layer.kernel_plan("default").cayley, layer.kernel_plan("default").rotate) == ("triton", "triton")
    # Settings replaced by hand: the stale plan is rebuilt on the next read (a forced impl passes through).
    settings = layer.oftv2_settings["default"]
    layer.oftv2_settings["default"] = settings.__class__(**{**settings.__dict__, "impl": "torch"})
    assert layer.kernel_plan("default").rotate == "torch"
    # Parameters moved without _apply (accelerate hooks, load_state_dict(assign=True)): the device check rebuilds.
    layer._oftv2_kernels["default"] = layer.kernel_plan("default")._replace(device=torch.device("meta"))
    assert layer.kernel_plan("default").device == torch.device("cpu")


def test_exact_cayley_and_large_blocks_plan_the_reference(monkeypatch):
    _counting_resolve(monkeypatch, answer_auto="triton")
    torch.manual_seed(0)
    for config in (oftv2.OFTv2Config(block_size=4, target_modules=["0"], orthogonalization="cayley"),
                   oftv2.OFTv2Config(block_size=128, target_modules=["0"])):
        model = peft.get_peft_model(nn.Sequential(nn.Linear(128, 8)), config)
        plan = next(m for m in model.modules() if isinstance(m, Linear)).kernel_plan("default")
        # No Triton Cayley-Neumann kernel for the exact form or blocks above 64; the rotation kernel takes any.
        assert (plan.cayley, plan.rotate) == ("torch", "triton")


def test_plan_follows_a_change_to_the_dispatch_table(monkeypatch):
    from peftplug_kernels import dispatch_table

    monkeypatch.setattr(dispatch_table, "TABLE", dict(dispatch_table.TABLE))  # the setters write into TABLE
    # On CPU "auto" never asks the table (Triton would run interpreted); let it ask, as on a GPU.
    monkeypatch.setattr(dispatch.ops, "resolve_impl", lambda impl, *tensors, op: (
        dispatch_table.kernel_choice(op, "cpu") if impl == "auto" else impl))
    model = peft.get_peft_model(nn.Sequential(nn.Linear(8, 8)), oftv2.OFTv2Config(block_size=4,
                                                                                   target_modules=["0"]))
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    assert layer.kernel_plan("default").rotate == "torch"
    # E.g. after measuring a new GPU: the next read rebuilds the plan, no refresh_kernels() call needed.
    dispatch_table.set_choice("cpu", "block_rotate", "triton", "a test, 2026-12-05")
    assert (layer.kernel_plan("default").rotate, layer.kernel_plan("default").cayley) == ("triton", "torch")
    plan = layer.kernel_plan("default")
    assert layer.kernel_plan("default") is plan  # and is cached again until the next change
