"""Decoder-only classifiers under a prompt-learning adapter score each row at its last attended token.

PEFT's prompt tuning, P-tuning and PCT hand the base model ``inputs_embeds`` (the soft prompt first), so
transformers' ``...ForSequenceClassification`` cannot find the pad tokens (``"will not detect padding tokens in
inputs_embeds"``) and pools every row at the last position: padding, for each right-padded row (TRL's
``RewardTrainer``, transformers' ``Trainer`` with a right-padding collator, peftplug's own data modules), and the
model trains on those scores, silently. :func:`pool_at_last_attended_token` installs one forward hook on the
backbone that fixes this for every caller; it is the only implementation (peftplug's Lightning module and the
registry's prompt-encoder setup both install it).
"""

from __future__ import annotations

from typing import Any

import torch


class PoolAtLastAttended:
    """Forward hook (with kwargs) on a decoder-only classifier's backbone: puts each row's hidden state at its last
    attended token in the last position, where transformers pools.

    The attention mask the backbone receives includes the prompt's positions, so its last attended position is the
    row's. Causal attention leaves the real positions untouched by later padding: each row gets the score it gets
    alone. A forward given ``input_ids`` (prefix tuning, or the adapter disabled) is left to transformers, which finds
    the pad tokens itself. A class, not a closure, so that the model still pickles and deep-copies (TRL's reference
    model is a deep copy).
    """

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        mask = kwargs.get("attention_mask")
        if kwargs.get("input_ids") is not None or kwargs.get("inputs_embeds") is None:
            return None
        if not torch.is_tensor(mask) or mask.dim() != 2:
            return None
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None or hidden.dim() != 3 or hidden.shape[1] != mask.shape[1]:
            return None
        last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1).to(hidden.device)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        output.last_hidden_state = torch.cat([hidden[:, :-1], hidden[rows, last].unsqueeze(1)], dim=1)
        return output


def _is_prompt_learning_seq_cls(config: Any) -> bool:
    task = getattr(config, "task_type", None)
    return bool(getattr(config, "is_prompt_learning", False)) and getattr(task, "value", task) == "SEQ_CLS"


def pool_at_last_attended_token(peft_model: torch.nn.Module) -> bool:
    """Installs :class:`PoolAtLastAttended` on the backbone of a decoder-only ``SEQ_CLS`` ``PeftModel`` that has a
    prompt-learning adapter (once per model; anything else is left as it is).

    Args:
        peft_model: The model: a ``PeftModel``, or any module (then nothing is done).

    Returns:
        Whether the hook is on the backbone now.
    """
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not any(_is_prompt_learning_seq_cls(c) for c in configs.values()):
        return False
    base = peft_model.get_base_model()
    # Decoder-only heads are named ``score``; encoders pool [CLS] (a virtual token, by design) and encoder-decoders
    # pool the decoder's end-of-sequence token, which they find from the ids.
    if getattr(base, "score", None) is None or getattr(base.config, "is_encoder_decoder", False):
        return False
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if not isinstance(backbone, torch.nn.Module):
        return False
    if not any(isinstance(hook, PoolAtLastAttended) for hook in backbone._forward_hooks.values()):
        backbone.register_forward_hook(PoolAtLastAttended(), with_kwargs=True)
    return True


__all__ = ["PoolAtLastAttended", "pool_at_last_attended_token"]
