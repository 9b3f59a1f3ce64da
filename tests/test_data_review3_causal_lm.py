"""Third review of CausalLMData: a tokenizer that appends EOS itself (Llama/Mistral with ``add_eos_token=True``)."""

from __future__ import annotations

import json

import pytest

from peftplug.data import CausalLMData


@pytest.fixture
def eos_tokenizer():
    """The char tokenizer with a post-processor that frames every text as ``<s> text </s>``."""
    from tokenizers import processors

    from peftplug.tiny import char_tokenizer

    tok = char_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    assert tok("ab")["input_ids"] == [1] + tok("ab", add_special_tokens=False)["input_ids"] + [2]
    return tok


def _data(tmp_path, tokenizer, **kwargs) -> CausalLMData:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"text": "once upon", "q": "Tell:", "a": "a story"}) for _ in range(3)))
    data = CausalLMData(train_file=str(path), validation_file=str(path), task="causal_lm", max_length=64, **kwargs)
    data.tokenizer = tokenizer
    data.setup()
    return data


def test_plain_text_ends_in_one_eos(tmp_path, eos_tokenizer):
    # Before: [<s>, o, n, c, e, ..., </s>, </s>]: the tokenizer's EOS and ours, both trained on.
    row = _data(tmp_path, eos_tokenizer).splits["train"][0]
    want = [1] + eos_tokenizer("once upon", add_special_tokens=False)["input_ids"] + [2]
    assert row["input_ids"] == want and row["labels"] == want


def test_no_eos_between_the_prompt_and_its_response(tmp_path, eos_tokenizer):
    # Before: <s> Tell: </s> a story </s>, the prompt's mask covering that EOS, and the generation prompt ending in it.
    data = _data(tmp_path, eos_tokenizer, prompt_column="q", response_column="a")
    prompt = eos_tokenizer("Tell:", add_special_tokens=False)["input_ids"]
    response = eos_tokenizer("a story", add_special_tokens=False)["input_ids"]
    row = data.splits["train"][0]
    assert row["input_ids"] == [1] + prompt + response + [2]
    assert row["labels"] == [-100] * (1 + len(prompt)) + response + [2]
    batch = next(iter(data.predict_dataloader()))
    assert batch["input_ids"][0].tolist() == [1] + prompt


def test_tokenizers_without_eos_are_unchanged(tmp_path, tokenizer):
    # The char tokenizer adds no special token (like SmolLM2's): the rows are the text's tokens and one EOS.
    data = _data(tmp_path, tokenizer, prompt_column="q", response_column="a")
    prompt = tokenizer("Tell:")["input_ids"]
    assert data.splits["train"][0]["input_ids"] == prompt + tokenizer("a story")["input_ids"] + [2]
    assert next(iter(data.predict_dataloader()))["input_ids"][0].tolist() == prompt


def test_generate_raw_prompts_match_the_training_prompt(tmp_path, eos_tokenizer):
    # peftplug generate on a plain-trained checkpoint (or --raw) encodes the prompt as CausalLMData does: before, it
    # ended in the EOS this tokenizer appends, a token training never put between a prompt and its answer.
    from peftplug.generate_cli import Generator

    data = _data(tmp_path, eos_tokenizer, prompt_column="q", response_column="a")
    generator = Generator(model="tiny:llama")
    generator.tokenizer = eos_tokenizer  # encode only reads the tokenizer
    expected = next(iter(data.predict_dataloader()))["input_ids"][0].tolist()
    assert generator.encode([{"role": "user", "content": "Tell:"}], raw=True) == expected
