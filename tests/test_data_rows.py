"""Bad rows and files are refused, naming the file and row (docs/cli.md, "Data files"), by every file-reading
data module with the same rule: a missing (JSON null / absent key) text, an empty answer, an answer that
``max_length`` cuts away entirely, an empty JSON/JSONL file, and a held-out evaluation that counts nothing."""

from __future__ import annotations

import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml

from peftplug.cli import main
from peftplug.data import CausalLMData, ChatData, TextClassificationData
from peftplug.errors import DataError

PAIRS = {"prompt_column": "prompt", "response_column": "response"}


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _good(n=6):
    return [{"prompt": f"add {i} and {i}", "response": f" {2 * i}", "text": f"item {i}", "label": i % 2}
            for i in range(n)]


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "x", "response": None}, "the response is empty"),
    ({"prompt": "x"}, "the response is empty"),
    ({"prompt": "x", "response": "  "}, "the response is empty"),
    ({"prompt": None, "response": "y"}, "the prompt is empty"),
])
def test_causal_lm_pairs_refuse_missing_and_empty_fields(tmp_path, bad, message):
    train = _write(tmp_path / "train.jsonl", _good() + [bad])
    data = CausalLMData(train_file=train, validation_file=_write(tmp_path / "val.jsonl", _good(2)),
                        tokenizer="tiny:llama", max_length=64, **PAIRS)
    with pytest.raises(DataError) as raised:
        data.setup()
    assert str(raised.value) == f"data file {train!r} row 7 (train split): {message}"


@pytest.mark.parametrize("cls, kwargs", [(CausalLMData, PAIRS), (ChatData, {})], ids=["causal_lm", "chat"])
def test_every_bad_row_of_a_split_is_counted_in_one_error(tmp_path, cls, kwargs):
    # One error per run named only the first bad row: a file with many was fixed one run at a time.
    bad = [{"prompt": "x", "response": None}, {"prompt": None, "response": "y"}] * 4  # rows 7-14
    train = _write(tmp_path / "train.jsonl", _good() + bad)
    data = cls(train_file=train, validation_file=_write(tmp_path / "val.jsonl", _good(2)), tokenizer="tiny:llama",
               max_length=64, **kwargs)
    with pytest.raises(DataError) as raised:
        data.setup()
    assert str(raised.value) == (f"data file {train!r} row 7 (train split): the response is empty "
                                 "(and 7 more row(s) of the train split: 8, 9, 10, 11, 12, ...)")


def test_chat_and_causal_lm_give_the_same_message_for_the_same_row(tmp_path):
    train = _write(tmp_path / "train.jsonl", _good() + [{"prompt": "x", "response": None}])
    val = _write(tmp_path / "val.jsonl", _good(2))
    messages = []
    for cls, kwargs in ((CausalLMData, PAIRS), (ChatData, {})):
        with pytest.raises(DataError) as raised:
            cls(train_file=train, validation_file=val, tokenizer="tiny:llama", **kwargs).setup()
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_plain_text_null_is_refused(tmp_path):
    rows = [{"text": f"line {i}"} for i in range(5)] + [{"text": None}]
    train = _write(tmp_path / "train.jsonl", rows)
    data = CausalLMData(train_file=train, validation_file=_write(tmp_path / "v.jsonl", rows[:2]),
                        tokenizer="tiny:llama")
    with pytest.raises(DataError, match=r"row 6 \(train split\): the text is empty"):
        data.setup()


def test_causal_lm_refuses_a_response_cut_away_by_max_length(tmp_path):
    rows = _good() + [{"prompt": "word " * 200, "response": " yes"}]
    train = _write(tmp_path / "train.jsonl", rows)
    data = CausalLMData(train_file=_write(tmp_path / "t.jsonl", _good()), validation_file=train,
                        tokenizer="tiny:llama", max_length=64, **PAIRS)
    with pytest.raises(DataError, match=r"row 7 \(validation split\): the prompt takes \d+ tokens, leaving no room for "
                                        r"the response within max_length=64"):
        data.setup()


def test_classification_null_text_is_refused(tmp_path):
    rows = _good() + [{"text": None, "label": 1}]
    train = _write(tmp_path / "train.jsonl", rows)
    data = TextClassificationData(train_file=train, validation_file=_write(tmp_path / "v.jsonl", _good(2)),
                                  tokenizer="tiny:llama")
    with pytest.raises(DataError, match=r"row 7 \(train split\): the text is empty"):
        data.setup()


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("empty.json", ""), ("blank.jsonl", "\n \n")])
@pytest.mark.parametrize("cls, kwargs", [(CausalLMData, PAIRS), (TextClassificationData, {}), (ChatData, {})])
def test_empty_json_files_are_refused_in_one_line(tmp_path, name, text, cls, kwargs):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as raised:
        cls(train_file=str(path), tokenizer="tiny:llama", **kwargs).setup()
    assert str(raised.value) == f"data file {str(path)!r}: the file is empty (expected JSON records)"


def test_messages_jsonl_with_a_byte_order_mark_is_read_as_messages(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"ok {i}"}]}
            for i in range(6)]
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    data = ChatData(train_file=str(path), tokenizer="tiny:llama", val_fraction=0.5)
    data.setup()
    assert data.row_format == "messages" and len(data.splits["train"]) == 3


class MaskedHeldOutData(CausalLMData):
    """Instruction data whose test split has no target token (every label masked): what a custom data module can
    produce, and what CausalLMData itself now refuses."""

    def setup(self, stage=None):
        super().setup(stage)
        self.splits["test"] = [{**ex, "labels": [-100] * len(ex["labels"])} for ex in self.splits["validation"]]


def test_a_held_out_evaluation_that_counts_nothing_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train = _write(tmp_path / "train.jsonl", _good(8))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 1,
                    "enable_model_summary": False},
        "model": {"model": "tiny:llama", "peft": {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}},
        "data": {"class_path": f"{__name__}.MaskedHeldOutData",
                 "init_args": {"train_file": train, "batch_size": 4, "max_length": 64, **PAIRS}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp_path / "c.yaml"), "--evaluate_after_fit", "true"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "held-out evaluation: 0 examples counted (no held-out row has a target token)", out[-3:]


def test_csv_cells_that_pandas_would_call_missing_are_text(tmp_path):
    # NA, N/A, None, null are answers, not missing cells; only a cell with nothing in it is empty.
    lines = ["prompt,response"] + [f"q{i},{word}" for i, word in enumerate(["NA", "N/A", "None", "null", "nan", "ok"])]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    data = CausalLMData(train_file=str(tmp_path / "t.csv"), validation_file=str(tmp_path / "t.csv"),
                        tokenizer="tiny:llama", **PAIRS)
    data.setup()
    assert len(data.splits["train"]) == 6
    (tmp_path / "e.csv").write_text("prompt,response\nq0,ok\nq1,\n")
    with pytest.raises(DataError, match=r"row 2 \(train split\): the response is empty"):
        CausalLMData(train_file=str(tmp_path / "e.csv"), validation_file=str(tmp_path / "t.csv"),
                     tokenizer="tiny:llama", **PAIRS).setup()


def test_a_json_file_after_a_long_blank_start_is_not_empty(tmp_path):
    # The emptiness check reads up to the first byte that is not whitespace, in chunks, not the whole file.
    rows = _good()
    path = tmp_path / "t.jsonl"
    path.write_text("\n" * 200_000 + "\n".join(json.dumps(r) for r in rows) + "\n")
    data = CausalLMData(train_file=str(path), validation_file=str(path), tokenizer="tiny:llama", **PAIRS)
    data.setup()
    assert len(data.splits["train"]) == len(rows)
