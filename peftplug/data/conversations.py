"""Conversations for chat finetuning: reading one row's turns, and encoding them through the tokenizer's chat template
with the loss on every assistant turn.

What a row may hold (docs/cli.md, "The messages format"):

- ``messages``: a list of ``{"role": "system" | "user" | "assistant", "content": str}`` turns, single- or
  multi-turn (TRL's and OpenAI's conversational format). A system turn may only come first.
- ShareGPT's ``conversations`` of ``{"from": "human" | "gpt" | "system", "value": str}``: accepted, read as
  user / assistant / system turns (``user`` and ``assistant`` are accepted as ``from`` values too).
- OpenAI's per-message ``weight`` (0 or 1, assistant turns only): honoured, a weight-0 answer is context without
  loss.
- The ``tool`` role (and ``function`` / ``ipython`` / ``observation``, ``tool_calls``, ``function_call``): refused in
  one line; templates render tool calls in model-specific ways this loader cannot mask.
- List-valued content (OpenAI's content parts, images): refused in one line; join the text parts into one string.

Turns after the last assistant turn with loss are dropped (they carry no loss and nothing to answer).

Encoding (:func:`encode_conversation`): the conversation is rendered once with a placeholder per content, and the
text between the placeholders is the template's own (as :mod:`peftplug.data.chat` does for a prompt/response pair).
Contents are trimmed where the template trims them (Llama 3's and Gemma's ``| trim``, told by whitespace put around
the placeholders), and a template's own refusal of a conversation (``raise_exception``) is a one-line
:class:`~peftplug.errors.DataError`. Labels are the tokens of every assistant content with loss, plus the template's
tokens right after it up to and including the end-of-turn token (:func:`turn_end`: ``tokenizer.eos_token``, ChatML's
``<|im_end|>`` in instruct tokenizers, else the first special token, Gemma's ``<end_of_turn>``); everything else is
-100. A
conversation longer than ``max_length`` loses whole earlier exchanges (a user turn and the answers after it), oldest
first, the system turn kept; when the last exchange alone is too long, the last user turn is cut from its end; when
even that leaves it no token, the row is an error. Context turns (system, user, weight-0 answers) are tokenized
together with the template's text before them, so the tokens are those of the whole rendering; answers are tokenized
after the assistant header, as the model generates them. A template that rewrites a content (DeepSeek-R1's drops
``<think>`` blocks from answers) is found by rendering the real conversation, and the row is an error: its tokens and
loss cannot be told apart.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from peftplug.data.files import no_room
from peftplug.errors import ConfigError, DataError, one_line

MESSAGES, SHAREGPT = "messages", "conversations"
ROLES = ("system", "user", "assistant")
# ShareGPT's `from` values and the roles they stand for.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TOOL_ROLES = ("tool", "function", "ipython", "observation", "function_call", "tool_call")
_TOOL_REFUSAL = ("tool turns are not supported (chat templates render tool calls in model-specific ways); "
                 "drop them or write their text into user turns")


def _placeholder(index: int) -> str:
    # NUL bytes never occur in real text, so splitting the rendered template on these is unambiguous.
    return f"\x00PEFTPLUG_TURN_{index}\x00"


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation.

    Args:
        role: ``system``, ``user`` or ``assistant``.
        content: Its text.
        trained: Whether the loss covers it (assistant turns with weight 1).
    """

    role: str
    content: str
    trained: bool = False


@dataclass
class EncodedConversation:
    """A tokenized conversation.

    Args:
        input_ids: The whole (possibly shortened) conversation, ending with the last answer's end-of-turn token.
        labels: ``input_ids`` where the loss is, -100 elsewhere.
        prompt_length: Tokens before the last answer: ``input_ids[:prompt_length]`` is the generation prompt (it
            ends with the assistant header).
        answer_text: The last answer, stripped (the reference of the generation metrics).
        dropped_turns: Earlier turns dropped to fit ``max_length``.
    """

    input_ids: list[int]
    labels: list[int]
    prompt_length: int
    answer_text: str
    dropped_turns: int = 0


def _role_of(turn: Any, number: int, sharegpt: bool) -> str:
    key = "from" if sharegpt else "role"
    if not isinstance(turn, dict) or turn.get(key) is None:
        raise DataError(f"turn {number} is not a {{{key!r}: ..., {'value' if sharegpt else 'content'!r}: ...}} "
                        "object")
    role = turn[key]
    if role in TOOL_ROLES or turn.get("tool_calls") is not None or turn.get("function_call") is not None:
        raise DataError(f"turn {number} is a tool turn ({key} {role!r}): {_TOOL_REFUSAL}")
    accepted = SHAREGPT_ROLES if sharegpt else ROLES
    if role not in accepted:
        raise DataError(f"turn {number} has unknown {key} {role!r}; accepted: {', '.join(accepted)}")
    return SHAREGPT_ROLES[role] if sharegpt else role


def _content_of(turn: dict, number: int, sharegpt: bool) -> str:
    key = "value" if sharegpt else "content"
    content = turn.get(key)
    if isinstance(content, list):
        raise DataError(f"turn {number}'s {key} is a list (content parts); only string content is accepted: join "
                        "the text parts into one string")
    if not isinstance(content, str):
        raise DataError(f"turn {number}'s {key} is {type(content).__name__}, expected a string")
    return content


def _trained(turn: dict, role: str, number: int) -> bool:
    weight = turn.get("weight")
    if weight is None:
        return role == "assistant"
    if role != "assistant":
        raise DataError(f"turn {number} ({role}) has a weight; weight (0 or 1) is for assistant turns only")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
        raise DataError(f"turn {number}'s weight must be 0 or 1; got {weight!r}")
    return weight == 1


def parse_conversation(value: Any, column: str = MESSAGES) -> list[Turn]:
    """The turns of one row's conversation, checked, up to its last assistant turn with loss.

    Args:
        value: The row's ``messages`` (or ShareGPT ``conversations``) value: a list of turn dicts, or that list as
            JSON text (a CSV/TSV cell).
        column: :data:`MESSAGES` or :data:`SHAREGPT` (``from``/``value`` turns).

    Raises:
        DataError: One line (without the row's name, which the caller adds) for a value that is not a list of
            turns, a tool turn, an unknown role, a non-string content, a bad weight, a system turn after the first,
            no assistant turn, or an empty answer.
    """
    sharegpt = column == SHAREGPT
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{column} is text that is not a JSON list of turns") from None
    if not isinstance(value, list) or not value:
        raise DataError(f"{column} must be a non-empty list of turns; got {type(value).__name__}")
    turns = []
    for number, raw in enumerate(value, 1):
        role = _role_of(raw, number, sharegpt)
        if role == "system" and number > 1:
            raise DataError(f"turn {number} is a system turn; a system turn may only come first")
        turns.append(Turn(role, _content_of(raw, number, sharegpt), _trained(raw, role, number)))
    trained = [i for i, t in enumerate(turns) if t.trained]
    if not trained:
        has_answer = any(t.role == "assistant" for t in turns)
        raise DataError("no assistant turn to learn (every assistant turn has weight 0)" if has_answer
                        else "no assistant turn")
    for i in trained:
        if not turns[i].content.strip():
            raise DataError(f"turn {i + 1} (assistant) is empty")
    return turns[: trained[-1] + 1]


def with_system(turns: list[Turn], system_prompt: str | None) -> list[Turn]:
    """The turns with the recipe's system prompt first, unless the conversation has its own system turn (the
    file's wins).

    Args:
        turns: From :func:`parse_conversation`.
        system_prompt: The recipe's ``system_prompt`` (``None``: none added; the template may add its default).
    """
    if system_prompt is None or (turns and turns[0].role == "system"):
        return turns
    return [Turn("system", system_prompt), *turns]


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# Whitespace around each placeholder: a template that trims contents (Llama 3's and Gemma's `| trim`, Llama 2's
# `.strip()`) removes it, which tells that the real contents are trimmed too. Tabs make it unlike template text.
_PAD = " \t\n\t "


def _render(tokenizer: Any, messages: list[dict], roles: tuple[str, ...], **kwargs: Any) -> str:
    """``apply_chat_template`` as text; a template's own refusal (``raise_exception``: roles that do not alternate,
    no system role) becomes a one-line :class:`DataError` (the caller names the row)."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError as err:
        raise DataError(f"the chat template refuses a conversation with the roles {', '.join(roles)}: "
                        f"{one_line(err, 200)}") from None


@functools.lru_cache(maxsize=256)
def _template_split(tokenizer: Any, template: str, roles: tuple[str, ...]) -> tuple[tuple[tuple[int, ...], ...],
                                                                                    tuple[tuple[bool, bool], ...],
                                                                                    tuple[str, ...]]:
    """The template's own token ids around the contents of a conversation with these roles (``len(roles) + 1``
    pieces, piece ``i`` before content ``i``, the last after the last content), whether the template strips
    each content's (start, end), and the pieces' text. ``template`` is part of the cache key only (a tokenizer's
    template can be replaced)."""
    messages = [{"role": role, "content": _PAD + _placeholder(i) + _PAD} for i, role in enumerate(roles)]
    full = _render(tokenizer, messages, roles)
    texts, strips, rest = [], [], full
    for i in range(len(roles)):
        before, found, rest = rest.partition(_placeholder(i))
        if not found:
            raise ConfigError(f"data: the chat template does not render every turn's content in order (roles "
                              f"{', '.join(roles)})")
        if i and not strips[-1][1]:
            before = before.removeprefix(_PAD)  # the previous content's end, kept by the template
        strip_start = not before.endswith(_PAD)
        texts.append(before if strip_start else before.removesuffix(_PAD))
        strips.append((strip_start, not rest.startswith(_PAD)))
    texts.append(rest if strips[-1][1] else rest.removeprefix(_PAD))
    start = len(full) - len(rest) - len(_placeholder(len(roles) - 1)) - (0 if strips[-1][0] else len(_PAD))
    prompt = _render(tokenizer, messages[:-1], roles[:-1], add_generation_prompt=True)
    if prompt != full[:start]:
        # Templates that render the prompt differently with and without the answer cannot be split exactly.
        raise ConfigError("data: the chat template renders the prompt differently with and without the answer")
    pieces = tuple(tuple(_token_ids(tokenizer, text)) for text in texts)
    return pieces, tuple(strips), tuple(texts)


def template_pieces(tokenizer: Any, roles: tuple[str, ...]) -> list[list[int]]:
    """Token ids of the chat template's text around each content of a conversation with ``roles`` (the last role
    must be ``assistant``): piece ``i`` precedes content ``i``; the last piece follows the last answer.

    Args:
        tokenizer: A tokenizer with a chat template.
        roles: The conversation's roles, in order.

    Raises:
        ConfigError: If the tokenizer has no chat template, or the template cannot be split exactly.
        DataError: If the template refuses these roles (its own ``raise_exception``).
    """
    return [list(piece) for piece in _template_split(tokenizer, _template_of(tokenizer), tuple(roles))[0]]


def content_strips(tokenizer: Any, roles: tuple[str, ...]) -> list[tuple[bool, bool]]:
    """Whether the chat template strips whitespace from the start and the end of each content (``| trim`` in
    Llama 3's and Gemma's templates), so that a content is encoded as the template renders it.

    Args:
        tokenizer: A tokenizer with a chat template.
        roles: The conversation's roles, in order (the last must be ``assistant``).
    """
    return list(_template_split(tokenizer, _template_of(tokenizer), tuple(roles))[1])


def _check_rendering(tokenizer: Any, turns: list[Turn], generation_only: bool) -> None:
    """Checks that the template renders these turns as their own text between its pieces.

    The pieces are taken from a rendering with placeholder contents, so a template that rewrites a real content
    (DeepSeek-R1's and Qwen3's drop ``<think>`` blocks from answers, Qwen3's ``lstrip('\\n')``) would otherwise
    be trained on text it never renders, and the loss would cover tokens the model is never shown.

    Args:
        tokenizer: A tokenizer with a chat template.
        turns: The conversation to encode (after dropping exchanges, before any cut).
        generation_only: Check only the generation prompt before the last answer.

    Raises:
        DataError: When training (the caller names the row).
        ConfigError: For a generation prompt (`peftplug generate` then renders the conversation whole).
    """
    roles = tuple(t.role for t in turns)
    split = _template_split(tokenizer, _template_of(tokenizer), roles)
    strips, texts = split[1], split[2]
    shown = turns[:-1] if generation_only else turns
    segments: list[tuple[str, Turn | None]] = []
    for i, turn in enumerate(shown):
        segments += [(texts[i], None), (_strip(turn.content, strips[i]), turn)]
    segments.append((texts[len(turns) - 1] if generation_only else texts[-1], None))
    expected = "".join(text for text, _ in segments)
    messages = [{"role": t.role, "content": t.content} for t in shown]
    rendered = _render(tokenizer, messages, roles[: len(shown)], add_generation_prompt=generation_only)
    if rendered == expected:
        return
    differs = next((n for n, (a, b) in enumerate(zip(rendered, expected)) if a != b), min(len(rendered),
                                                                                        len(expected)))
    position, near = 0, shown[-1]
    for text, turn in segments:
        if turn is not None:
            near = turn
        if position + len(text) > differs:
            break
        position += len(text)
    message = (f"the chat template renders the {near.role} turn {one_line(near.content, 40)!r} differently from "
               "its text (templates that drop <think> blocks from answers do this), so its tokens and loss cannot be "
               "told apart; give the content as the template renders it")
    raise (ConfigError if generation_only else DataError)(message)


def _template_of(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("data: the tokenizer has no chat template; use CausalLMData for plain prompt/response text")
    return str(template)


def _strip(text: str, strip: tuple[bool, bool]) -> str:
    text = text.lstrip() if strip[0] else text
    return text.rstrip() if strip[1] else text


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {i for i, token in added.items() if getattr(token, "special", False)}


def turn_end(tokenizer: Any, tail: list[int]) -> list[int]:
    """The template's tokens that end an answer: ``tail`` (the text after the last answer) up to and including the
    end-of-turn token, what the model must learn to emit; what follows it (a newline) is never generated.

    The end-of-turn token is ``tokenizer.eos_token`` where the tail holds it (ChatML's ``<|im_end|>`` in SmolLM2's
    and Qwen's instruct tokenizers), else the tail's first special token: tokenizers whose ``eos_token`` ends the
    document, not the turn (Gemma's ``<end_of_turn>``, Phi-3's ``<|end|>``, ChatML on a base model's tokenizer).

    Args:
        tokenizer: The tokenizer.
        tail: The last template piece, from :func:`template_pieces`.
    """
    eos = tokenizer.eos_token_id
    if eos in tail:
        return tail[: tail.index(eos) + 1]
    special = _special_ids(tokenizer)
    ends = [n for n, token in enumerate(tail) if token in special]
    return tail[: ends[0] + 1] if ends else list(tail)


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokens that end a generated answer: ``eos_token`` and the chat template's end-of-turn token
    (:func:`turn_end`), which differ for Gemma, Phi-3 and ChatML on a base model's tokenizer.

    Args:
        tokenizer: The tokenizer (with or without a chat template).
    """
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if getattr(tokenizer, "chat_template", None):
        try:
            end = turn_end(tokenizer, template_pieces(tokenizer, ("user", "assistant"))[-1])
        except (ConfigError, DataError):
            end = []  # a template this module cannot split: eos alone, as before
        if end and end[-1] in _special_ids(tokenizer) and end[-1] not in ids:
            ids.append(end[-1])
    return ids


def _common_prefix(piece: list[int], end: list[int]) -> int:
    n = 0
    while n < min(len(piece), len(end)) and piece[n] == end[n]:
        n += 1
    return n


def _length(pieces: list[list[int]], contents: list[list[int]], end: list[int], generation_only: bool) -> int:
    """Tokens of the assembled conversation (only up to the last answer's start when ``generation_only``)."""
    total = sum(len(p) for p in pieces[:-1]) + sum(len(c) for c in contents[:-1])
    return total if generation_only else total + len(contents[-1]) + len(end)


def _with_piece(piece: list[int], joint: list[int]) -> tuple[list[int], list[int]]:
    """A context turn's (template piece, content) ids from the ids of both tokenized together.

    Tokenized apart, a content starting with whitespace is split where a whole rendering merges it with the
    template's newline before it (SmolLM2: ``"\\n  x"`` is ``ĊĠ Ġx`` whole, ``Ċ Ġ Ġx`` apart), so the prompts would
    not be the tokens ``apply_chat_template`` and inference servers give. The merged tokens count as content (they
    carry no loss; a cut user turn loses them last). Answers stay tokenized apart: the generation prompt ends with
    the template's header tokens, and the model answers after them.
    """
    n = _common_prefix(piece, joint)
    return piece[:n], joint[n:]


def _exchange_starts(turns: list[Turn]) -> list[int]:
    """Where each exchange begins: the first turn after the system turn, and every user turn."""
    first = 1 if turns[0].role == "system" else 0
    return sorted({first} | {i for i, t in enumerate(turns) if t.role == "user" and i >= first})


def encode_conversation(tokenizer: Any, turns: list[Turn], max_length: int,
                        generation_only: bool = False) -> EncodedConversation:
    """Tokenizes a conversation that ends with an assistant turn, loss on its assistant turns with loss.

    Args:
        tokenizer: A tokenizer with a chat template.
        turns: The conversation (system turn first, if any), ending with an assistant turn.
        max_length: Maximum tokens.
        generation_only: Encode only the prompt before the last answer (its content is ignored); then the length
            limit applies to that prompt.

    Raises:
        DataError: If the last exchange cannot fit ``max_length`` even with its user turn cut to one token, or the
            template renders a content otherwise than its text.
        ConfigError: If the tokenizer has no usable chat template (or, with ``generation_only``, the template renders
            a content otherwise than its text).
    """
    tokenized: dict[str, list[int]] = {}

    def content_ids(text: str) -> list[int]:
        if text not in tokenized:
            tokenized[text] = _token_ids(tokenizer, text)
        return tokenized[text]

    starts = _exchange_starts(turns)
    keep_system = 1 if turns[0].role == "system" else 0
    for start in starts:
        kept = turns[:keep_system] + turns[start:]
        roles = tuple(t.role for t in kept)
        split = _template_split(tokenizer, _template_of(tokenizer), roles)
        pieces, strips, texts = [list(piece) for piece in split[0]], split[1], split[2]
        kept_contents = []
        for i, (turn, strip) in enumerate(zip(kept, strips)):
            # As the template renders it: trimmed where it trims (else training sees whitespace generation never does).
            text = _strip(turn.content, strip)
            if turn.trained:
                kept_contents.append(content_ids(text))
            else:  # context: tokenized with the template's text before it, as a whole rendering is
                pieces[i], ids = _with_piece(pieces[i], content_ids(texts[i] + text))
                kept_contents.append(ids)
        end = turn_end(tokenizer, pieces[-1])
        length = _length(pieces, kept_contents, end, generation_only)
        if length <= max_length:
            _check_rendering(tokenizer, kept, generation_only)
            break
    else:
        _check_rendering(tokenizer, kept, generation_only)
        # The last exchange alone is too long: cut its user turn from the end, as a prompt/response prompt is cut.
        user = keep_system if kept[keep_system].role == "user" else None
        fixed = length - (len(kept_contents[user]) if user is not None else 0)
        if user is None or fixed >= max_length:
            raise no_room("the chat template and the answer", fixed, "the prompt", max_length)
        kept_contents[user] = kept_contents[user][: max_length - fixed]
    return _assemble(kept, kept_contents, pieces, end, generation_only, len(turns) - len(kept))


def _assemble(turns: list[Turn], contents: list[list[int]], pieces: list[list[int]], end: list[int],
              generation_only: bool, dropped: int) -> EncodedConversation:
    ids: list[int] = []
    labels: list[int] = []
    for i, (turn, content) in enumerate(zip(turns, contents)):
        piece = pieces[i]
        # After an answer with loss, the template's end-of-turn tokens are learned too (and nothing after them).
        learned = _common_prefix(piece, end) if i > 0 and turns[i - 1].trained else 0
        ids += piece
        labels += piece[:learned] + [-100] * (len(piece) - learned)
        if i == len(turns) - 1:
            prompt_length = len(ids)
            if generation_only:
                break
            content = content + end
        ids += content
        labels += content if turn.trained else [-100] * len(content)
    return EncodedConversation(ids, labels, prompt_length, turns[-1].content.strip(), dropped)
