"""A new user's own chat file, third review: one conversation longer than ``data.max_length`` stopped the whole run.

``ChatData`` (and ``CausalLMData``) never cut an answer, so a row whose answer alone outgrows ``max_length`` cannot
be trained on; it was a ``DataError`` that stopped ``peftplug fit`` before the first step, for one long row among
thousands. TRL and torchtune truncate such rows and Axolotl drops them with a count: none stops the run. A training
row that does not fit is now skipped, all of them counted in one warning naming the first; a held-out row that does
not fit is still an error (a metric over fewer rows than the file's, or ``predict`` indices shifted past a skipped
row, would be silently wrong), and so is a training split none of whose rows fits.
"""

from __future__ import annotations

import json

import pytest

from peftplug.data import CausalLMData, ChatData
from peftplug.errors import DataError

PAIRS = {"prompt_column": "prompt", "response_column": "response"}
MAX_LENGTH = 200  # the tiny Llama's tokenizer is one token per character


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat(i):
    return {"messages": [{"role": "user", "content": f"add {i} and 3"}, {"role": "assistant", "content": str(i + 3)}]}


LONG_CHAT = {"messages": [{"role": "user", "content": "tell a story"},
                          {"role": "assistant", "content": "once upon a time " * 20}]}


def _setup(cls, train, validation, **kwargs):
    data = cls(train_file=train, validation_file=validation, tokenizer="tiny:llama", max_length=MAX_LENGTH, **kwargs)
    data.setup()
    return data


def test_a_training_conversation_longer_than_max_length_is_skipped_with_a_count(tmp_path):
    good = [_chat(i) for i in range(8)]
    val = _write(tmp_path / "val.jsonl", good[:2])
    train = _write(tmp_path / "train.jsonl", good[:5] + [LONG_CHAT] + good[5:])  # the long one is row 6
    with pytest.warns(UserWarning) as caught:
        data = _setup(ChatData, train, val)
    # The reference: the same file without the long row.
    reference = _setup(ChatData, _write(tmp_path / "ref.jsonl", good), val)
    assert data.splits["train"] == reference.splits["train"]
    assert data.splits["validation"] == reference.splits["validation"]
    messages = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith(f"peftplug: skipped 1 of 9 train rows that do not fit data.max_length={MAX_LENGTH}, "
                                  f"data file {train!r} row 6 (train split): the chat template and the answer take ")
    assert messages[0].endswith("raise data.max_length to train on them")


def test_several_long_training_rows_are_counted_in_one_warning(tmp_path):
    good = [_chat(i) for i in range(4)]
    train = _write(tmp_path / "train.jsonl", good[:2] + [LONG_CHAT] * 3 + good[2:])  # rows 3, 4, 5
    with pytest.warns(UserWarning, match=r"skipped 3 of 7 train rows .* row 3 \(train split\): .* \(and 2 more "
                                         r"too-long row\(s\) of the train split: 4, 5\)"):
        data = _setup(ChatData, train, _write(tmp_path / "val.jsonl", good[:2]))
    assert len(data.splits["train"]) == 4


def test_a_held_out_conversation_longer_than_max_length_is_still_an_error(tmp_path):
    good = [_chat(i) for i in range(6)]
    val = _write(tmp_path / "val.jsonl", good[:1] + [LONG_CHAT])
    with pytest.raises(DataError, match=rf"^data file {val!r} row 2 \(validation split\): the chat template and the "
                                        rf"answer take \d+ tokens, leaving no room for the prompt within "
                                        rf"max_length={MAX_LENGTH}$"):
        _setup(ChatData, _write(tmp_path / "train.jsonl", good), val)


def test_a_training_split_of_only_long_rows_is_an_error(tmp_path):
    train = _write(tmp_path / "train.jsonl", [LONG_CHAT] * 2)
    with pytest.raises(DataError, match=rf"^every row of the train split is too long for data.max_length={MAX_LENGTH}: "
                                        rf"data file {train!r} row 1 \(train split\): .* \(and 1 more too-long row\(s\) "
                                        r"of the train split: 2\)$"):
        _setup(ChatData, train, _write(tmp_path / "val.jsonl", [_chat(0)]))


def test_other_bad_rows_still_stop_the_split_next_to_long_ones(tmp_path):
    good = [_chat(i) for i in range(4)]
    bad = {"messages": [{"role": "user", "content": "hi"}]}  # no assistant turn
    train = _write(tmp_path / "train.jsonl", good + [LONG_CHAT, bad])
    with pytest.raises(DataError, match=rf"^data file {train!r} row 6 \(train split\): "):
        _setup(ChatData, train, _write(tmp_path / "val.jsonl", good[:1]))


def test_causal_lm_skips_a_training_prompt_that_leaves_no_room_for_its_response(tmp_path):
    good = [{"prompt": f"add {i} and {i}", "response": f" {2 * i}"} for i in range(6)]
    long = {"prompt": "word " * 60, "response": " yes"}
    val = _write(tmp_path / "val.jsonl", good[:2])
    with pytest.warns(UserWarning, match=r"skipped 1 of 7 train rows .* row 7 \(train split\): the prompt takes \d+ "
                                         rf"tokens, leaving no room for the response within max_length={MAX_LENGTH}"):
        data = _setup(CausalLMData, _write(tmp_path / "train.jsonl", good + [long]), val, **PAIRS)
    reference = _setup(CausalLMData, _write(tmp_path / "ref.jsonl", good), val, **PAIRS)
    assert data.splits["train"] == reference.splits["train"]
    assert data.prompts["train"] == reference.prompts["train"]
    with pytest.raises(DataError, match=r"row 2 \(validation split\): the prompt takes"):
        _setup(CausalLMData, _write(tmp_path / "t.jsonl", good), _write(tmp_path / "v2.jsonl", [good[0], long]),
               **PAIRS)
