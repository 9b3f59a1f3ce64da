"""Tiny randomly initialised Hugging Face models and an offline tokenizer, for tests and benchmarks.

Nothing here downloads anything: models are built from configs, the tokenizer from a character vocabulary.
"""

from __future__ import annotations

import string

import torch

FAMILIES = ("llama", "qwen2", "gpt2", "bert", "t5")

# Sizes small enough for CPU tests, with widths divisible by the usual OFT block sizes (4, 8, 16, 32).
_BASE = {
    "llama": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256,
    },
    "qwen2": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256,
    },
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "bert": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 256},
    "t5": {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4},
}


# ChatML, as SmolLM2 and Qwen use it, with the tokenizer's EOS token ending each turn (a real chat tokenizer's EOS
# is its end-of-turn token, e.g. <|im_end|>); gives the chat-data paths a template to test against offline.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def char_tokenizer(model_max_length: int = 256):
    """A fast character-level tokenizer with pad/bos/eos/unk tokens and a ChatML-style chat template, built offline.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with vocabulary size :data:`CHAR_VOCAB_SIZE`; padding side left
        is *not* set (callers choose), pad id 0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


CHAR_VOCAB_SIZE = 4 + len([c for c in string.printable if c not in "\x0b\x0c\r"])


def tiny_config(family: str, task: str = "causal_lm", vocab_size: int = CHAR_VOCAB_SIZE, **overrides):
    """Config of a tiny model of ``family``.

    Args:
        family: One of :data:`FAMILIES`.
        task: ``"causal_lm"``, ``"seq_cls"`` or ``"seq2seq"`` (only affects ``num_labels`` defaults).
        vocab_size: Vocabulary size (defaults to the char tokenizer's).
        **overrides: Config fields to override (e.g. ``hidden_size``, ``num_labels``).
    """
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    kwargs = dict(_BASE[family], vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "t5":
        kwargs["decoder_start_token_id"] = 0
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str = "llama", task: str = "causal_lm", seed: int = 0, **overrides):
    """A tiny randomly initialised model, in eval mode, fp32.

    Args:
        family: One of :data:`FAMILIES`.
        task: ``"causal_lm"``, ``"seq_cls"`` or ``"seq2seq"``.
        seed: Seed for the weight init (uses a forked RNG, so the global RNG state is untouched).
        **overrides: Config overrides, see :func:`tiny_config`.
    """
    import transformers

    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "seq_cls": transformers.AutoModelForSequenceClassification,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }
    if task not in auto:
        raise ValueError(f"task must be one of {sorted(auto)}, got {task!r}")
    config = tiny_config(family, task, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto[task].from_config(config)
    return model.eval()
