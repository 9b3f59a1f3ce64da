"""Second review of the PEFT integration: config values PEFT's generic entry points used to take silently or fail on
with a traceback (steering's and PCT's boolean switches, steering's task types, plugin-type dicts whose package was
not imported yet)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForTokenClassification

from peftplug.tiny import tiny_config


def _decomposition(tmp_path):
    import prompt_transfer as pt

    g = torch.Generator().manual_seed(1)
    dec = pt.decompose({f"s{i}": torch.randn(3, 64, generator=g) for i in range(3)}, contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    return str(tmp_path / "dec")


@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_steering_normalize_must_be_a_bool(value, tiny_model):
    """``normalize="false"`` is truthy: it used to normalise the vectors (same logits as ``normalize=True``)."""
    from steering import SteeringConfig

    with pytest.raises(ValueError, match=r"SteeringConfig\.normalize must be True or False"):
        SteeringConfig(layers=[0], normalize=value, task_type="CAUSAL_LM")
    x = torch.randint(4, 90, (2, 8))
    logits = {}
    for normalize in (False, True):  # the accepted values still do what they say
        pm = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0], normalize=normalize))
        pm.base_model.set_vectors({0: 5 * torch.ones(64)})
        with torch.no_grad():
            logits[normalize] = pm(x).logits
    assert not torch.allclose(logits[False], logits[True])


def test_steering_hidden_size_refuses_bool():
    from steering import SteeringConfig

    with pytest.raises(ValueError, match=r"SteeringConfig\.hidden_size must be a positive int"):
        SteeringConfig(layers=[0], hidden_size=True)


@pytest.mark.parametrize("task_type", ["SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS"])
def test_steering_refuses_task_types_that_train_a_head(task_type):
    """PEFT's SEQ_CLS / TOKEN_CLS / QUESTION_ANS models add the head to ``modules_to_save``; a steering adapter is
    vectors only. Refused at construction, naming the field and the accepted values."""
    from steering import SteeringConfig

    with pytest.raises(ValueError, match=r"SteeringConfig\.task_type must be one of .*'CAUSAL_LM'.*got '" + task_type):
        SteeringConfig(layers=[0], task_type=task_type)


def test_steering_task_type_set_after_construction_is_refused_at_creation():
    """A token classifier with task_type TOKEN_CLS used to train the ``score`` head as modules_to_save and save an
    adapter that ``PeftModel.from_pretrained`` then refused; a trainer may set task_type after construction."""
    from steering import SteeringConfig

    config = SteeringConfig(layers=[0])
    config.task_type = "TOKEN_CLS"
    model = AutoModelForTokenClassification.from_config(tiny_config("llama", "seq_cls"))
    with pytest.raises(ValueError, match=r"SteeringConfig\.task_type must be one of"):
        peft.get_peft_model(model, config)


def test_steering_on_a_classifier_with_task_type_none_saves_and_reloads(tmp_path, tiny_model):
    """The way the refusal points to: task_type None steers a classifier, trains only the vectors, reloads."""
    from steering import SteeringConfig

    pm = peft.get_peft_model(tiny_model("llama", task="seq_cls"), SteeringConfig(layers=[0, 1]))
    assert {n.split(".")[-3] for n, p in pm.named_parameters() if p.requires_grad} == {"steer_vector"}
    pm.base_model.set_vectors({0: torch.ones(64), 1: -torch.ones(64)})
    x = torch.randint(4, 90, (2, 8))
    with torch.no_grad():
        reference = pm(input_ids=x).logits
    pm.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] is None
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama", task="seq_cls"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, reference)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_pct_trainable_residual_must_be_a_bool(value, tmp_path, tiny_model):
    """``trainable_residual="false"`` used to train the residual prompt (it is truthy)."""
    import prompt_transfer as pt

    path = _decomposition(tmp_path)
    with pytest.raises(ValueError, match="trainable_residual must be True or False"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, trainable_residual=value)
    model = peft.get_peft_model(tiny_model("llama"),
                                pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, trainable_residual=False))
    assert not any("residual" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("names", ["abc", ["s0", 3, "s2"], ["s0", "", "s2"]])
def test_pct_source_names_must_be_a_list_of_names(names):
    """A string of K characters passed the length check as K one-letter source names."""
    import prompt_transfer as pt

    with pytest.raises(ValueError, match="source_names must be a list of non-empty task names"):
        pt.PCTConfig(task_type="CAUSAL_LM", num_sources=3, num_virtual_tokens=3, source_names=names)


_TYPO_SNIPPET = """
import sys
from peftplug.errors import ConfigError
from peftplug.loading import build_peft_config
assert "{package}" not in sys.modules
try:
    build_peft_config({spec!r}, "causal_lm")
except ConfigError as err:
    print("CONFIG-ERROR", err)
"""


@pytest.mark.parametrize("package, spec, expected", [
    ("oftv2", {"peft_type": "OFTV2", "blok_size": 4},
     "model.peft.blok_size: OFTv2Config has no setting 'blok_size'; did you mean 'block_size'?"),
    ("steering", {"peft_type": "STEERING", "layers": [0], "normalise": True},
     "model.peft.normalise: SteeringConfig has no setting 'normalise'; did you mean 'normalize'?"),
])
def test_plugin_type_dict_typo_is_named_before_its_package_is_imported(package, spec, expected, run_fresh):
    """In a process that had not imported the plugin package, the key check skipped the dict (its type was not in
    PEFT's mapping yet) and the typo reached the constructor as ``TypeError: ... unexpected keyword argument``."""
    proc = run_fresh(_TYPO_SNIPPET.format(package=package, spec=spec))
    assert f"CONFIG-ERROR {expected}" in proc.stdout, proc.stdout + proc.stderr
