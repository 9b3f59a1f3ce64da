"""Reading :class:`peftplug.data.chat.ChatData`'s data: which format a file holds, and saved ``datasets`` folders
(``Dataset.save_to_disk``) beside the JSON/JSONL/CSV/TSV/Parquet files that :mod:`peftplug.data.files` reads.

The format is told by the training file's columns, read from its header or first record only (no second parse): a
``messages`` column, else a ShareGPT ``conversations`` column, else the prompt/response columns.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from peftplug.data.conversations import MESSAGES, SHAREGPT
from peftplug.data.files import ROW_SOURCE, _split, read_table
from peftplug.errors import ConfigError, DataError, MissingFileError, one_line

PAIRS = "pairs"


def _json_keys(path: Path) -> list[str] | None:
    # utf-8-sig: a byte-order mark (Windows Notepad writes one) would otherwise hide the first key's name.
    with open(path, encoding="utf-8-sig") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)  # JSON Lines (also in a .json file), or a one-line JSON array
    except json.JSONDecodeError:
        if path.suffix.lower() == ".jsonl":
            return None
        record = json.loads(path.read_text(encoding="utf-8-sig"))  # one JSON document: a list of records
    record = record[0] if isinstance(record, list) and record else record
    return list(record) if isinstance(record, dict) else None


def _json_records(path: Path) -> list | None:
    """The records of a JSON Lines file or a JSON array, read with the standard library; ``None`` if it is
    neither (``read_table`` then says where it breaks)."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            return None
    return records if isinstance(records, list) and all(isinstance(r, dict) for r in records) else None


def _json_conversations(path: Path, column: str) -> list | None:
    """A JSON/JSONL file's conversation column exactly as written. ``datasets`` infers one Arrow type per field:
    where one row's content is not a string it stores the field as JSON text and gives digit strings back as
    numbers (``"2"`` -> ``2``), so the bad row could not be named; the standard library keeps every value."""
    try:
        records = _json_records(path)
    except (OSError, UnicodeDecodeError):
        return None
    if records is None or any(column not in r for r in records):
        return None
    return [r[column] for r in records]


def file_columns(path: str) -> list[str] | None:
    """The column names of a data file or saved ``datasets`` folder, from its header or first record; ``None``
    when they cannot be told this way (the full read then reports what is wrong).

    Args:
        path: A JSON/JSONL/CSV/TSV/Parquet file or a ``save_to_disk`` folder.
    """
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    try:
        if p.is_dir():
            return list(_load_folder(p).column_names)
        if suffix in (".json", ".jsonl"):
            return _json_keys(p)
        if suffix in (".csv", ".tsv"):
            # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which would hide the first column's name.
            with open(p, encoding="utf-8-sig", newline="") as f:
                return next(csv.reader(f, delimiter="\t" if suffix == ".tsv" else ","), None)
        if suffix == ".parquet":
            import pyarrow.parquet

            return list(pyarrow.parquet.read_schema(p).names)
    except (OSError, ValueError, DataError, ImportError):
        return None
    return None


def chat_format(path: str | None) -> str:
    """The format of a chat data file: :data:`~peftplug.data.conversations.MESSAGES` if it has a ``messages``
    column, else :data:`~peftplug.data.conversations.SHAREGPT` for a ``conversations`` column, else
    :data:`PAIRS` (prompt/response columns).

    Args:
        path: The training file or folder (``None``: :data:`PAIRS`, for modules that build their own rows).
    """
    columns = file_columns(path) if path is not None else None
    for column in (MESSAGES, SHAREGPT):
        if columns and column in columns:
            return column
    return PAIRS


def _load_folder(path: Path):
    """The ``datasets.Dataset`` saved in a folder (one split: a ``DatasetDict`` folder is refused, naming its
    splits)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(f"data folder {str(path)!r} is not a saved `datasets` folder (Dataset.save_to_disk): "
                        f"{one_line(err, 200)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        raise DataError(f"data folder {str(path)!r} holds a DatasetDict (splits {splits}); give one split's folder, "
                        f"e.g. {str(path / next(iter(loaded)))!r}")
    return loaded


def read_chat_table(path: str, columns: Sequence[str], text_columns: Sequence[str] = ()) -> dict[str, list]:
    """The named columns of a data file (:func:`peftplug.data.files.read_table`) or of a saved ``datasets`` folder.

    Args:
        path: File or folder.
        columns: Columns that must exist.
        text_columns: Columns of a CSV/TSV file read as text exactly as written (see
            :func:`peftplug.data.files.read_table`).

    Raises:
        MissingFileError: If the path does not exist.
        DataError: For an unreadable file or folder, or a missing column (the message lists those that exist).
    """
    p = Path(path).expanduser()
    if p.suffix.lower() in (".json", ".jsonl") and list(columns) in ([MESSAGES], [SHAREGPT]) and p.is_file():
        values = _json_conversations(p, columns[0])
        if values is not None:
            return {columns[0]: values}
    if not p.is_dir():
        return read_table(path, columns, text_columns)
    table = _load_folder(p)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"data folder {str(p)!r} has no column {', '.join(map(repr, missing))}; its columns are: "
                        f"{', '.join(table.column_names)}")
    return {c: table[c] for c in columns}


def read_chat_splits(files: dict[str, str | None], columns: Sequence[str], val_fraction: float,
                     seed: int, text_columns: Sequence[str] = ()) -> dict[str, dict[str, list]]:
    """:func:`peftplug.data.files.read_splits` for files and saved folders alike: each configured split, the
    training data split into train and validation when there is no validation file, every row's source kept under
    :data:`~peftplug.data.files.ROW_SOURCE`.

    Args:
        files: ``{"train": path, "validation": path or None, "test": path or None}``.
        columns: Columns every file must have.
        val_fraction: Fraction of the training data held out when there is no validation file.
        seed: Seed of that split.
        text_columns: Columns of CSV/TSV files read as text exactly as written.
    """
    if files["train"] is None:
        raise ConfigError("data.train_file is required")
    raw = {}
    for split, path in files.items():
        if path is None:
            continue
        if not Path(path).expanduser().exists():
            raise MissingFileError(f"data file {str(Path(path).expanduser())!r} does not exist")
        raw[split] = read_chat_table(path, columns, text_columns)
        raw[split][ROW_SOURCE] = [(path, i + 1) for i in range(len(raw[split][columns[0]]))]
    if "validation" not in raw:
        full = raw["train"]
        train_idx, val_idx = _split(len(full[columns[0]]), val_fraction, seed)
        raw["train"] = {k: [v[i] for i in train_idx] for k, v in full.items()}
        raw["validation"] = {k: [v[i] for i in val_idx] for k, v in full.items()}
    return raw
