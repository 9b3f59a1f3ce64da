"""``model.peft`` given as a ``peft_type`` dict: a PEFT-saved ``adapter_config.json`` (it carries ``peft_version``)
from another PEFT release loads as PEFT itself loads it — settings the installed PEFT lacks are dropped with a
warning naming them — while the same unknown key in a hand-written dict stays a one-line typo error."""

from __future__ import annotations

import peft
import pytest

from peftplug.config_names import check_peft_spec
from peftplug.errors import ConfigError
from peftplug.loading import build_peft_config


def _saved(**extra):
    # What a newer PEFT writes: its version, known settings and one this PEFT does not have.
    return {"peft_type": "LORA", "peft_version": "9.0.0", "auto_mapping": None, "r": 4, "lora_alpha": 8,
            "target_modules": ["q_proj", "v_proj"], "lora_future_setting": True, **extra}


def test_saved_config_of_another_peft_release_loads_with_a_warning_naming_what_is_dropped():
    with pytest.warns(UserWarning, match=r"LoraConfig of the installed PEFT .* has no 'lora_future_setting': ignored"
                                         r"\. This config was saved by PEFT 9\.0\.0") as caught:
        config = build_peft_config(_saved(), "causal_lm")
    assert len([w for w in caught if "has no" in str(w.message)]) == 1
    assert isinstance(config, peft.LoraConfig)
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 8, {"q_proj", "v_proj"})
    assert not hasattr(config, "lora_future_setting")
    check_peft_spec(_saved())  # the CLI's check lets it through too


def test_hand_written_dict_with_an_unknown_key_is_a_typo_error():
    spec = _saved()
    del spec["peft_version"]
    with pytest.raises(ConfigError, match="model.peft.lora_future_setting: LoraConfig has no setting"):
        check_peft_spec(spec)
    with pytest.raises(ConfigError, match="lora_future_setting"):
        build_peft_config(spec, "causal_lm")


def test_saved_config_of_this_release_builds_without_a_warning(recwarn):
    spec = _saved()
    del spec["lora_future_setting"]
    spec["peft_version"] = peft.__version__
    config = build_peft_config(spec, "causal_lm")
    assert config.r == 4
    assert not [w for w in recwarn if "has no" in str(w.message)]
