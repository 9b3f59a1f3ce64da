"""Second review of peftplug.data: what a user's own files meet — CSV cells that look like numbers, empty labels,
byte-order marks, files without rows, texts that give no tokens."""

from __future__ import annotations

import json

import pytest

from peftplug.data import CausalLMData, ChatData, TextClassificationData, read_table
from peftplug.errors import DataError

# Cells pandas would read as numbers: a column of them came back as 7.0, 1.5, 1000.0, 2.0.
NUMBERS = ["007", "1.50", "1e3", "3.10", "2"]


def _lines(path, header, rows, sep=","):
    path.write_text("\n".join([sep.join(header)] + [sep.join(r) for r in rows]) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_csv_text_cells_that_look_like_numbers_keep_their_text(tmp_path, tokenizer, suffix, sep):
    path = _lines(tmp_path / f"qa{suffix}", ["prompt", "response"], [[f"q{i}", v] for i, v in enumerate(NUMBERS)],
                  sep)
    lm = CausalLMData(train_file=path, validation_file=path, prompt_column="prompt", response_column="response")
    lm.tokenizer = tokenizer
    lm.setup()
    trained = [tokenizer.decode([t for t in e["labels"] if t != -100]) for e in lm.splits["validation"]]
    assert trained == [v + tokenizer.eos_token for v in NUMBERS]

    chat = ChatData(train_file=path, validation_file=path)
    chat.tokenizer = tokenizer
    chat.setup()
    assert chat.answers["validation"] == NUMBERS

    # Text columns of a classification file too; the label column keeps its integer type (class ids).
    path = _lines(tmp_path / f"cls{suffix}", ["text", "label"], [[v, str(i % 2)] for i, v in enumerate(NUMBERS)], sep)
    cls = TextClassificationData(train_file=path, validation_file=path)
    cls.tokenizer = tokenizer
    cls.setup()
    assert [tokenizer.decode(e["input_ids"]) for e in cls.splits["validation"]] == NUMBERS
    assert [e["labels"] for e in cls.splits["validation"]] == [i % 2 for i in range(len(NUMBERS))]
    assert cls.label_names is None


def test_a_csv_with_a_byte_order_mark_keeps_text_cells_as_written(tmp_path, tokenizer):
    path = tmp_path / "bom.csv"
    path.write_text("\ufeffprompt,response\nq,007\nr,2\n", encoding="utf-8")
    chat = ChatData(train_file=str(path), validation_file=str(path))
    chat.tokenizer = tokenizer
    chat.setup()
    assert chat.answers["validation"] == ["007", "2"]


def test_a_messages_csv_with_a_byte_order_mark_is_read_as_messages(tmp_path, tokenizer):
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["messages"])
    for i in range(4):
        writer.writerow([json.dumps([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}])])
    path = tmp_path / "chat.csv"
    path.write_text("\ufeff" + buffer.getvalue(), encoding="utf-8")  # Excel's "CSV UTF-8"
    data = ChatData(train_file=str(path), validation_file=str(path))
    data.tokenizer = tokenizer
    data.setup()
    assert data.row_format == "messages"
    assert data.answers["validation"] == [f"a{i}" for i in range(4)]


@pytest.mark.parametrize("name, text", [
    ("train.jsonl", "\n".join(json.dumps({"text": f"t{i}", "label": None if i == 2 else "pn"[i % 2]}) for i in range(6))),
    ("train.csv", "text,label\n" + "".join(f"t{i},{'' if i == 2 else i % 2}\n" for i in range(6))),
    ("train.tsv", "text\tlabel\n" + "".join(f"t{i}\t{'  ' if i == 2 else 'ab'[i % 2]}\n" for i in range(6))),
])
def test_an_empty_label_is_refused_naming_its_row(tmp_path, tokenizer, name, text):
    # Before: a JSON null became the class "None", an empty CSV cell the class "" (and turned the integer column
    # into text, so the ids 0, 1 became the strings "0", "1", shifted by the "" class).
    path = tmp_path / name
    path.write_text(text)
    data = TextClassificationData(train_file=str(path), val_fraction=0.5)
    data.tokenizer = tokenizer
    with pytest.raises(DataError, match=rf"^data file '{path}' row 3 \(\w+ split\): the label is empty$"):
        data.setup()


def test_integer_labels_name_the_row_of_a_word_label(tmp_path, tokenizer):
    train = _lines(tmp_path / "train.csv", ["text", "label"], [[f"t{i}", str(i % 3)] for i in range(6)])
    # One word makes pandas read the whole column as text; the digit cells before it are still class ids.
    val = _lines(tmp_path / "val.csv", ["text", "label"], [["a", "1"], ["b", "2"], ["c", "pos"]])
    data = TextClassificationData(train_file=train, validation_file=val)
    data.tokenizer = tokenizer
    with pytest.raises(DataError, match=rf"^data file '{val}' row 3 \(validation split\): label 'pos'; labels must"):
        data.setup()
    val = _lines(tmp_path / "val2.csv", ["text", "label"], [["a", "1"], ["b", "2"], ["c", "0"]])
    data = TextClassificationData(train_file=train, validation_file=val)
    data.tokenizer = tokenizer
    data.setup()
    assert [e["labels"] for e in data.splits["validation"]] == [1, 2, 0]


def test_a_nan_label_is_refused_in_one_line(tmp_path, tokenizer):
    import pandas as pd

    path = tmp_path / "train.parquet"
    pd.DataFrame({"text": ["a", "b", "c", "d"], "label": [0.0, 1.0, float("nan"), 1.0]}).to_parquet(path)
    data = TextClassificationData(train_file=str(path), val_fraction=0.5)
    data.tokenizer = tokenizer
    with pytest.raises(DataError, match=rf"^data file '{path}' row 3 \(\w+ split\): (the label is empty|label nan)"):
        data.setup()


@pytest.mark.parametrize("name, text, message", [
    ("header.csv", "prompt,response\n", r"the file has a header row \(prompt, response\) but no data rows"),
    ("header.tsv", "prompt\tresponse\n\n", r"the file has a header row \(prompt, response\) but no data rows"),
    ("blank.csv", "\n\n", r"the file is empty \(expected a header row\)"),
    ("list.json", "[]", "the file holds no records"),
])
def test_a_file_without_rows_says_so(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^data file '{path}': {message}$"):
        read_table(str(path), ["prompt", "response"])


def test_a_parquet_file_without_rows_is_not_called_non_utf8_text(tmp_path):
    import pandas as pd

    path = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "response": pd.Series([], dtype=str)}).to_parquet(path)
    with pytest.raises(DataError, match=rf"^data file '{path}': the file holds no rows$"):
        read_table(str(path), ["prompt", "response"])
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet \xae\xff")
    with pytest.raises(DataError, match=r"cannot be read as a table \(ArrowInvalid: ") as caught:
        read_table(str(path), ["prompt"])
    assert "UTF-8" not in str(caught.value)


def test_a_classification_text_that_gives_no_tokens_is_refused(tmp_path, tokenizer):
    # The char tokenizer adds no BOS (as GPT-2's and SmolLM2's do not): "" would be an example of zero tokens, and a
    # batch of them fails inside the model with a reshape error.
    assert tokenizer("")["input_ids"] == []
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "label": i % 2}) for i, t in enumerate(["ab", " ", "", "cd"])))
    data = TextClassificationData(train_file=str(path), validation_file=str(path))
    data.tokenizer = tokenizer
    with pytest.raises(DataError, match=rf"^data file '{path}' row 3 \(train split\): the text is empty"):
        data.setup()


def test_a_pooled_kshot_jsonl_with_a_byte_order_mark_is_read(tmp_path):
    from peftplug.data.kshot import split_rows
    from peftplug.data.prompt_tasks import get_task

    spec = get_task("boolq")
    records = [{"question": f"q{i}", "passage": f"p{i}", "label": bool(i % 2), "idx": i} for i in range(8)]
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    marked.write_text("\ufeff" + plain.read_text(encoding="utf-8"), encoding="utf-8")
    read = [split_rows(spec.name, dict.fromkeys(("train", "validation", "test"), p), 2, 13) for p in (plain, marked)]
    assert read[0] == read[1]
    assert read[1]["train"] and {r["label"] for r in read[1]["train"]} == {"false", "true"}
