"""OFTv2's inference rotation cache (oftv2/rotation_cache.py): eval-mode forwards without autograd compute each
adapter's blocks once and then only rotate. Every cached output is compared with the same model's uncached one
(autograd on, the per-forward series), and every way the parameter or its settings change is seen."""

from __future__ import annotations

import copy
import dataclasses

import peft
import pytest
import torch
from oftv2_helpers import MixedLayers, randomize_q

import oftv2
from oftv2 import layer as oftv2_layer
from oftv2 import rotation_cache, stacking
from peftplug import parameter_writes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def series_calls(monkeypatch):
    """Counts the per-forward series (``ops.cayley_rotate``) and the blocks computed for the cache."""
    calls = {"series": 0, "blocks": 0}
    real_rotate, real_blocks = oftv2_layer.ops.cayley_rotate, oftv2_layer.OFTv2Layer.get_rotation

    def rotate(*args, **kwargs):
        calls["series"] += 1
        return real_rotate(*args, **kwargs)

    def blocks(self, *args, **kwargs):
        calls["blocks"] += 1
        return real_blocks(self, *args, **kwargs)

    monkeypatch.setattr(oftv2_layer.ops, "cayley_rotate", rotate)
    monkeypatch.setattr(oftv2_layer.OFTv2Layer, "get_rotation", blocks)
    return calls


def _llama(tiny_model, **config):
    model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2),
                                oftv2.OFTv2Config(block_size=8, target_modules="all-linear", **config))
    randomize_q(model, std=0.05, seed=1)
    return model.eval()


def _uncached(model, *inputs):
    """The output with autograd on (no cache), detached."""
    with torch.enable_grad():
        out = model(*inputs)
    return (out.logits if hasattr(out, "logits") else out).detach()


def _cached(model, *inputs):
    with torch.no_grad():
        out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def test_eval_without_autograd_computes_each_rotation_once(tiny_model, tokens, series_calls):
    model = _llama(tiny_model)
    layers = stacking.oftv2_layers(model)
    expected = _uncached(model, tokens)
    assert series_calls == {"series": len(layers), "blocks": 0}
    for _ in range(3):
        torch.testing.assert_close(_cached(model, tokens), expected, rtol=1e-5, atol=1e-6)
    # One set of blocks per layer on the first cached forward, nothing computed after it.
    assert series_calls == {"series": len(layers), "blocks": len(layers)}
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-6)
    assert series_calls["blocks"] == len(layers)


def test_embedding_conv_and_linear_layers(series_calls):
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(1))
    model = peft.get_peft_model(MixedLayers(), oftv2.OFTv2Config(block_size=4, target_modules=["embed", "conv",
                                                                                                 "proj"]))
    randomize_q(model, std=0.05)
    model.eval()
    expected = _uncached(model, ids)
    before = series_calls["blocks"]  # (the conv evaluates its rotated filter here: blocks without the cache)
    for _ in range(2):
        torch.testing.assert_close(_cached(model, ids), expected, rtol=1e-5, atol=1e-6)
    assert series_calls["blocks"] - before == 3  # once per layer, conv included


def test_every_change_of_the_parameter_or_its_settings_is_seen(tiny_model, tokens, series_calls):
    model = _llama(tiny_model)
    _cached(model, tokens)
    layer = stacking.oftv2_layers(model)[0]
    q = layer.oftv2_Q["default"]

    def check(what):
        before = series_calls["blocks"]
        torch.testing.assert_close(_cached(model, tokens), _uncached(model, tokens), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {m}")
        assert series_calls["blocks"] > before, what

    with torch.no_grad():
        q.add_(0.05)  # an in-place write under no_grad (what an optimizer step does)
    check("in-place write")
    state = {k: v + 0.01 for k, v in peft.get_peft_model_state_dict(model).items()}
    peft.set_peft_model_state_dict(model, state)
    check("load_state_dict")
    layer.oftv2_settings["default"] = dataclasses.replace(layer.oftv2_settings["default"], max_q_norm=0.05)
    check("settings replaced")
    model.to(torch.float64)
    model.to(torch.float32)  # new storage, same values and version counter state as a fresh tensor
    check("moved")
    with torch.no_grad():
        q.data.add_(0.05)  # bypasses the version counter: the documented case for clear()
    rotation_cache.clear(model)
    check("after clear")
    with torch.no_grad():
        q.data.add_(0.05)
    parameter_writes.parameters_written()  # the process-wide remedy (steering's plans too)
    check("after parameters_written")


def test_training_neither_reads_nor_fills_the_cache_and_train_mode_drops_it(tiny_model, tokens, series_calls):
    model = _llama(tiny_model)
    _cached(model, tokens)
    layers = stacking.oftv2_layers(model)
    assert all(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in layers)
    model.train()
    assert not any(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in layers)
    with torch.no_grad():  # train mode without autograd (zeroth-order optimizers perturb and evaluate like this)
        model(tokens)
    model(tokens).logits.sum().backward()  # eval or train, autograd on: the series every forward
    assert not any(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in layers)
    assert series_calls["series"] == 2 * len(layers)
    assert all(layer.oftv2_Q["default"].grad is not None for layer in layers)


def test_compiled_eval_forward_has_no_break_and_equals_eager(tiny_model, tokens):
    model = _llama(tiny_model)
    expected = _uncached(model, tokens)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens).logits, expected, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize(("optimizer", "compiled_step"), [
    pytest.param(lambda params: torch.optim.AdamW(params, lr=0.05, fused=True), False, id="adamw"),
    pytest.param(lambda params: torch.optim.Adam(params, lr=0.05, fused=True), False, id="adam"),
    pytest.param(lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, fused=True), False, id="sgd"),
    pytest.param(lambda params: torch.optim.AdamW(params, lr=0.05, fused=True), True, id="adamw-compiled-step"),
])
def test_a_fused_optimizer_step_is_seen(tiny_model, tokens, optimizer, compiled_step):
    # Fused optimizers write the parameters in place without bumping their version counter; the cache must still
    # follow them (an eval-mode training loop: RL, or training without dropout). Also when the step is compiled.
    model = _llama(tiny_model)
    layer = stacking.oftv2_layers(model)[0]
    q = layer.oftv2_Q["default"]
    before = _cached(model, tokens)  # fills the cache
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    step = torch.compile(opt.step, backend="aot_eager") if compiled_step else opt.step
    torch._dynamo.reset()
    for _ in range(2):  # a second step after a cached forward too
        version = q._version
        model(tokens).logits.square().mean().backward()
        step()
        opt.zero_grad()
        assert q._version == version  # what makes the version alone insufficient
        expected = _uncached(model, tokens)
        assert (expected - before).abs().max() > 1e-3  # the step moved the outputs
        torch.testing.assert_close(_cached(model, tokens), expected, rtol=1e-5, atol=1e-6)
        before = expected
    torch._dynamo.reset()
