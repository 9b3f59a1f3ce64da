"""A ``peft.task_type`` that does not fit ``model.task`` is refused in one line: PEFT picks its model wrapper by it,
and ``CAUSAL_LM`` over a classifier stopped with an ``AttributeError`` from generation code, while
``FEATURE_EXTRACTION`` silently left the fresh classification head untrained and unsaved."""

from __future__ import annotations

import pytest
from peft import LoraConfig, TaskType

from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.loading import build_peft_config


@pytest.mark.parametrize("task, task_type", [("seq_cls", "CAUSAL_LM"), ("seq_cls", "FEATURE_EXTRACTION"),
                                             ("seq2seq", "CAUSAL_LM"), ("causal_lm", "SEQ_CLS"),
                                             ("prompt_cls", TaskType.SEQ_CLS)])
def test_a_task_type_of_another_task_is_one_line(task, task_type):
    spec = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "task_type": task_type}
    with pytest.raises(ConfigError, match=rf"peft.task_type '\w+' does not fit model.task '{task}': use "):
        build_peft_config(spec, task)


@pytest.mark.parametrize("task, task_type", [("seq_cls", "SEQ_CLS"), ("seq2seq", TaskType.SEQ_2_SEQ_LM),
                                             ("prompt_cls", "CAUSAL_LM"), ("causal_lm", None)])
def test_a_fitting_or_unset_task_type_builds(task, task_type):
    config = build_peft_config(LoraConfig(r=2, target_modules=["q_proj"], task_type=task_type), task)
    assert config.task_type in ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM")


def test_the_head_of_a_classifier_trains_with_the_task_type_it_needs():
    # Before, FEATURE_EXTRACTION built without a word and nothing but LoRA trained: the random score head stayed so.
    with pytest.raises(ConfigError, match="FEATURE_EXTRACTION"):
        PeftModule("tiny:llama", task="seq_cls", num_labels=3,
                   peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"], "task_type": "FEATURE_EXTRACTION"})
    module = PeftModule("tiny:llama", task="seq_cls", num_labels=3,
                        peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]})
    assert any("score" in name for name, p in module.named_parameters() if p.requires_grad)
