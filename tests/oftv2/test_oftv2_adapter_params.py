"""OFTv2's parameter layout: ``<layer>.oftv2_Q.<adapter>.weight`` (PEFT's module-based naming, which TRL relies on),
``layer.oftv2_Q[name]`` still the tensor, and adapters saved in the earlier ``<layer>.oftv2_Q`` layout still load."""

from __future__ import annotations

import peft
import torch
from oftv2_helpers import randomize_q
from peft import PeftModel
from safetensors.torch import load_file, save_file

import oftv2
from oftv2 import OFTv2Config
from peftplug.adapter_params import AdapterParameterDict


def test_names_carry_the_adapter_between_dots(tiny_model):
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["q_proj"], block_size=8))
    names = [n for n, _ in model.named_parameters() if "oftv2_Q" in n]
    assert names and all(n.endswith(".oftv2_Q.default.weight") for n in names)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.oftv2_Q["default"], torch.nn.Parameter) and "default" in layer.oftv2_Q
    # What TRL does to build a reference adapter: add one, copy by renamed parameter name.
    model.add_adapter("ref", model.peft_config["default"])
    randomize_q(model, std=0.05)
    for name, param in model.named_parameters():
        if ".default." in name and "oftv2_Q" in name:
            model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
    assert torch.equal(layer.oftv2_Q["ref"], layer.oftv2_Q["default"])


def test_assignment_keeps_the_trainable_flag_and_casts():
    params = AdapterParameterDict({"a": torch.zeros(2, 3)})
    params["a"].requires_grad_(False)
    params["a"] = params["a"].to(torch.float64)  # PEFT's device/dtype move assigns a plain tensor back
    assert isinstance(params["a"], torch.nn.Parameter) and params["a"].dtype == torch.float64
    assert not params["a"].requires_grad
    del params["a"]
    assert "a" not in params and len(params) == 0


def test_an_adapter_saved_in_the_old_layout_loads(tiny_model, tokens, tmp_path):
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8))
    randomize_q(model, std=0.03)
    model.eval()
    with torch.no_grad():
        expected = model(tokens).logits
    model.save_pretrained(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    state = load_file(weights)
    assert state and all(k.endswith(".oftv2_Q.weight") for k in state)
    save_file({k.removesuffix(".weight"): v for k, v in state.items()}, weights)  # the earlier layout
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, expected)
    n_layers = sum(isinstance(m, oftv2.OFTv2Layer) for m in loaded.modules())
    assert n_layers == len(state)


def test_a_full_state_dict_in_the_old_layout_loads(tiny_model, tokens):
    # Lightning checkpoints hold model.state_dict() keys, which carry the adapter name: <layer>.oftv2_Q.default.
    source = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8)).eval()
    randomize_q(source, std=0.03)
    old = {k.removesuffix(".weight") if ".oftv2_Q." in k else k: v for k, v in source.state_dict().items()}
    assert any(k.endswith(".oftv2_Q.default") for k in old)
    target = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8)).eval()
    result = target.load_state_dict(old, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert torch.equal(target(tokens).logits, source(tokens).logits)
