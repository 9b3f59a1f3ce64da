"""The pad token every peftplug batch is padded with: the tokenizer's own, else a stand-in, else one clear error.

Many Hugging Face tokenizers (Llama, GPT-2, Mistral, ...) have no pad token. Every padded position is masked
(attention mask 0, labels -100), so any token of the vocabulary pads correctly; peftplug follows TRL's
``SFTTrainer`` (``pad_token or eos_token``) and takes the EOS token, else the UNK token. It never adds a new pad
token: that would be a new, untrained row of the embeddings, which the model must be resized for and which an
adapter does not save. A tokenizer with none of the three (a character or custom tokenizer built without special
tokens) cannot pad a batch: it is refused when it is loaded, as TRL and transformers' ``tokenizer.pad`` refuse it,
instead of a ``TypeError`` at the first batch whose rows differ in length (or an ``IndexError`` inside
``generate``).
"""

from __future__ import annotations

from typing import Any

from peftplug.errors import ConfigError

#: The tokens that stand in for a missing pad token, in the order they are tried.
STAND_INS = ("eos_token", "unk_token")


def ensure_pad_token(tokenizer: Any, name: str) -> Any:
    """Gives ``tokenizer`` a pad token of its vocabulary if it has none: its EOS token, else its UNK token.

    Args:
        tokenizer: A Hugging Face tokenizer; its ``pad_token`` is set in place when it has none.
        name: The model name or path it was loaded from, or for an object given in Python the setting that
            holds it (``data.tokenizer``, ``model.tokenizer``), for the message.

    Returns:
        ``tokenizer``, whose ``pad_token_id`` is an id of its vocabulary.

    Raises:
        ConfigError: If its pad token is not in its vocabulary, or it has no pad, EOS or UNK token; the message
            says how to give it one.
    """
    how = ("give it one that is in its vocabulary: \"pad_token\": \"<token>\" in its tokenizer_config.json (in "
           "Python: tokenizer.pad_token = \"<token>\"), or point model.tokenizer / data.tokenizer at a tokenizer "
           "that has one")
    if tokenizer.pad_token is not None:
        if tokenizer.pad_token_id is None:  # named in the settings but not a token: nothing to pad with
            raise ConfigError(f"the tokenizer of {name!r} has pad token {str(tokenizer.pad_token)!r}, which is not "
                              f"in its vocabulary; {how}")
        return tokenizer
    for stand_in in STAND_INS:
        token = getattr(tokenizer, stand_in, None)
        # An EOS named in the settings but missing from the vocabulary has no id: it could not pad either.
        if token is not None and tokenizer.convert_tokens_to_ids(token) is not None:
            tokenizer.pad_token = token
            return tokenizer
    raise ConfigError(f"the tokenizer of {name!r} has no pad token, and no eos or unk token in its vocabulary to "
                      f"pad with: batches of rows of different lengths cannot be padded; {how}")
