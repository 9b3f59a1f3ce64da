"""A hand-edited ``adapter_config.json`` with a value of the wrong type (``"r": "8"``) is refused by
:func:`peftplug.adapter_loading.load_adapter` in one line naming the folder and the field, instead of a
``TypeError`` from inside PEFT's layers; the values PEFT itself writes still load."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peftplug.adapter_loading import load_adapter
from peftplug.errors import CheckpointError
from peftplug.tiny import tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.save_pretrained(folder)
    return folder, json.loads((folder / "adapter_config.json").read_text())


def _edited(tmp_path, saved, **changes):
    folder, config = saved
    for name in ("adapter_model.safetensors",):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


@pytest.mark.parametrize("field, value, expected", [
    ("r", "8", "expected int, got str '8'"),
    ("lora_dropout", "high", "expected float, got str 'high'"),
    ("target_modules", 5, "got int 5"),
])
def test_wrongly_typed_saved_value_is_one_line(tmp_path, saved, field, value, expected):
    folder = _edited(tmp_path, saved, **{field: value})
    with pytest.raises(CheckpointError) as info:
        load_adapter(tiny_model("llama"), folder)
    message = str(info.value)
    assert "\n" not in message
    assert str(folder) in message and f"adapter_config.json.{field}: " in message and expected in message


def test_saved_values_still_load(tmp_path, saved):
    # PEFT's own file, and a float lora_alpha (PEFT only divides by it), load as before.
    folder = _edited(tmp_path, saved, lora_alpha=16.0)
    model = load_adapter(tiny_model("llama"), folder)
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 16.0
