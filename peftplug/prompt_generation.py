"""Generation that is right for every adapter kind, prompt-learning ones included.

PEFT's own ``generate`` for prompt-learning adapters goes wrong with the transformers this project pins, so every
place that generates (``peftplug generate``/``chat``, chat validation accuracy, ``predict``) goes through
:func:`generate_new_tokens`.
"""

from __future__ import annotations

from typing import Any

import torch

from peftplug.prompt_scoring import _is_prompt_learning


def generate_new_tokens(model: Any, input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """``model.generate`` on left-padded prompts, returning the new tokens only (``[batch, new]``).

    Prompt-learning adapters are generated through the base model here, because PEFT's own ``generate`` for them
    goes wrong with the transformers this project pins (whose ``generate`` passes the KV cache as ``cache``, where
    PEFT looks for ``past_key_values``): under prompt tuning, p-tuning and PCT PEFT prepends the virtual tokens
    again at every decoding step, and under prefix tuning its prefix is dropped, so the answers were neither the
    trained model's nor independent of the batch. Here the virtual tokens (or the prefix's keys and values) come
    first and every row's mask covers them, so each row sees the positions of its unpadded self, as in training
    and in :func:`peftplug.prompt_scoring.label_word_logits`. Multitask prompt tuning and CPT keep PEFT's path.

    Args:
        model: A causal LM, optionally PEFT-wrapped.
        input_ids: Left-padded prompt ids ``[batch, length]``.
        attention_mask: Their attention mask.
        **kwargs: Further ``generate`` arguments (``max_new_tokens``, ``do_sample``, ``eos_token_id``, ...).
    """
    kind = ""
    if _is_prompt_learning(model):
        config = model.peft_config[model.active_adapter]
        kind = str(getattr(config.peft_type, "value", config.peft_type))
    if not kind or kind in ("MULTITASK_PROMPT_TUNING", "CPT"):
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              **kwargs)[:, input_ids.shape[1]:]
    rows = input_ids.shape[0]
    if kind == "PREFIX_TUNING":
        # The prefix is the cache's first entries; generate reads the prompt after the cached length, so stand-in
        # ids fill those places (never embedded) and the mask counts them, which puts the text after the prefix.
        virtual = config.num_virtual_tokens
        ids = torch.cat([input_ids.new_full((rows, virtual), int(input_ids[0, -1])), input_ids], 1)
        mask = torch.cat([attention_mask.new_ones(rows, virtual), attention_mask], 1)
        out = model.base_model.generate(input_ids=ids, attention_mask=mask, cache=model.get_prompt(batch_size=rows),
                                        **kwargs)
        return out[:, ids.shape[1]:]
    embeds = model.word_embeddings(input_ids)
    prompts = model.get_prompt(batch_size=rows).to(embeds.dtype)
    mask = torch.cat([attention_mask.new_ones(rows, prompts.shape[1]), attention_mask], 1)
    # With only embeddings as input, a decoder-only model's generate returns the new tokens alone.
    return model.base_model.generate(inputs_embeds=torch.cat([prompts, embeds], 1), attention_mask=mask, **kwargs)
