"""Fourth review of ``compile``: adapter state changed after ``torch.compile`` reaches the compiled model.

A graph that dynamo kept from before ``set_adapter``, ``disable_adapter()``, a merge or an unmerge would compute the
old adapter silently. Each change must fail the graph's guards (a new graph, or an earlier one that fits again) so
that the compiled loss and gradients equal eager ones for the state now. Regression coverage (it held here):
``backend="eager"``, since the guards are dynamo's whatever the backend.
"""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q

import oftv2
from peftplug.tiny import tiny_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(tiny_model("llama", seed=0, num_hidden_layers=1), config, adapter_name="a")
    model.add_adapter("b", oftv2.OFTv2Config(block_size=16, target_modules=["q_proj", "v_proj"]))
    randomize_q(model, std=0.1)
    return model


def _step(model, call, batch):
    """Loss and the gradients it gives (none when no adapter is trainable)."""
    loss = call(**batch).loss
    if not loss.requires_grad:
        return loss.detach(), {}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _apply(model, state):
    if state in ("a", "b"):
        model.set_adapter(state)


def test_set_adapter_and_disable_adapter_after_compile():
    model = _model().train()
    ids = torch.randint(4, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    states = ["a", "b", "off", "a", "b"]
    expected = {}
    for state in states[:3]:
        _apply(model, state)
        if state == "off":
            with model.disable_adapter():
                expected[state] = _step(model, model, batch)
        else:
            expected[state] = _step(model, model, batch)
    assert expected["a"][0] != expected["b"][0] != expected["off"][0]
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    model.set_adapter("a")
    for state in states:
        _apply(model, state)
        if state == "off":
            with model.disable_adapter():
                loss, grads = _step(model, compiled, batch)
        else:
            loss, grads = _step(model, compiled, batch)
        eager_loss, eager_grads = expected[state]
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6, msg=state)
        assert grads.keys() == eager_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=f"{state} {name}")


def test_merge_and_unmerge_after_compile():
    model = _model().eval()
    ids = torch.randint(4, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        torch.testing.assert_close(compiled(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
        model.merge_adapter()
        torch.testing.assert_close(compiled(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
        # Disabled while merged: the layers unmerge inside the compiled forward, as PEFT's do in theirs.
        with model.disable_adapter():
            torch.testing.assert_close(compiled(input_ids=ids).logits, plain, rtol=1e-5, atol=1e-5)
        assert not any(m.merged for m in model.modules() if isinstance(m, oftv2.OFTv2Layer))
        torch.testing.assert_close(compiled(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
