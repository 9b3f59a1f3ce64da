"""A ``--model.peft`` dict with another ``peft_type`` over a recipe whose adapter is a ``class_path`` config: jsonargparse
merged it into the recipe class's ``init_args`` and the class set its own type, so ``peftplug fit --config
recipes/quickstart.yaml --model.peft '{"peft_type": "LORA", "r": 4}'`` trained OFTv2 with r=4 (16M parameters) as if
it were LoRA, silently. Now one line says how to switch adapters, and the way it names works."""

from __future__ import annotations

import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from test_cli_review2_first_hour import QUICKSTART, TINY, _error_line

from peftplug.cli import cli


def _fit(tmp_path, *args) -> list[str]:
    return [str(a) for a in ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir", tmp_path / "runs",
                             *args]]


@pytest.mark.parametrize("peft_type", ["LORA", "lora", "IA3"])
def test_a_dict_of_another_type_over_a_class_path_recipe_is_one_line(tmp_path, capsys, peft_type):
    spec = json.dumps({"peft_type": peft_type, "r": 4, "block_size": None} if peft_type != "IA3" else
                      {"peft_type": peft_type})
    line = _error_line(capsys, _fit(tmp_path, "--model.peft", spec))
    expected = "peft.LoraConfig" if peft_type.upper() == "LORA" else "peft.IA3Config"
    assert line.startswith(f"peftplug: error: model.peft: peft_type {peft_type.upper()!r} was given to "
                           "oftv2.OFTv2Config"), line
    assert f"--model.peft {expected} --model.peft.init_args." in line, line


def test_an_unknown_type_in_the_dict_is_named_with_the_closest(tmp_path, capsys):
    line = _error_line(capsys, _fit(tmp_path, "--model.peft", json.dumps({"peft_type": "LORAA", "r": 4})))
    assert line == "peftplug: error: model.peft.init_args.peft_type: unknown type 'LORAA'; did you mean 'LORA'?", line


def test_the_named_switch_trains_lora_and_the_same_type_still_merges(tmp_path):
    lora = cli(_fit(tmp_path / "lora", "--model.peft", "peft.LoraConfig", "--model.peft.init_args.r", "4"))
    config = lora.model.model.peft_config["default"]
    assert type(config).__name__ == "LoraConfig" and config.r == 4
    assert any("lora_A" in name for name, _ in lora.model.model.named_parameters())
    # A dict of the recipe's own type is a plain override of its settings, as before.
    same = cli(_fit(tmp_path / "oft", "--model.peft", json.dumps({"peft_type": "OFTV2", "block_size": 16})))
    config = same.model.model.peft_config["default"]
    assert type(config).__name__ == "OFTv2Config" and config.block_size == 16


def test_an_unknown_type_in_a_recipe_dict_names_the_closest_not_a_cut_list():
    from peftplug.errors import ConfigError
    from peftplug.loading import build_peft_config

    with pytest.raises(ConfigError, match=r"^peft\.peft_type 'LORAA' is unknown; did you mean 'LORA'\?$"):
        build_peft_config({"peft_type": "LORAA", "r": 4}, "causal_lm")
    with pytest.raises(ConfigError, match=r"^peft\.peft_type 'ZZZZZZ' is unknown; accepted: .*\bLORA\b.*\bOFTV2\b"):
        build_peft_config({"peft_type": "ZZZZZZ"}, "causal_lm")
