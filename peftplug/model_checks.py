"""Checks of a loaded model against the settings that go with it, each a one-line ConfigError naming the setting.

Split from :mod:`peftplug.loading` (which re-exports :func:`check_target_modules`).
"""

from __future__ import annotations

from typing import Any

import torch

from peftplug.errors import ConfigError


def _leaf_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct last name components of modules that hold weights (what ``target_modules`` usually names)."""
    names = set()
    for full_name, module in model.named_modules():
        if full_name and not list(module.children()) and any(True for _ in module.parameters(recurse=False)):
            names.add(full_name.rsplit(".", 1)[-1])
    return sorted(names)


def check_target_modules(model: torch.nn.Module, peft_config: Any) -> None:
    """Raises a ConfigError listing the existing module names if ``target_modules`` match nothing.

    PEFT raises too, but with a long message; this one lists what a user can put in ``target_modules``.

    Args:
        model: The base model.
        peft_config: A PEFT config; configs without ``target_modules`` (prompt learning) are not checked.
    """
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = getattr(peft_config, "target_modules", None)
    if targets is None or (isinstance(targets, str) and targets in ("all-linear", "all-linear-and-conv")):
        return
    if any(check_target_module_exists(peft_config, key) for key, _ in model.named_modules() if key):
        return
    if isinstance(targets, str):
        # PEFT reads one string as a regular expression over each module's full name (re.fullmatch), not as a
        # module name: 'q_proj' matches no 'model.layers.0.self_attn.q_proj'.
        leaves = _leaf_module_names(model)
        full = next((k for k, _ in model.named_modules() if k.endswith(f".{targets}")), None)
        known = f" (full names are like {full!r})" if full else f"; modules with weights are named: {', '.join(leaves)}"
        raise ConfigError(
            f"peft.target_modules {targets!r} is one string, which PEFT reads as a regular expression matching a "
            f"module's full name, and it matches none{known}; to name modules give a list: "
            f"--model.peft.init_args.target_modules '[{targets}]' (YAML: target_modules: [{targets}])"
        )
    raise ConfigError(
        f"peft.target_modules {sorted(targets)!r} match no module of the model; modules with weights are named: "
        + ", ".join(_leaf_module_names(model))
    )


def check_tokenizer_fits(model: torch.nn.Module, tokenizer: Any, field: str = "tokenizer") -> None:
    """Raises a ConfigError if ``tokenizer`` has ids the model has no embedding row for.

    Loading does not notice (transformers loads a model and a tokenizer of different vocabularies side by side);
    training would, at its first batch, with ``IndexError: index out of range in self`` on CPU and a device-side
    assert on CUDA. A tokenizer *smaller* than the embeddings is usual (tables padded to a multiple of 64 or 128).

    Args:
        model: The loaded model (PEFT-wrapped or not).
        tokenizer: The tokenizer that will encode its inputs.
        field: The tokenizer's setting as the user writes it (e.g. ``"model.tokenizer"``).
    """
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without a token embedding table: nothing to check
        return
    # An adapter on the embedding (LoRA, OFTv2, trainable tokens) wraps it: the table is its base layer's.
    base = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
    rows = getattr(base, "num_embeddings", None)
    size = len(tokenizer)
    if isinstance(rows, int) and size > rows:
        raise ConfigError(
            f"{field}: the tokenizer has {size} tokens but the model "
            f"{getattr(model, 'name_or_path', '')!r} has embeddings for {rows} (ids {rows}..{size - 1} would fail at "
            "the first batch); use the model's own tokenizer"
        )


# Names of learned absolute position tables in transformers' models.
POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def position_table(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(name, positions)`` of the model's learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``,
    BERT-style ``position_embeddings``), or ``None`` for models without one (rotary or relative positions: no table
    to run off). A longer input stops in the embedding with ``IndexError: index out of range in self``.

    Args:
        model: The (possibly PEFT-wrapped) model.
    """
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES:
            return name, module.num_embeddings - getattr(module, "offset", 0)  # (OPT's table starts 2 positions in)
    return None


def virtual_tokens(model: torch.nn.Module) -> int:
    """How many virtual tokens the active prompt-learning adapter (prompt tuning, PCT, prefix ...) puts before each
    input; 0 for other adapters and bare models.

    Args:
        model: The (possibly PEFT-wrapped) model.
    """
    config = getattr(model, "active_peft_config", None)
    return (getattr(config, "num_virtual_tokens", 0) or 0) if getattr(config, "is_prompt_learning", False) else 0


def _is_encoder_decoder(model: torch.nn.Module) -> bool:
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(getattr(lm, "config", None), "is_encoder_decoder", False))


def decoder_position_table(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(name, positions)`` of an encoder-decoder model's decoder position table (BART's, mBART's, Marian's
    ``model.decoder.embed_positions``), or ``None`` (decoder-only models; T5, whose positions are relative).

    :func:`position_table` finds the encoder's table first; the decoder's bounds the targets and the generated tokens,
    whose length owes nothing to the encoder input's.

    Args:
        model: The (possibly PEFT-wrapped) model.
    """
    if not _is_encoder_decoder(model):
        return None
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, torch.nn.Embedding) and parts[-1] in POSITION_TABLES and "decoder" in parts:
            return name, module.num_embeddings - getattr(module, "offset", 0)
    return None


def decoder_virtual_tokens(model: torch.nn.Module) -> int:
    """How many positions of an encoder-decoder model's decoder the active prompt-learning adapter takes: a prefix
    (prefix tuning) is the decoder's cache before its first token; prompt tuning, p-tuning and PCT put their virtual
    tokens on the encoder only (0 for them, for other adapters, bare models and decoder-only models).

    Args:
        model: The (possibly PEFT-wrapped) model.
    """
    if not _is_encoder_decoder(model):
        return 0
    config = getattr(model, "active_peft_config", None)
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    return virtual_tokens(model) if kind in ("PREFIX_TUNING", "CARTRIDGE") else 0


class PositionError(ConfigError):
    """A prompt that, with the tokens to generate, does not fit the model's position table."""


def check_generation_positions(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int,
                               setting: str) -> None:
    """Refuses a generation that would run past a learned position table, where it stopped with ``IndexError: index
    out of range in self`` deep in the embedding (GPT-2's 1024 positions, BART's 1024 in its decoder).

    A decoder-only model reads the adapter's virtual tokens, the prompt and the new tokens on one table; an
    encoder-decoder model reads the prompt (after the virtual tokens) on its encoder's, and its start token and all
    but the last new token (after a prefix-tuning prefix) on its decoder's.

    Args:
        model: The (possibly PEFT-wrapped) model.
        prompt_tokens: Tokens of the longest prompt.
        max_new_tokens: Tokens to generate at most.
        setting: The setting of ``max_new_tokens`` as the user writes it (``--max_new_tokens``,
            ``model.max_new_tokens``).

    Raises:
        PositionError: Naming the lengths, the limit and what to lower.
    """
    table, virtual = position_table(model), virtual_tokens(model)
    extra = f" after the adapter's {virtual} virtual tokens" if virtual else ""
    decoder = decoder_position_table(model)
    if decoder is None:
        if table is not None and virtual + prompt_tokens + max_new_tokens > table[1]:
            raise PositionError(f"the prompt is {prompt_tokens} tokens{extra} and {setting} {max_new_tokens}, but the "
                                f"model has {table[1]} positions: shorten the prompt or lower {setting}")
        return
    prefix = decoder_virtual_tokens(model)  # a prefix is the decoder's, not the encoder's
    encoder_extra = f" after the adapter's {virtual} virtual tokens" if virtual and not prefix else ""
    if table is not None and virtual - prefix + prompt_tokens > table[1]:
        raise PositionError(f"the prompt is {prompt_tokens} tokens{encoder_extra}, but the model's encoder has "
                            f"{table[1]} positions: shorten the prompt")
    name, limit = decoder
    if prefix + max_new_tokens > limit:
        after = f" after the adapter's {prefix}-token prefix" if prefix else ""
        raise PositionError(f"{setting} is {max_new_tokens}{after}, but the model's decoder has {limit} positions "
                            f"({name}): lower {setting} to {limit - prefix} or less")
