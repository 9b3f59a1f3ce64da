"""Prompt templates for classification with a causal LM (MeZO's "train as classification", LM-BFF's templates).

A task is posed as text the pretrained LM can already half-complete: a template with the example's fields and an
answer slot ``{answer}`` at its end, and one *label word* per class (``It was {answer}`` with ``terrible`` /
``great``). The model reads the prompt up to the slot; its logits at the last prompt position, restricted to the
label words, are the class scores (:mod:`peftplug.prompt_scoring`). This module checks templates, tokenizes label
words and renders prompts. Two renderings (``format``):

- ``"plain"`` (default): the template as plain text, no chat markup — LM-BFF's and MeZO's protocol. A space before
  ``{answer}`` moves into the label word (``" great"``), because byte-level BPE tokens carry their leading space.
- ``"chat"``: the template text before the slot is the *user* turn of the tokenizer's chat template and the answer
  is the first token of the assistant's reply (label words without a leading space). Each built-in task has its
  own chat template (a question rather than a cloze, which is what an instruction-tuned model answers).
"""

from __future__ import annotations

import string
from typing import Any

from peftplug.errors import ConfigError, DataError

ANSWER = "answer"
FORMATS = ("plain", "chat")
MULTI_TOKEN_POLICIES = ("error", "first")


def template_fields(text: str) -> list[str]:
    """The slot names of a template, in order (``{answer}`` included).

    Args:
        text: The template.

    Raises:
        ConfigError: If the template is not valid ``str.format`` syntax, lacks the ``{answer}`` slot, has it more
            than once or not at its end.
    """
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise ConfigError(f"data.template {text!r} is not a valid template ({err}); write slots as {{field}}") from None
    if ANSWER not in names:
        raise ConfigError(f"data.template {text!r} has no answer slot {{{ANSWER}}}: add it where the label word goes")
    if names.count(ANSWER) > 1 or not text.endswith("{" + ANSWER + "}"):
        raise ConfigError(f"data.template {text!r}: the answer slot {{{ANSWER}}} must appear once, at the end "
                          "(a causal LM predicts the label word from the text before it)")
    return names


def split_template(text: str) -> tuple[str, bool]:
    """The template before the answer slot, and whether a space preceded the slot (it moves into the label word).

    Args:
        text: A template ending in ``{answer}``.
    """
    template_fields(text)
    before = text[: -len("{" + ANSWER + "}")]
    if before.endswith(" "):
        return before[:-1], True
    return before, False


#: What a label word is tokenized after when the answer slot follows a field directly (``{sentence} {answer}``): a
#: stand-in for the field's last character. Alone, a SentencePiece tokenizer would mark the word as a text's start
#: (``" great"`` is ``["▁", "▁great"]``, ``"great"`` is ``["▁great"]``), which is not the token the prompt continues with.
FIELD_END = "."


def answer_context(text: str) -> str:
    """The template's literal text right before the answer slot (after its last field, without the space that
    moves into the label word): what a label word is tokenized after (:func:`label_word_ids`); :data:`FIELD_END`
    where the slot follows a field directly, ``""`` where the template is the slot alone.

    Args:
        text: A template ending in ``{answer}``.
    """
    before, _ = split_template(text)
    parts = list(string.Formatter().parse(before))
    if not parts:
        return ""
    return FIELD_END if parts[-1][1] is not None else parts[-1][0]


def _word_pieces(tokenizer: Any, context: str, text: str) -> list[int]:
    """Tokens of ``text`` as they follow ``context`` in a prompt, else of ``text`` alone.

    SentencePiece tokenizers (Llama 2, Mistral) prepend ``▁`` to every text they are given: alone, ``" great"``
    is ``["▁", "▁great"]`` and ``"Yes"`` is ``["▁Yes"]``, while after ``"It was"`` and ``"\n"`` the prompt's next
    tokens are ``"▁great"`` and ``"Yes"``. Byte-level BPE (GPT-2, SmolLM2) gives the same either way.
    """
    if context:
        base = tokenizer(context, add_special_tokens=False)["input_ids"]
        full = tokenizer(context + text, add_special_tokens=False)["input_ids"]
        if len(full) > len(base) and full[: len(base)] == base:  # the word did not merge into the context's tokens
            return full[len(base):]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def special_prefix(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama's, Gemma's ``<bos>``; none for SmolLM2), without
    any it appends (an EOS there would sit between the prompt and its answer).

    Args:
        tokenizer: The model's tokenizer.
    """
    full = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []


def label_word_ids(tokenizer: Any, words: tuple[str, ...] | list[str], leading_space: bool,
                   multi_token: str = "error", context: str = "") -> list[int]:
    """One token id per label word (with a leading space when the template had one before the slot).

    Args:
        tokenizer: The model's tokenizer.
        words: The label words, in class order.
        leading_space: Prepend a space to each word before tokenizing.
        multi_token: What to do with a word that is several tokens: ``"error"`` (default: the loss scores one
            position, so a multi-token word would be scored by its first piece only) or ``"first"`` (use the first
            piece, which must still differ between classes).
        context: The text the word follows in the prompt (:func:`answer_context`); the word is tokenized after it,
            as the prompt's next tokens (a SentencePiece tokenizer marks a text's start with ``▁`` otherwise).

    Raises:
        ConfigError: For a multi-token word under ``"error"``, an empty word, or two classes sharing a token.
    """
    if multi_token not in MULTI_TOKEN_POLICIES:
        raise ConfigError(f"data.multi_token must be one of {', '.join(MULTI_TOKEN_POLICIES)}; got {multi_token!r}")
    if len(words) < 2:
        raise ConfigError(f"data.label_words needs at least two words; got {list(words)!r}")
    ids = []
    for word in words:
        text = (" " + word) if leading_space else word
        pieces = _word_pieces(tokenizer, context, text)
        if not pieces:
            raise ConfigError(f"data.label_words: {word!r} tokenizes to nothing")
        if len(pieces) > 1 and multi_token == "error":
            shown = [tokenizer.decode([i]) for i in pieces]
            raise ConfigError(f"data.label_words: {text!r} is {len(pieces)} tokens {shown}; choose a one-token word "
                              "or set data.multi_token: first (scores its first token only)")
        ids.append(pieces[0])
    if len(set(ids)) < len(ids):
        dup = [w for w, i in zip(words, ids) if ids.count(i) > 1]
        raise ConfigError(f"data.label_words {dup} map to the same token; the classes would be indistinguishable")
    return ids


def render_prompt(tokenizer: Any, template: str, example: dict[str, str], fmt: str = "plain",
                  system_prompt: str | None = None, max_length: int = 256) -> list[int]:
    """Token ids of one prompt up to (not including) the answer.

    When the prompt is longer than ``max_length`` the template's *first* field is cut from its end (LM-BFF's
    ``first_sent_limit``), token by token, so the instruction and the answer position survive.
    A plain prompt starts with the special tokens the tokenizer puts before a text (:func:`special_prefix`: a
    Llama or Gemma model expects its ``<bos>``); a chat prompt has those its chat template writes.

    Args:
        tokenizer: The model's tokenizer (with a chat template for ``fmt="chat"``).
        template: Template ending in ``{answer}``.
        example: Field values.
        fmt: ``"plain"`` or ``"chat"``.
        system_prompt: System message for ``"chat"`` (``None``: the chat template's default).
        max_length: Maximum prompt tokens.

    Raises:
        DataError: If the prompt cannot fit even with its first field emptied.
    """
    before, _ = split_template(template)
    names = [n for n in template_fields(template) if n != ANSWER]
    missing = [n for n in names if n not in example]
    if missing:
        raise ConfigError(f"data.template uses {missing} but the task's fields are {sorted(example)}")
    values = {n: str(example[n]).strip() for n in names}
    prefix = special_prefix(tokenizer) if fmt == "plain" else []

    def encode(vals: dict[str, str]) -> list[int]:
        text = before.format(**vals)
        if fmt == "plain":
            return prefix + tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
        messages.append({"role": "user", "content": text})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    ids = encode(values)
    if len(ids) <= max_length or not names:
        if len(ids) > max_length:
            raise DataError(f"the prompt takes {len(ids)} tokens > data.max_length={max_length}")
        return ids
    first = names[0]
    pieces = tokenizer(values[first], add_special_tokens=False)["input_ids"]
    keep = max(0, len(pieces) - (len(ids) - max_length))
    while True:  # decoding and re-encoding can merge tokens differently: shrink until it fits
        ids = encode({**values, first: tokenizer.decode(pieces[:keep])})
        if len(ids) <= max_length:
            return ids
        if keep == 0:
            # Only the first field is cut: say which fields still fill the prompt, not just "the template".
            others = [n for n in dict.fromkeys(names) if n != first]
            held = f", with {others} and {first!r} emptied," if others else f", with {first!r} emptied,"
            raise DataError(f"the template alone{held} takes {len(ids)} tokens > data.max_length={max_length} "
                            f"(only the first field, {first!r}, is cut to fit)")
        keep = max(0, keep - max(1, len(ids) - max_length))
