"""Steering's parameter layout: ``<block>.steer_vector.<adapter>.weight`` (PEFT's module-based naming, which TRL's
``.default.`` -> ``.ref.`` copy relies on), ``layer.steer_vector[name]`` still the tensor, saved keys
``<block>.steer_vector.weight``, and adapters saved in the earlier ``<block>.steer_vector`` layout still loading
(``PeftModel.from_pretrained``, ``load_adapter``, full state dicts, the steering CLI)."""

from __future__ import annotations

import peft
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

import steering
from steering import SteeringConfig

IDS = torch.tensor([[5, 9, 14, 20, 33, 41], [7, 3, 28, 2, 11, 60]])


def _vectors(seed: int = 0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {0: torch.randn(64, generator=gen), 1: torch.randn(64, generator=gen)}


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits


def _old_layout(folder) -> dict[str, torch.Tensor]:
    """Rewrites ``folder``'s saved adapter with the keys steering wrote before ``peftplug.adapter_params``."""
    weights = folder / "adapter_model.safetensors"
    state = load_file(weights)
    assert state and all(k.endswith(".steer_vector.weight") for k in state), sorted(state)
    old = {k.removesuffix(".weight"): v for k, v in state.items()}
    save_file(old, weights, metadata={"format": "pt"})
    return old


def test_names_carry_the_adapter_between_dots(tiny_model):
    model = steering.steering_adapter(tiny_model("llama"), _vectors())
    names = [n for n, _ in model.named_parameters() if "steer_vector" in n]
    assert len(names) == 2 and all(n.endswith(".steer_vector.default.weight") for n in names), names
    layer = model.base_model.steering_layers()[1]
    assert isinstance(layer.steer_vector["default"], torch.nn.Parameter) and "default" in layer.steer_vector
    # What TRL's DPO/GRPO/KTO/RLOO trainers do to build a reference adapter: add one, copy by renamed name.
    model.add_adapter("ref", model.peft_config["default"])
    for name, param in model.named_parameters():
        if ".default." in name:
            model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
    for index, vector in _vectors().items():
        assert torch.equal(model.base_model.get_vectors("ref")[index], vector)
    steered = _logits(model)
    model.base_model.set_adapter("ref")
    assert torch.equal(_logits(model), steered)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_an_adapter_saved_in_the_old_layout_loads(tiny_model, tmp_path, low_cpu_mem_usage):
    source = steering.steering_adapter(tiny_model("llama"), _vectors(), multiplier=1.5, layer_multipliers={1: -2.0})
    expected = _logits(source)
    assert not torch.equal(expected, _logits(tiny_model("llama")))  # the vectors act
    source.save_pretrained(tmp_path)
    old = _old_layout(tmp_path)
    assert sorted(old) == [f"base_model.model.model.layers.{i}.steer_vector" for i in (0, 1)]

    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    assert torch.equal(_logits(loaded), expected)
    for index, vector in _vectors().items():
        assert torch.equal(loaded.base_model.get_vectors()[index], vector)
    # Also as a second adapter, under another name.
    other = steering.steering_adapter(tiny_model("llama"), {1: torch.ones(64)}, adapter_name="x")
    other.load_adapter(tmp_path, adapter_name="y", low_cpu_mem_usage=low_cpu_mem_usage)
    other.base_model.set_adapter("y")
    assert torch.equal(_logits(other), expected)


def test_a_full_state_dict_in_the_old_layout_loads(tiny_model):
    # Full state_dict() checkpoints (Lightning's) carry the adapter name: <block>.steer_vector.default.
    source = steering.steering_adapter(tiny_model("llama"), _vectors())
    old = {k.removesuffix(".weight") if ".steer_vector." in k else k: v for k, v in source.state_dict().items()}
    assert sum(k.endswith(".steer_vector.default") for k in old) == 2
    target = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM"))
    result = target.load_state_dict(old, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(target), _logits(source))


def test_the_cli_reads_an_adapter_saved_in_the_old_layout(tiny_model, tmp_path):
    from steering.cli import main

    steering.steering_adapter(tiny_model("llama"), _vectors()).save_pretrained(tmp_path / "old")
    _old_layout(tmp_path / "old")
    assert main(["export-easyedit", "--model", "tiny:llama", "--adapter", str(tmp_path / "old"),
                 "--out", str(tmp_path / "ee")]) == 0
    exported = steering.import_easyedit(tmp_path / "ee", hidden_size=64)
    assert exported.keys() == _vectors().keys()
    for index, vector in _vectors().items():
        torch.testing.assert_close(exported[index], vector, rtol=0, atol=0)
