"""PEFT adapter types a ``PeftModule`` cannot train as configured, refused when the model is built (one line).

Prefix tuning: PEFT (0.21) hands the prefix to a model as ``past_key_values`` and, outside its causal-LM and seq2seq paths, first
looks for a parameter of that name on the model's or its backbone's ``forward``; transformers 5 renamed it
(``cache``) on many models, so a sequence-classification, token-classification or question-answering run stopped at
its first forward with PEFT's "Model does not support past key values which are required for prefix tuning".

Multitask prompt tuning: its forward needs a ``task_ids`` tensor per batch, which no peftplug data module carries,
so a run stopped at its first step with PEFT's "task_ids cannot be None".
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from peftplug.errors import ConfigError

# Task types whose PEFT model passes the prefix without looking at the signature.
_PASSES_ANYWAY = {None, "CAUSAL_LM", "SEQ_2_SEQ_LM"}


def _takes_past_key_values(module: torch.nn.Module) -> bool:
    return "past_key_values" in inspect.signature(module.forward).parameters


def check_prefix_tuning_support(model: torch.nn.Module, peft_config: Any) -> None:
    """Refuses prefix tuning for a task whose model cannot take the prefix, in one line naming alternatives.

    Args:
        model: The base model (before ``get_peft_model``).
        peft_config: The PEFT config about to be attached.

    Raises:
        ConfigError: For ``PREFIX_TUNING`` on such a model.
    """
    peft_type = getattr(peft_config.peft_type, "value", peft_config.peft_type)
    task = getattr(peft_config.task_type, "value", peft_config.task_type)
    if peft_type != "PREFIX_TUNING" or task in _PASSES_ANYWAY or _takes_past_key_values(model):
        return
    # PEFT's fallback: the first transformers model among the children (the backbone).
    from transformers import PreTrainedModel

    backbone = next((m for m in model.children() if isinstance(m, PreTrainedModel)), None)
    if backbone is not None and _takes_past_key_values(backbone):
        return
    import peft
    import transformers

    raise ConfigError(
        f"peft PREFIX_TUNING with task_type {task}: PEFT {peft.__version__} passes the prefix as past_key_values, "
        f"which {type(model).__name__} takes no more (transformers {transformers.__version__}); use PROMPT_TUNING, "
        "P_TUNING or a weight adapter (LORA, OFTV2) for this task"
    )


def check_peft_type_support(model: torch.nn.Module, peft_config: Any) -> None:
    """Refuses, in one line, a PEFT config that a ``PeftModule`` run would stop on at its first forward.

    Args:
        model: The base model (before ``get_peft_model``).
        peft_config: The PEFT config about to be attached.

    Raises:
        ConfigError: For multitask prompt tuning, and prefix tuning a model cannot take
            (:func:`check_prefix_tuning_support`).
    """
    if getattr(peft_config.peft_type, "value", peft_config.peft_type) == "MULTITASK_PROMPT_TUNING":
        raise ConfigError("peft MULTITASK_PROMPT_TUNING needs task_ids in every batch, which peftplug's data modules "
                          "do not carry; use PROMPT_TUNING (or train it with your own loop)")
    check_prefix_tuning_support(model, peft_config)
