"""EasyEdit2's training rows for steering vectors, tokenized exactly as its generators tokenize them.

EasyEdit2 (``zjunlp/EasyEdit``, ``steer/datasets/caa_data.py`` and ``steer/utils/templates.py``) feeds its CAA
generator rows ``{"question", "matching", "not_matching"}`` (the names its ``dataset_format.yaml`` maps every
dataset to) and its vector-prompt generator rows ``{"input", "output", "prompt"?}``. Per row it builds

- the question: ``question.strip()``, wrapped in the chat template (generation prompt added, optional system
  message) when ``use_chat_template``, else prefixed by ``system_prompt + " "`` when one is given;
- the two texts: ``question + " " + matching`` and ``question + " " + not_matching`` (with ``multiple_choice``:
  ``question + "\\nAnswer: " + answer``), tokenized with special tokens unless the chat template is used;
- the answer span: the tokens from ``len(tokenize(question))`` on (the mean over them is the row's activation),
  or, with ``multiple_choice``, the single position ``-2``.

The vector is the mean over rows of ``activation(matching) - activation(not_matching)``. Rows with an empty
answer are an error here (EasyEdit2 skips them with a printed warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from peftplug.errors import DataError

CAA_FIELDS = ("question", "matching", "not_matching")
VECTOR_PROMPT_FIELDS = ("input", "output")


@dataclass
class TokenizedPairs:
    """Token ids of contrastive pairs plus where each text's answer starts.

    Args:
        pos: Token ids of the positive (matching) texts.
        neg: Token ids of the negative texts.
        pos_start: Per positive text, the index of its first answer token.
        neg_start: Per negative text, the index of its first answer token.
        read: Where activations are read: ``"answer"`` (mean from the start on) or ``"second_to_last"``.
        texts: The untokenized ``(positive, negative)`` texts (for messages and provenance).
    """

    pos: list[list[int]]
    neg: list[list[int]]
    pos_start: list[int]
    neg_start: list[int]
    read: str = "answer"
    texts: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pos)

    def subset(self, idx: Sequence[int]) -> TokenizedPairs:
        """The pairs at ``idx`` (for minibatches).

        Args:
            idx: Row indices.
        """
        pick = lambda xs: [xs[i] for i in idx]
        return TokenizedPairs(pick(self.pos), pick(self.neg), pick(self.pos_start), pick(self.neg_start), self.read,
                              pick(self.texts) if self.texts else [])


def is_rows(pairs) -> bool:
    """Whether ``pairs`` are EasyEdit2 rows (dicts) rather than ``(positive, negative)`` tuples.

    Args:
        pairs: What the user passed as pairs.
    """
    return isinstance(pairs, (list, tuple)) and len(pairs) > 0 and isinstance(pairs[0], dict)


def apply_chat_template_with_system(tokenizer, messages: list[dict], system_prompt: str | None = None,
                                    **kwargs) -> str:
    """EasyEdit2's ``safe_apply_chat_template``: a system message if the template takes one, else folded.

    The template itself decides, not the model's name: a Gemma checkpoint under a local path (whose template
    raises on a system role) folds, and a template that accepts a system role (Gemma-3 merges it into the first
    user turn its own way) gets it as a system message, as EasyEdit2 does.

    Args:
        tokenizer: A tokenizer with a chat template.
        messages: The conversation (its first message is the user's).
        system_prompt: Optional system message; where the template refuses a system role it becomes a
            ``f"{system_prompt} "`` prefix of the first user message.
        **kwargs: Passed to ``apply_chat_template`` (``tokenize=False``, ``add_generation_prompt=True``, ...).
    """
    if system_prompt:
        try:
            return tokenizer.apply_chat_template([{"role": "system", "content": system_prompt}, *messages], **kwargs)
        except Exception:  # noqa: BLE001, S110 - templates refuse a system role by raising (jinja's raise_exception)
            pass  # then fold it into the user message below
    messages = [dict(m) for m in messages]
    if system_prompt and messages and messages[0].get("role") == "user":
        messages[0]["content"] = f"{system_prompt} {messages[0]['content']}"
    return tokenizer.apply_chat_template(messages, **kwargs)


def build_model_input(user_input: str, tokenizer, system_prompt: str | None = None,
                      use_chat_template: bool = False) -> str:
    """EasyEdit2's ``build_model_input``: the prompt text a question becomes.

    Args:
        user_input: The question (stripped first, as EasyEdit2 does).
        tokenizer: The tokenizer (its chat template when ``use_chat_template``).
        system_prompt: Optional system message (a prefix without the chat template; with it, a system message,
            or where the template refuses a system role a prefix of the user message, as EasyEdit2 does).
        use_chat_template: Wrap in the chat template with the generation prompt.
    """
    user_input = user_input.strip()
    if not use_chat_template:
        return f"{system_prompt} {user_input}" if system_prompt else user_input
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("use_chat_template=True, but the tokenizer has no chat template")
    return apply_chat_template_with_system(tokenizer, [{"role": "user", "content": user_input}], system_prompt,
                                           tokenize=False, add_generation_prompt=True)


def _ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _field(row, i: int, name: str, required: bool = True) -> str | None:
    value = row.get(name)
    if value is None:
        if required:
            raise DataError(f"row {i}: missing field {name!r} (EasyEdit2 rows need {', '.join(CAA_FIELDS)})")
        return None
    if not isinstance(value, str):
        raise DataError(f"row {i}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def caa_rows(
    tokenizer, rows: Sequence[dict], use_chat_template: bool = False, system_prompt: str | None = None,
    multiple_choice: bool = False,
) -> TokenizedPairs:
    """Tokenizes EasyEdit2 CAA rows ``{"question", "matching", "not_matching"}`` as its CAA generator does.

    Args:
        tokenizer: The model's tokenizer.
        rows: The rows (``question`` may be missing or empty: then the answers stand alone).
        use_chat_template: Wrap each question in the chat template (EasyEdit2's ``use_chat_template``).
        system_prompt: EasyEdit2's ``system_prompt``.
        multiple_choice: EasyEdit2's ``multiple_choice``: answers become ``"\\nAnswer: X"``, read at position -2.

    Raises:
        DataError: For a row that is not a dict, lacks a field or has an empty answer.
    """
    if not rows:
        raise DataError("rows is empty: a steering vector needs at least one {question, matching, not_matching} row")
    add_special = not use_chat_template
    out = TokenizedPairs([], [], [], [], "second_to_last" if multiple_choice else "answer")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"row {i} must be a dict with {', '.join(CAA_FIELDS)}, got {type(row).__name__}")
        question = _field(row, i, "question", required=False) or ""
        answers = [_field(row, i, "matching"), _field(row, i, "not_matching")]
        for name, answer in zip(("matching", "not_matching"), answers):
            if not answer.strip():
                raise DataError(f"row {i}: {name!r} is empty (each row needs a non-empty matching and not_matching)")
        prompt = build_model_input(question, tokenizer, system_prompt, use_chat_template)
        lead = "\nAnswer: " if multiple_choice else " "
        q_len = len(_ids(tokenizer, prompt, add_special))
        pair = []
        for answer in answers:
            ids = _ids(tokenizer, prompt + lead + answer, add_special)
            if len(ids) <= q_len or (multiple_choice and len(ids) < 2):
                raise DataError(f"row {i}: the answer {answer!r} adds no token after the question")
            pair.append(ids)
        out.pos.append(pair[0])
        out.neg.append(pair[1])
        out.pos_start.append(q_len)
        out.neg_start.append(q_len)
        out.texts.append((prompt + lead + answers[0], prompt + lead + answers[1]))
    return out


def vector_prompt_rows(
    tokenizer, rows: Sequence[dict], prompt: str | None = None, use_chat_template: bool = False,
    system_prompt: str | None = None,
) -> TokenizedPairs:
    """Tokenizes EasyEdit2 vector-prompt rows ``{"input", "output", "prompt"?}`` as its generator does.

    The positive text is the input with the steering prompt before it, the negative the bare input; both are
    followed by ``" " + output`` and read as the mean over the output tokens.

    Args:
        tokenizer: The model's tokenizer.
        rows: The rows; ``prompt`` in a row overrides the ``prompt`` argument.
        prompt: The steering prompt (EasyEdit2's hparams ``prompt``).
        use_chat_template: Wrap inputs in the chat template.
        system_prompt: Optional system message.
    """
    if not rows:
        raise DataError("rows is empty: vector_prompt needs at least one {input, output} row")
    add_special = not use_chat_template
    out = TokenizedPairs([], [], [], [], "answer")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"row {i} must be a dict with input, output (and optionally prompt)")
        steer = (_field(row, i, "prompt", required=False) or prompt or "").strip()
        if not steer:
            raise DataError(f"row {i}: no steering prompt (give prompt=... or a 'prompt' field)")
        text_in = (_field(row, i, "input", required=False) or "").strip()
        output = (_field(row, i, "output") or "").strip()
        if not output:
            raise DataError(f"row {i}: 'output' is empty")
        with_prompt = build_model_input(steer + (" " + text_in if text_in else ""), tokenizer, system_prompt,
                                        use_chat_template)
        without = build_model_input(text_in, tokenizer, system_prompt, use_chat_template)
        for side, question in (("pos", with_prompt), ("neg", without)):
            q_len = len(_ids(tokenizer, question, add_special))
            ids = _ids(tokenizer, question + " " + output, add_special)
            if len(ids) <= q_len:
                raise DataError(f"row {i}: the output {output!r} adds no token after the input")
            getattr(out, side).append(ids)
            getattr(out, f"{side}_start").append(q_len)
        out.texts.append((with_prompt + " " + output, without + " " + output))
    return out
