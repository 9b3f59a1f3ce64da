"""PCT prompt transfer: source prompts -> SVD + contrastive decomposition -> attention-fused target prompt.

Importing this package registers ``PeftType.PCT`` with PEFT, so ``peft.get_peft_model(model, PCTConfig(...))``
and ``PeftModel.from_pretrained`` of a saved PCT adapter work. Stages:

1. :func:`train_source_prompts` (PEFT prompt tuning per source task, saved as ordinary PEFT adapters),
   :func:`load_source_prompt`;
2. :func:`decompose`, :func:`save_decomposition`, :func:`load_decomposition`;
3. :class:`PCTConfig` + :func:`train_prompt` (adds :func:`auxiliary_loss`, logs :func:`attention_weights`);
4. :func:`export_prompt_tuning` (a plain PEFT ``PROMPT_TUNING`` adapter + the full PCT state beside it);
5. baselines: :func:`spot_select`, :func:`prompt_tuning_config`.
"""

import peftplug.registry  # noqa: F401  (first: refuses an unsupported PEFT in one line)
from prompt_transfer.config import PCTConfig
from prompt_transfer.decompose import (
    Decomposition,
    decompose,
    info_nce,
    load_decomposition,
    save_decomposition,
)
from prompt_transfer.model import PCTFusion, PCTPromptEncoder


def _register():
    from peftplug.registry import register_prompt_learning_method

    return register_prompt_learning_method("pct", PCTConfig, PCTPromptEncoder, prefix="pct_")


PEFT_TYPE = _register()

from prompt_transfer.export import export_adapter_dir, export_prompt_tuning, load_pct_for_training
from prompt_transfer.source import (
    load_source_prompt,
    prompt_tuning_config,
    set_prompt,
    source_base_model,
    spot_select,
    train_source_prompts,
)
from prompt_transfer.training import attention_weights, auxiliary_loss, pct_metrics, train_prompt

__all__ = [
    "PEFT_TYPE",
    "Decomposition",
    "PCTConfig",
    "PCTFusion",
    "PCTPromptEncoder",
    "attention_weights",
    "auxiliary_loss",
    "decompose",
    "export_adapter_dir",
    "export_prompt_tuning",
    "info_nce",
    "load_decomposition",
    "load_pct_for_training",
    "load_source_prompt",
    "pct_metrics",
    "prompt_tuning_config",
    "save_decomposition",
    "set_prompt",
    "source_base_model",
    "spot_select",
    "train_prompt",
    "train_source_prompts",
]
