"""peftplug.data: file formats, splits, label mapping, prompt masking, clear errors, and the BBC News source."""

from __future__ import annotations

import json

import pytest

from peftplug.data import BBCNewsData, CausalLMData, TextClassificationData, pad_batch, read_table
from peftplug.errors import ConfigError, DataError, MissingFileError

ROWS = [{"text": f"{i}: sample number", "label": ["sports", "arts", "news"][i % 3]} for i in range(10)]


def _write(path, fmt, rows=ROWS):
    import pandas as pd

    frame = pd.DataFrame(rows)
    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "tsv":
        frame.to_csv(path, index=False, sep="\t")
    else:
        frame.to_parquet(path)
    return path


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "tsv", "parquet"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    table = read_table(str(_write(tmp_path / f"d.{fmt}", fmt)), ["text", "label"])
    assert table["text"] == [r["text"] for r in ROWS]
    assert table["label"] == [r["label"] for r in ROWS]


def test_missing_file_column_and_extension(tmp_path):
    with pytest.raises(MissingFileError, match="does not exist"):
        read_table(str(tmp_path / "nope.csv"), ["text"])
    path = _write(tmp_path / "d.csv", "csv")
    with pytest.raises(DataError, match=r"no column 'sentence'; its columns are: text, label"):
        read_table(str(path), ["sentence"])
    (tmp_path / "d.xml").write_text("<x/>")
    with pytest.raises(ConfigError, match="extension must be one of"):
        read_table(str(tmp_path / "d.xml"), ["text"])


def test_classification_labels_split_and_tokens(tmp_path, tokenizer):
    train = _write(tmp_path / "train.jsonl", "jsonl")
    data = TextClassificationData(train_file=str(train), val_fraction=0.3, max_length=8, seed=1)
    data.tokenizer = tokenizer
    data.setup()
    assert data.label_names == ["arts", "news", "sports"]
    assert len(data.splits["train"]) == 7 and len(data.splits["validation"]) == 3
    texts = {tokenizer.decode(f["input_ids"]) for s in data.splits.values() for f in s}
    assert len(texts) == 10  # disjoint splits covering all rows
    for split in data.splits.values():
        for f in split:
            assert len(f["input_ids"]) <= 8
            text = next(r for r in ROWS if r["text"].startswith(tokenizer.decode(f["input_ids"])))
            assert data.label_names[f["labels"]] == text["label"]
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["labels"].shape == (3,)
    assert data.num_labels == 3

    # A validation label never seen in training is an error, not a silent new class.
    val = _write(tmp_path / "val.jsonl", "jsonl", [{"text": "x", "label": "weather"}])
    other = TextClassificationData(train_file=str(train), validation_file=str(val))
    other.tokenizer = tokenizer
    with pytest.raises(DataError, match="weather"):
        other.setup()


def test_causal_lm_masks_the_prompt(tmp_path, tokenizer):
    rows = [{"q": "2+2=", "a": "4"}, {"q": "hello ", "a": "world"}]
    path = _write(tmp_path / "i.json", "json", rows * 3)
    data = CausalLMData(train_file=str(path), validation_file=str(path), prompt_column="q", response_column="a",
                        task="causal_lm")
    data.tokenizer = tokenizer
    data.setup()
    first = data.splits["train"][0]
    n_prompt = len(tokenizer("2+2=")["input_ids"])
    assert first["labels"][:n_prompt] == [-100] * n_prompt
    assert first["labels"][n_prompt:] == tokenizer("4", add_special_tokens=False)["input_ids"] + [2]
    assert first["input_ids"][n_prompt:] == first["labels"][n_prompt:]
    with pytest.raises(DataError, match="no column 'prompt'"):
        bad = CausalLMData(train_file=str(path), prompt_column="prompt", response_column="a", task="causal_lm")
        bad.tokenizer = tokenizer
        bad.setup()
    with pytest.raises(ConfigError, match="set together"):
        CausalLMData(train_file=str(path), prompt_column="q")


def test_pad_batch_left_and_right():
    feats = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7]},
             {"input_ids": [8], "attention_mask": [1], "labels": [8]}]
    right = pad_batch(feats, pad_id=0)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    left = pad_batch(feats, pad_id=0, left=True)
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bbcnews_fixed_split():
    texts, labels, topics = BBCNewsData.articles()
    assert len(texts) == 2225 and topics == ["business", "entertainment", "politics", "sports", "tech"]
    assert sorted(set(labels)) == [0, 1, 2, 3, 4]
    data = BBCNewsData(n_train=50, n_val=20, n_test=30, seed=0)
    raw = data.load_raw()
    again = BBCNewsData(n_train=50, n_val=20, n_test=30, seed=0).load_raw()
    assert raw == again
    assert [len(raw[s]["text"]) for s in ("train", "validation", "test")] == [50, 20, 30]
    seen = [t for s in raw.values() for t in s["text"]]
    assert len(set(seen)) == len(seen)
    with pytest.raises(ConfigError, match="exceeds"):
        BBCNewsData(n_train=2000, n_val=200, n_test=200).load_raw()


def test_label_errors_name_the_file_and_row(tmp_path):
    from peftplug.loading import load_tokenizer

    train = _write(tmp_path / "train.csv", "csv")
    validation = _write(tmp_path / "val.csv", "csv", ROWS[:3] + [{"text": "odd", "label": "weather"}])
    data = TextClassificationData(train_file=str(train), validation_file=str(validation))
    data.tokenizer = load_tokenizer("tiny:bert")
    with pytest.raises(DataError) as raised:
        data.setup()
    assert str(raised.value) == (f"validation labels ['weather'] do not occur in the training data (first: data file "
                                 f"{str(validation)!r} row 4 (validation split))")
    negative = _write(tmp_path / "neg.jsonl", "jsonl", [{"text": f"t{i}", "label": 1 - i} for i in range(10)])
    data = TextClassificationData(train_file=str(negative), validation_file=str(negative))
    data.tokenizer = load_tokenizer("tiny:bert")
    with pytest.raises(DataError, match=rf"data file '{negative}' row 3 \(train split\): label -1; labels must be"):
        data.setup()
