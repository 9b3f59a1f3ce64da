"""Third review of peftplug.data's file reading: tab-separated files in GLUE's convention (a quote is text)."""

from __future__ import annotations

import csv

import pytest

from peftplug.data import TextClassificationData, read_table
from peftplug.errors import DataError

# GLUE-style rows (RTE, QNLI, MRPC): cells are written as they are, with no quoting; a quote is a character of the
# text. The second row's quote closes two lines later, after a tab.
GLUE_STYLE = (
    "index\tsentence1\tsentence2\tlabel\n"
    '0\t"The Persians" was written by Aeschylus.\tAeschylus wrote a play.\tentailment\n'
    '1\t"From depths of woe I cry to you") in 1523 as a hymn.\tIt is a hymn.\tentailment\n'
    "2\tWhat plants create most electric power?\tCoal plants do.\tnot_entailment\n"
    '3\tHe said it was " very methodical .\t" Yes " he said .\tnot_entailment\n'
    '4\t" His advice is to pass it . "\tHe advised passing it.\tentailment\n'
)


def _stdlib_rows(path) -> list[list[str]]:
    """The reference: the rows as GLUE's own readers take them (``csv.QUOTE_NONE``), header dropped."""
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]


def test_a_glue_style_tsv_keeps_every_row_and_its_quotes(tmp_path, tokenizer):
    # Before: pandas' quoting read the cells as CSV: row 0 lost its quotes, row 1's quote swallowed row 2 (4 rows of
    # 5, every text after it shifted), and row 3 glued cells together.
    path = tmp_path / "dev.tsv"
    path.write_text(GLUE_STYLE, encoding="utf-8")
    want = _stdlib_rows(path)
    table = read_table(str(path), ["sentence1", "sentence2", "label"], ["sentence1", "sentence2"])
    assert list(table["sentence1"]) == [r[1] for r in want]
    assert list(table["sentence2"]) == [r[2] for r in want]
    assert list(table["label"]) == [r[3] for r in want]

    data = TextClassificationData(train_file=str(path), validation_file=str(path), text_column="sentence1",
                                  text_pair_column="sentence2", max_length=256)
    data.tokenizer = tokenizer
    data.setup()
    encoded = tokenizer([r[1] for r in want], [r[2] for r in want], truncation=True, max_length=256)["input_ids"]
    assert [e["input_ids"] for e in data.splits["validation"]] == encoded
    assert [data.label_names[e["labels"]] for e in data.splits["validation"]] == [r[3] for r in want]


def test_a_tsv_written_by_pandas_still_reads_its_quoted_cells(tmp_path):
    import pandas as pd

    # pandas quotes a cell holding a quote, a tab or a line break, and doubles the quotes inside: such files parse
    # as quoted CSV, and are read so.
    texts = ['say "hi"', "tab\there", "two\nlines", "plain", '"quoted" start']
    for cells in (texts, texts[:1] + texts[3:], texts[1:2] + texts[3:4], texts[2:4]):
        path = tmp_path / "pandas.tsv"
        pd.DataFrame({"text": cells, "label": list(range(len(cells)))}).to_csv(path, sep="\t", index=False)
        table = read_table(str(path), ["text", "label"], ["text"])
        assert list(table["text"]) == cells
        assert list(table["label"]) == list(range(len(cells)))


def test_the_error_of_a_glue_style_tsv_names_its_real_problem(tmp_path):
    # A row with a field too many is named by its line; before, the quote of line 2 was reported instead.
    path = tmp_path / "bad.tsv"
    path.write_text('text\tlabel\n"Hi" there\t1\nok\t0\textra\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3: 3 fields, the header has 2 \(text, label\)"):
        read_table(str(path), ["text", "label"], ["text"])


@pytest.mark.parametrize("name", ["QNLI/test.tsv", "MRPC/16-13/train.tsv", "MRPC/test.tsv", "RTE/512-42/dev.tsv"])
def test_the_shared_kshot_tsv_files_read_as_glues_rows(data_dir, name):
    # Before: QNLI's test file read as 990 rows of 1,000, MRPC 16-13's train as 29 of 32, MRPC's test failed to
    # parse, and RTE 512-42's dev lost the quotes of 30 cells.
    path = data_dir / "k-shot" / name
    with open(path, encoding="utf-8-sig", newline="") as handle:
        header = next(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns = [c for c in header if c in ("question", "sentence", "sentence1", "sentence2", "#1 String", "#2 String")]
    table = read_table(str(path), columns, columns)
    want = _stdlib_rows(path)
    for column in columns:
        assert list(table[column]) == [r[header.index(column)] for r in want]



def test_a_tsv_cell_longer_than_the_csv_modules_limit_is_still_read(tmp_path):
    long = "word " * 40000  # 200,000 characters: past csv.field_size_limit()
    path = tmp_path / "long.tsv"
    path.write_text(f'text\tlabel\n"{long}"\t1\n"say ""hi"""\t0\n', encoding="utf-8")
    assert list(read_table(str(path), ["text", "label"], ["text"])["text"]) == [long, 'say "hi"']
