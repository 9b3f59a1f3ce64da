"""PROPOSED for ``peftplug/registry.py`` (the lead's file): prompt-learning plugin types that behave like
``PROMPT_TUNING``.

Why this exists. Registering the ``PCT`` enum member and mapping entries (``register_method``) is not enough for a
prompt-learning method in PEFT 0.21: ``PeftModel._setup_prompt_encoder`` builds encoders from a closed
``if peft_type in (PROMPT_TUNING, ...) / elif ... / else: raise ValueError("Not supported")`` chain, and the
forward/generate paths of ``PeftModelForSeq2SeqLM`` (and the decoder attention mask there) branch on
``peft_type in [PROMPT_TUNING, P_TUNING]`` too. A PCT target prompt is, at run time, exactly a static prompt
tuning embedding, so the minimal change is to let PEFT treat a registered "prompt-tuning-like" type as
``PROMPT_TUNING`` for dispatch while keeping its own type for saving/loading:

1. ``_setup_prompt_encoder``: run PEFT's own setup with a ``PromptTuningConfig`` stand-in (freezes the base,
   finds the word embeddings, fills ``num_transformer_submodules`` and ``prompt_tokens``), then replace the
   encoder by ``encoder_cls(config, word_embeddings)``.
2. ``active_peft_config`` (read by every forward/generate/get_prompt path, never by save/load): return a
   ``PromptTuningConfig`` view of the plugin config (same shape fields and ``inference_mode``).

Saving, loading and ``adapter_config.json`` keep ``peft_type: "PCT"`` because they read ``peft_config[name]``
directly and dispatch through ``PEFT_TYPE_TO_TUNER_MAPPING`` to the encoder's state-dict hooks.

``prompt_transfer`` uses ``peftplug.registry.register_prompt_learning_method`` when the registry provides it and
falls back to this module otherwise; move this code into the registry verbatim and delete this file.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_PROMPT_TUNING_LIKE: set[str] = set()


def _type_value(peft_type) -> str:
    return str(getattr(peft_type, "value", peft_type))


def _prompt_tuning_view(config):
    """A ``PromptTuningConfig`` with the plugin config's shape fields (what PEFT's dispatch reads)."""
    from peft import PromptTuningConfig

    return PromptTuningConfig(
        task_type=config.task_type, num_virtual_tokens=config.num_virtual_tokens, token_dim=config.token_dim,
        num_transformer_submodules=config.num_transformer_submodules,
        num_attention_heads=config.num_attention_heads, num_layers=config.num_layers,
        inference_mode=config.inference_mode, base_model_name_or_path=config.base_model_name_or_path,
    )


def _install_prompt_tuning_dispatch() -> None:
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.peft_model import PeftModel

    from peftplug.registry import _internals_error

    if getattr(PeftModel, "_peftplug_prompt_dispatch", False):
        return
    original_setup = getattr(PeftModel, "_setup_prompt_encoder", None)
    original_active = PeftModel.__dict__.get("active_peft_config")
    if original_setup is None or not isinstance(original_active, property):
        raise _internals_error("PeftModel._setup_prompt_encoder / active_peft_config not found")

    def _setup_prompt_encoder(self, adapter_name: str):
        config = self.peft_config[adapter_name]
        if _type_value(config.peft_type) not in _PROMPT_TUNING_LIKE:
            return original_setup(self, adapter_name)
        stand_in = _prompt_tuning_view(config)
        self.peft_config[adapter_name] = stand_in
        try:
            original_setup(self, adapter_name)
        finally:
            self.peft_config[adapter_name] = config
        config.num_transformer_submodules = stand_in.num_transformer_submodules
        encoder = PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type](config, self.word_embeddings)
        self.prompt_encoder[adapter_name] = encoder.to(self.device)

    def active_peft_config(self):
        config = original_active.fget(self)
        if _type_value(config.peft_type) in _PROMPT_TUNING_LIKE:
            return _prompt_tuning_view(config)
        return config

    PeftModel._setup_prompt_encoder = _setup_prompt_encoder
    PeftModel.active_peft_config = property(active_peft_config)
    PeftModel._peftplug_prompt_dispatch = True


def register_prompt_learning_method(name: str, config_cls: type, encoder_cls: type, prefix: str | None = None):
    """Registers a prompt-learning method whose encoder PEFT should drive like ``PROMPT_TUNING``'s.

    Args:
        name: Lower-case method name (``"pct"``).
        config_cls: Its ``PromptLearningConfig`` subclass.
        encoder_cls: Its ``BasePromptEncoder`` subclass, built as ``encoder_cls(config, word_embeddings)``; it must
            expose ``embedding.weight`` (the prompt, ``[num_virtual_tokens * num_transformer_submodules, d]``).
        prefix: Parameter prefix (defaults to ``name + "_"``).

    Returns:
        The ``PeftType`` member.
    """
    from peftplug.registry import register_method

    member = register_method(name, config_cls, encoder_cls, prefix=prefix)
    with _LOCK:
        _install_prompt_tuning_dispatch()
        _PROMPT_TUNING_LIKE.add(member.value)
    return member
