"""Generation that is right for every adapter kind, prompt-learning ones included.

PEFT's own ``generate`` for prompt-learning adapters goes wrong with the transformers this project pins, so every
place that generates (``peftplug generate``/``chat``, chat validation accuracy, ``predict``) goes through
:func:`generate_new_tokens`, or for an encoder-decoder model (``predict``) :func:`generate_encoder_decoder`.
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
    and in :func:`peftplug.prompt_scoring.label_word_logits`. Multitask prompt tuning takes its ``task_ids`` among
    ``kwargs`` (one per row). Other adapters, and none, keep ``model.generate``.

    Args:
        model: A decoder-only causal LM, optionally PEFT-wrapped.
        input_ids: Left-padded prompt ids ``[batch, length]``.
        attention_mask: Their attention mask.
        **kwargs: Further ``generate`` arguments (``max_new_tokens``, ``do_sample``, ``eos_token_id``, ...).

    Raises:
        ValueError: For an encoder-decoder model (its ``generate`` returns decoder tokens, not the prompt followed
            by new ones, and its virtual tokens belong to the encoder): call its ``generate`` instead.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(lm, "config", None), "is_encoder_decoder", False):
        # Slicing the prompt's length off its decoder output returned a truncated or empty answer, silently.
        raise ValueError(f"generate_new_tokens needs a decoder-only causal LM; {type(lm).__name__} is an "
                         "encoder-decoder model: call its generate, which returns the decoder's tokens")
    kind = ""
    if _is_prompt_learning(model):
        config = model.peft_config[model.active_adapter]
        kind = str(getattr(config.peft_type, "value", config.peft_type))
    if not kind:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              **kwargs)[:, input_ids.shape[1]:]
    rows = input_ids.shape[0]
    if kind in ("PREFIX_TUNING", "CARTRIDGE"):  # both hand PEFT's forward their prefix as the cache's start
        # The prefix is the cache's first entries; generate reads the prompt after the cached length, so stand-in
        # ids fill those places (never embedded) and the mask counts them, which puts the text after the prefix.
        virtual = config.num_virtual_tokens
        ids = torch.cat([input_ids.new_full((rows, virtual), int(input_ids[0, -1])), input_ids], 1)
        mask = torch.cat([attention_mask.new_ones(rows, virtual), attention_mask], 1)
        # Without the cache (use_cache=False, as some checkpoints' configs set) generate would re-read the
        # stand-in ids as text at every later step: the answers were wrong, silently. Cached decoding gives the
        # tokens of PEFT's cache-free forward, so it is always on here.
        out = model.base_model.generate(input_ids=ids, attention_mask=mask, **_prefix_cache(model, rows, kwargs))
        return out[:, ids.shape[1]:]
    embeds = model.word_embeddings(input_ids)
    task_ids = kwargs.pop("task_ids", None) if kind == "MULTITASK_PROMPT_TUNING" else None
    # PEFT's own generate re-inserted multitask prompt tuning's and CPT's virtual tokens too; at inference CPT's
    # forward is prompt tuning's (its token types only shape the training labels).
    prompts = model.get_prompt(batch_size=rows, task_ids=task_ids).to(embeds.dtype)
    mask = torch.cat([attention_mask.new_ones(rows, prompts.shape[1]), attention_mask], 1)
    # With only embeddings as input, a decoder-only model's generate returns the new tokens alone.
    return model.base_model.generate(inputs_embeds=torch.cat([prompts, embeds], 1), attention_mask=mask, **kwargs)


def _prefix_cache(model: Any, rows: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the prefix of the active prefix-tuning adapter as the cache ``generate`` starts from, for
    ``rows`` prompts, and the cache on."""
    # generate repeats the rows for beams / several sequences but not a cache it is given: one prefix per copy.
    settings = kwargs.get("generation_config") or model.base_model.generation_config
    copies = max(kwargs.get("num_beams") or getattr(settings, "num_beams", 1) or 1,
                 kwargs.get("num_return_sequences") or getattr(settings, "num_return_sequences", 1) or 1)
    return {**kwargs, "use_cache": True, "cache": model.get_prompt(batch_size=rows * copies)}


def generate_encoder_decoder(model: Any, input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """``generate`` of an encoder-decoder model (T5, BART), optionally PEFT-wrapped: the decoder's tokens
    (``[batch, 1 + new]``, starting with the decoder's start token), right for prefix tuning too.

    PEFT's own ``generate`` hands a prefix-tuning prefix to the model as ``past_key_values`` beside the cache that
    the transformers this project pins passes as ``cache``, which wins: the prefix was dropped, and a prefix-tuned
    T5 answered as its base model did, silently (its training forward did use the prefix). Here the prefix is the
    decoder's cache from the start (its self-attention keys and values, and those before the encoder's in the
    cross-attention), as in PEFT's forward. Prompt tuning, p-tuning and PCT go through PEFT's ``generate``, which
    puts their virtual tokens before the encoder input once, as its forward does; other adapters, and none, call
    ``model.generate``.

    Args:
        model: An encoder-decoder model, optionally PEFT-wrapped.
        input_ids: Encoder input ids ``[batch, length]`` (right padding is right: positions are counted from the
            first token of each row).
        attention_mask: Their attention mask.
        **kwargs: Further ``generate`` arguments (``max_new_tokens``, ``do_sample``, ...).
    """
    if _is_prompt_learning(model):
        config = model.peft_config[model.active_adapter]
        if str(getattr(config.peft_type, "value", config.peft_type)) in ("PREFIX_TUNING", "CARTRIDGE"):
            return model.base_model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                             **_prefix_cache(model, input_ids.shape[0], kwargs))
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
