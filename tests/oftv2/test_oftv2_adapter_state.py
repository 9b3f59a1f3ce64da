"""Which parameters are trainable after each PEFT path, on every OFTv2 layer type, with modules_to_save.

The rules are PEFT's (peft issue #2759, PR #2765, and PR #3495 which PEFT 0.21.2 contains):
- ``get_peft_model`` / ``inject_adapter_in_model``: the new adapter (and its ``modules_to_save`` copy) is
  trainable, the base model frozen;
- ``add_adapter``: the added, not activated adapter is frozen; the active one keeps its state;
- ``set_adapter(name)``: ``name`` becomes the trainable one, the others are frozen;
- ``PeftModel.from_pretrained(is_trainable=False)`` freezes everything, ``modules_to_save`` included;
- ``load_adapter(is_trainable=False)`` loads frozen and changes no other adapter's state;
- ``load_adapter(is_trainable=True)`` makes the loaded adapter trainable (PEFT enables it explicitly even though
  it is not activated) and changes no other adapter's state.
Every row is also checked against PEFT's own OFT on the same model, so a change of PEFT's rules shows up here.
"""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import MixedLayers
from peft import PeftModel
from torch import nn

import oftv2  # noqa: F401
from oftv2 import OFTv2Config

TARGETS = ["embed", "conv", "proj"]


def _config(kind: str):
    if kind == "oftv2":
        return OFTv2Config(target_modules=TARGETS, modules_to_save=["head"], block_size=4)
    return peft.OFTConfig(target_modules=TARGETS, modules_to_save=["head"], oft_block_size=4, r=0)


def _trainable(model: nn.Module) -> set[str]:
    """``{kind:adapter}`` of every parameter with requires_grad: kind is the layer (or ``head`` for the
    modules_to_save copy, ``base`` for anything else)."""
    found = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        parts = name.split(".")
        if "modules_to_save" in parts:
            found.add(f"head:{parts[parts.index('modules_to_save') + 1]}")
        elif any(p.startswith(("oftv2_", "oft_")) for p in parts):
            at = next(i for i, p in enumerate(parts) if p.startswith(("oftv2_", "oft_")))
            found.add(f"{parts[at - 1]}:{parts[at + 1]}")  # <layer>.<oftv2_Q|oft_R...>.<adapter>
        else:
            found.add(f"base:{name}")
    return found


def _all(adapter: str) -> set[str]:
    return {f"{layer}:{adapter}" for layer in (*TARGETS, "head")}


NOTHING: set[str] = set()


def _run_path(kind: str, path: str, saved) -> set[str]:
    if path == "get_peft_model":
        return _trainable(peft.get_peft_model(MixedLayers(), _config(kind)))
    if path == "inject_adapter_in_model":
        return _trainable(peft.inject_adapter_in_model(_config(kind), MixedLayers()))
    if path in ("add_adapter", "add_adapter+set_adapter"):
        model = peft.get_peft_model(MixedLayers(), _config(kind))
        model.add_adapter("other", _config(kind))
        if path.endswith("set_adapter"):
            model.set_adapter("other")
        return _trainable(model)
    # "from_pretrained(T|F)[+load_adapter(T|F)][+set_adapter]"
    steps = path.split("+")
    model = PeftModel.from_pretrained(MixedLayers(), saved, is_trainable=steps[0].endswith("(T)"))
    for step in steps[1:]:
        if step.startswith("load_adapter"):
            model.load_adapter(saved, adapter_name="other", is_trainable=step.endswith("(T)"))
        else:
            model.set_adapter("other")
    return _trainable(model)


# path -> the trainable set under PEFT's rules.
EXPECTED = {
    "get_peft_model": _all("default"),
    "inject_adapter_in_model": _all("default"),
    "add_adapter": _all("default"),
    "add_adapter+set_adapter": _all("other"),
    "from_pretrained(F)": NOTHING,
    "from_pretrained(T)": _all("default"),
    "from_pretrained(F)+load_adapter(F)": NOTHING,
    "from_pretrained(T)+load_adapter(F)": _all("default"),
    "from_pretrained(F)+load_adapter(T)": _all("other"),
    "from_pretrained(T)+load_adapter(T)": _all("default") | _all("other"),
    "from_pretrained(F)+load_adapter(F)+set_adapter": _all("other"),
    "from_pretrained(T)+load_adapter(T)+set_adapter": _all("other"),
}


@pytest.fixture(scope="module")
def saved_adapters(tmp_path_factory):
    """The same model saved once with each method's adapter."""
    out = {}
    for kind in ("oftv2", "oft"):
        path = tmp_path_factory.mktemp(kind)
        peft.get_peft_model(MixedLayers(), _config(kind)).save_pretrained(path)
        out[kind] = path
    return out


@pytest.mark.parametrize("path", list(EXPECTED))
def test_requires_grad_follows_peft_rules(path, saved_adapters):
    ours = _run_path("oftv2", path, saved_adapters["oftv2"])
    assert ours == EXPECTED[path], sorted(ours ^ EXPECTED[path])
    assert ours == _run_path("oft", path, saved_adapters["oft"])  # PEFT's own OFT agrees


def test_inactive_trainable_adapter_gets_no_gradient_and_training_moves_only_the_active_one(saved_adapters):
    """The one row where an inactive adapter is trainable: it takes no part in the forward, so it gets no
    gradient and an optimizer step leaves it unchanged."""
    model = PeftModel.from_pretrained(MixedLayers(), saved_adapters["oftv2"], is_trainable=True)
    model.load_adapter(saved_adapters["oftv2"], adapter_name="other", is_trainable=True)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).square().sum().backward()
    optimizer.step()
    moved = {n for n, p in params.items() if not torch.equal(p, before[n])}
    assert moved and all(".default" in n for n in moved)
    assert all(params[n].grad is None for n in params if ".other" in n)
