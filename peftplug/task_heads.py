"""The task head of a sequence-classification model, found from the model itself rather than from a list of names.

A ``*ForSequenceClassification`` model is its pretrained body (the child named by ``base_model_prefix``) plus a
head that the loader creates fresh for the task. Two things must know that head: quantization, which has to leave
it in full precision (it is trained), and PEFT, which trains and saves only the heads it knows by name
(``classifier`` and ``score``, :data:`PEFT_CLASSIFIER_NAMES`). Heads named otherwise (``classification_head`` of
T5, BART, MBART, ...) were quantized silently and stayed frozen at their random initialisation, unsaved with the
adapter.

The causal-LM class of an encoder (``BertLMHeadModel``, ``RobertaForCausalLM``, ELECTRA, ...) is also shaped by its
config: unless ``is_decoder`` is true it attends in both directions, so as a causal LM every position sees the tokens
it is trained to predict (transformers only logs "add ``is_decoder=True``"). :func:`needs_is_decoder` says when.
"""

from __future__ import annotations

from typing import Any

import torch

#: The head names PeftModelForSequenceClassification adds to ``modules_to_save`` itself (PEFT 0.21).
PEFT_CLASSIFIER_NAMES = ("classifier", "score")


def head_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the top-level children of ``model`` that hold parameters and are not its pretrained body.

    Args:
        model: A transformers model (a ``*ForSequenceClassification`` for a meaningful answer).
    """
    body = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children()
            if name != body and next(child.parameters(), None) is not None]


def _config(path: str, config_kwargs: dict) -> Any:
    """The config ``from_pretrained(path, **config_kwargs)`` would use, or ``None`` where it cannot be read."""
    import transformers

    keys = ("num_labels", "pad_token_id", "revision", "cache_dir", "token", "subfolder")
    try:
        return transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=False, **{k: v for k, v in config_kwargs.items() if k in keys})
    except Exception:  # noqa: BLE001 - any reason it cannot be read is reported by from_pretrained itself
        return None


def needs_is_decoder(path: str, config_kwargs: dict) -> bool:
    """Whether a causal LM loaded from ``path`` must be given ``is_decoder=True`` to attend causally.

    True for configs that carry ``is_decoder`` switched off outside an encoder-decoder (BERT and its relatives); a
    decoder-only config either lacks the field or ignores it, so passing it there changes nothing.

    Args:
        path: A local folder or Hub id, as passed to ``from_pretrained``.
        config_kwargs: The ``from_pretrained`` keyword arguments (an explicit ``is_decoder`` there wins).
    """
    if "is_decoder" in config_kwargs:
        return False
    config = _config(path, config_kwargs)
    return getattr(config, "is_decoder", None) is False and not getattr(config, "is_encoder_decoder", False)


def seq_cls_head_names(path: str, config_kwargs: dict) -> list[str]:
    """The head names of the sequence-classification model that ``from_pretrained(path)`` would build.

    The model is built from its config on the meta device (no memory, no weights read). Where the config cannot be
    read or names no sequence-classification class, the answer is ``[]``: ``from_pretrained`` then raises the error
    worth showing.

    Args:
        path: A local folder or Hub id, as passed to ``from_pretrained``.
        config_kwargs: The ``from_pretrained`` keyword arguments that shape the config (``num_labels``, ...).
    """
    import transformers

    config = _config(path, config_kwargs)
    if config is None:
        return []
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForSequenceClassification.from_config(config)
    except Exception:  # noqa: BLE001 - any reason it cannot be built is reported by from_pretrained itself
        return []
    return head_module_names(model)


def add_heads_to_save(model: torch.nn.Module, peft_config: Any) -> list[str]:
    """Adds the heads of a sequence-classification ``model`` that PEFT would not train to ``modules_to_save``.

    PEFT matches ``modules_to_save`` by name suffix, so a head is already covered when its name ends with one of
    :data:`PEFT_CLASSIFIER_NAMES` or with a name the config lists. Configs without ``modules_to_save`` are left alone.

    Args:
        model: The base model, before ``get_peft_model``.
        peft_config: Its PEFT config (changed in place, so that the saved ``adapter_config.json`` names the head too
            and PEFT restores it when the adapter is loaded).

    Returns:
        The names added.
    """
    if not hasattr(peft_config, "modules_to_save"):
        return []
    covered = [*PEFT_CLASSIFIER_NAMES, *(peft_config.modules_to_save or [])]
    missing = [name for name in head_module_names(model) if not any(name.endswith(c) for c in covered)]
    if missing:
        peft_config.modules_to_save = [*(peft_config.modules_to_save or []), *missing]
    return missing
