"""Reading local data files (JSON, JSONL, CSV, TSV, Parquet) with ``datasets``, with one-line errors that name the
file and its first bad line or row, and splitting a training file into train and validation.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from peftplug.errors import ConfigError, DataError, MissingFileError, one_line

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}


def _blank(path: Path, chunk: int = 1 << 16) -> bool:
    """Whether a file holds nothing but a byte-order mark and whitespace, read up to its first other byte (not whole:
    data files can be gigabytes)."""
    with path.open("rb") as f:
        head = f.read(chunk)
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:]
        while head:
            if head.strip(b" \t\r\n"):
                return False
            head = f.read(chunk)
    return True


def _tsv_reader(handle: Any, quoting: int) -> Iterator[list[str]]:
    """The non-blank rows of a tab-separated file, read strictly with ``quoting`` (streamed: files can be large)."""
    return (row for row in csv.reader(handle, delimiter="\t", strict=True, quoting=quoting) if row)


def _tsv_quoting(path: Path) -> int:
    """How a ``.tsv`` file's cells are quoted: ``csv.QUOTE_NONE`` (a quote is a character of the text, as in GLUE's
    and LM-BFF's files, which the k-shot reader :mod:`peftplug.data.kshot` reads so), unless the file is quoted
    CSV with tabs, as ``pandas.to_csv(sep="\\t")`` writes it: it parses so, and it needs it (a quoted cell holds a
    tab or a line break) or shows it (a doubled quote inside a quoted cell, a quoted header).

    pandas' lenient quoting misread GLUE-style files silently: a cell starting with a quote (RTE's ``"The Persians"
    was written by Aeschylus.``) lost its quotes, and one whose quote closed lines later swallowed the rows between
    (the k-shot QNLI test file read as 990 rows of 1,000, MRPC's 16-13 train as 29 of 32); others failed to parse.

    Args:
        path: The ``.tsv`` file.
    """
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            widths = {len(row) for row in _tsv_reader(f, csv.QUOTE_MINIMAL)}
        if len(widths) > 1:  # a quote that spans cells or lines: text, not quoting
            return csv.QUOTE_NONE
        with path.open(encoding="utf-8-sig", newline="") as f, path.open(encoding="utf-8-sig", newline="") as g:
            pairs = itertools.zip_longest(_tsv_reader(f, csv.QUOTE_NONE), _tsv_reader(g, csv.QUOTE_MINIMAL))
            for number, (as_text, as_csv) in enumerate(pairs):
                if as_text is None or as_csv is None or len(as_text) != len(as_csv):
                    return csv.QUOTE_MINIMAL  # quoted tabs or line breaks: only quoting reads the file
                for cell, value in zip(as_text, as_csv):
                    if cell != value and (number == 0 or '"' in value):
                        return csv.QUOTE_MINIMAL  # a doubled quote inside a quoted cell, or a quoted header
    except csv.Error as err:
        if "field limit" in str(err):  # a cell too long for the csv module to judge: pandas' quoting, as before
            return csv.QUOTE_MINIMAL
        return csv.QUOTE_NONE  # a quote inside a cell that it does not enclose: GLUE-style
    except UnicodeDecodeError:
        return csv.QUOTE_MINIMAL  # not UTF-8: the reader's error names the line
    # No quoting needed or shown: a cell in quotes (MRPC's `" His advice ... . "`) is a quotation, kept as written.
    return csv.QUOTE_NONE


def read_table(path: str, columns: Sequence[str], text_columns: Sequence[str] = ()) -> dict[str, list]:
    """Reads the named columns of a local JSON/JSONL/CSV/TSV/Parquet file with ``datasets``.

    A ``.tsv`` file is read as GLUE writes it, with no quoting, unless it is quoted CSV with tabs (see
    :func:`_tsv_quoting`).

    Args:
        path: File path; the format follows the extension.
        columns: Columns that must exist.
        text_columns: Columns whose CSV/TSV cells are text exactly as written. Otherwise pandas infers a type per
            column, and a column of numbers comes back changed (``007`` -> ``7.0``, ``2`` -> ``2.0``, ``1e3`` ->
            ``1000.0`` once any cell of it is empty or fractional).

    Returns:
        A dict from column name to list of values.

    Raises:
        MissingFileError: If the file does not exist.
        ConfigError: For an unsupported extension.
        DataError: If the file cannot be parsed (the message names the file and its first bad line or row) or a
            column is missing (the message lists the columns that exist).
    """
    import datasets
    import pyarrow

    p = Path(path).expanduser()
    if not p.is_file():
        raise MissingFileError(f"data file {str(p)!r} does not exist")
    builder = _BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise ConfigError(f"data file {p.name!r}: the extension must be one of {', '.join(_BUILDERS)}")
    if p.suffix.lower() in (".json", ".jsonl") and _blank(p):
        # datasets' JSON reader stops with a bare StopIteration on a file with no record; CSV says this too.
        raise DataError(f"data file {str(p)!r}: the file is empty (expected JSON records)")
    kwargs = {"delimiter": "\t", "quoting": _tsv_quoting(p)} if p.suffix.lower() == ".tsv" else {}
    if p.suffix.lower() in (".csv", ".tsv"):
        # pandas would read the cells NA, N/A, None, null, nan ... as missing, and such a row would be refused as
        # empty; only a cell with nothing in it is missing here.
        kwargs["keep_default_na"] = False
        if text_columns:
            # A converter hands pandas' raw cell text through (names absent from the file are ignored).
            kwargs["converters"] = {c: str for c in text_columns}
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    # The builders log their parse failure before raising; the DataError below says it once, with the line.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        table = datasets.load_dataset(builder, data_files={"data": str(p)}, split="data", **kwargs)
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, ValueError,
            UnicodeDecodeError) as err:
        raise DataError(f"data file {str(p)!r}: {_first_bad_record(p) or _innermost_message(err)}") from err
    finally:
        datasets.logging.set_verbosity(verbosity)
    if p.suffix.lower() in (".csv", ".tsv"):
        _refuse_repeated_columns(p, kwargs.get("delimiter", ","), columns, kwargs.get("quoting", csv.QUOTE_MINIMAL))
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(
            f"data file {p.name!r} has no column {', '.join(map(repr, missing))}; "
            f"its columns are: {', '.join(table.column_names)}"
        )
    return {c: table[c] for c in columns}


def _innermost_message(err: BaseException) -> str:
    """The message of the deepest cause of a reader error (``datasets`` wraps the parser's own error)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    if "corresponds to no data" in str(err):  # datasets' words for a file that holds no row (an empty Parquet)
        return "the file holds no rows"
    return f"cannot be read as a table ({one_line(f'{type(err).__name__}: {err}', 300)})"


def _first_bad_record(path: Path) -> str | None:
    """Where a JSON/JSONL/CSV/TSV file stops parsing (``"line 5: ..."``), or ``None`` if it parses here.

    ``datasets``' readers do not say which line is broken; re-reading with the standard library does.

    Args:
        path: The file that failed to load.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":  # binary: decoding it as text would report "not UTF-8 text" for any failure
        return _empty_parquet(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        return f"line {line}: not UTF-8 text (byte {err.object[err.start]:#04x})"
    if suffix in (".csv", ".tsv"):
        quoting = _tsv_quoting(path) if suffix == ".tsv" else csv.QUOTE_MINIMAL
        return _first_bad_csv_row(text, "\t" if suffix == ".tsv" else ",", quoting)
    if suffix in (".json", ".jsonl"):
        return _first_bad_json_line(text, suffix == ".jsonl")
    return None


def _empty_parquet(path: Path) -> str | None:
    """``"the file holds no rows"`` for a Parquet file of no rows (``datasets`` fails on it with an Arrow batch-size
    error), else ``None``."""
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (pyarrow.ArrowException, OSError):
        return None  # not readable as Parquet: the reader's own message says why
    return "the file holds no rows" if rows == 0 else None


def _first_bad_json_line(text: str, lines: bool) -> str | None:
    """The first line of JSON Lines text that is not a JSON object; for a ``.json`` file that is not JSON Lines,
    the position where the document stops parsing."""
    if not lines:
        try:
            document = json.loads(text)
            # Valid JSON: the failure is about its shape, which the reader's message tells, unless it holds nothing.
            return "the file holds no records" if document in ([], {}) else None
        except json.JSONDecodeError as err:
            whole = f"line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})"
        first = next((line for line in text.splitlines() if line.strip()), "")
        if not first.lstrip().startswith("{"):
            return whole
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number}, column {err.colno}: not valid JSON ({err.msg})"
        if not isinstance(record, dict):
            return f"line {number}: expected a JSON object per line, got {type(record).__name__}"
    return None


def _first_bad_csv_row(text: str, delimiter: str, quoting: int = csv.QUOTE_MINIMAL) -> str | None:
    """The first row with more fields than the header, or where quoting breaks (``csv`` in strict mode).

    Args:
        text: The file's text.
        delimiter: Its field delimiter.
        quoting: How it is read (``csv.QUOTE_NONE`` for a GLUE-style ``.tsv``, see :func:`_tsv_quoting`).
    """
    reader = csv.reader(io.StringIO(text), delimiter=delimiter, strict=True, quoting=quoting)
    start, header, rows = 1, None, 0  # a quoted field may span lines: a row is named by the line it starts on
    try:
        for row in reader:
            if not header:  # the first non-blank line is the header
                header = row
            elif len(row) > len(header):
                return f"line {start}: {len(row)} fields, the header has {len(header)} ({', '.join(header)})"
            start = reader.line_num + 1
            rows += header is not row and any(cell.strip() for cell in row)
    except csv.Error as err:
        hint = " (an unclosed quote?)" if "end of data" in str(err) else ""
        return f"the row starting at line {start}: {err}{hint}"
    if not header:
        return "the file is empty (expected a header row)"
    return None if rows else f"the file has a header row ({', '.join(header)}) but no data rows"


def _refuse_repeated_columns(path: Path, delimiter: str, columns: Sequence[str],
                             quoting: int = csv.QUOTE_MINIMAL) -> None:
    """Refuses a CSV/TSV header that names a column we read more than once.

    pandas renames the later copies (``response.1``) and the first one is read: a file whose columns were pasted
    twice, or mislabelled, trains on whichever came first, silently.

    Args:
        path: The CSV/TSV file (it parsed).
        delimiter: Its field delimiter.
        columns: The columns read from it.
        quoting: How its cells are quoted (see :func:`_tsv_quoting`).
    """
    with path.open(encoding="utf-8-sig", newline="") as f:
        header = next((row for row in csv.reader(f, delimiter=delimiter, quoting=quoting) if row), [])
    for name in columns:
        where = [str(i + 1) for i, cell in enumerate(header) if cell == name]
        if len(where) > 1:
            raise DataError(
                f"data file {str(path)!r}: the header names column {name!r} {len(where)} times (fields "
                f"{', '.join(where)}); rename or remove the extra ones (only the first would be read)"
            )


def _split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Shuffled (train, validation) index lists with ``fraction`` of ``n`` in validation (at least one)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise DataError(f"cannot split {n} examples into train and validation (val_fraction={fraction})")
    return order[n_val:], order[:n_val]


def check_val_fraction(val_fraction: float) -> None:
    """Raises ``ConfigError`` unless ``0 < val_fraction < 1``.

    Args:
        val_fraction: The ``data.val_fraction`` setting.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1); got {val_fraction}")


# The entry of each split (besides its columns) that says where every row came from: (file, row number from 1).
ROW_SOURCE = "__row_source__"


def row_name(split: str, cols: dict[str, list], index: int) -> str:
    """Names row ``index`` of a split for an error message: its file and row there, whichever split it went to.

    Args:
        split: The split the row is in (``train``, ``validation``, ``test``).
        cols: The split's columns from :func:`read_splits` (with :data:`ROW_SOURCE`), or columns without it (rows
            that do not come from a file: then the split and index are named).
        index: The row's index in the split.
    """
    sources = cols.get(ROW_SOURCE)
    if not sources:
        return f"{split} row {index}"
    path, row = sources[index]
    return f"data file {str(path)!r} row {row} ({split} split)"


class TooLongRow(DataError):
    """A row that ``max_length`` leaves no room for (see :func:`no_room`): a training split skips it with a warning
    (:class:`RowErrors` with ``skip_too_long``), a held-out split refuses it."""


class RowErrors:
    """The bad rows of one split, reported together: the first in full, then how many more and which.

    A file with a dozen too-long answers is then fixed in one pass instead of a dozen runs. Use::

        errors = RowErrors(split, cols, skip_too_long=split == "train")
        for index, row in enumerate(rows):
            with errors.row(index):
                ...  # raises DataError for a bad row; the rest of the block is skipped
        errors.raise_if_any(kept=len(examples), max_length=max_length)

    With ``skip_too_long`` a row that does not fit ``max_length`` (:class:`TooLongRow`) is left out and counted in one
    warning instead of stopping the run, as TRL, torchtune and Axolotl never stop a run for one long example (they
    truncate it, or drop it with a count); cutting the answer is not an option here (an answer is never cut). Only
    the training split skips: a held-out split that lost rows would give a metric over other rows than the file's,
    and ``predict``'s ``index`` would no longer be the row's position, so there it stays an error.

    Args:
        split: The split's name.
        cols: The split's columns (with :data:`ROW_SOURCE`, see :func:`row_name`).
        skip_too_long: Skip rows that do not fit ``max_length`` (with a warning) instead of refusing them.
    """

    SHOWN = 5  # further rows named in the message

    def __init__(self, split: str, cols: dict[str, list], skip_too_long: bool = False) -> None:
        self.split, self.cols = split, cols
        self.skip_too_long = skip_too_long
        self.failed: list[tuple[int, str]] = []
        self.skipped: list[tuple[int, str]] = []

    @contextlib.contextmanager
    def row(self, index: int):
        """Records a :class:`DataError` raised for row ``index`` instead of letting it stop the split.

        Args:
            index: The row's index in the split.
        """
        try:
            yield
        except TooLongRow as err:
            (self.skipped if self.skip_too_long else self.failed).append((index, str(err)))
        except DataError as err:
            self.failed.append((index, str(err)))

    def _listed(self, rows: list[tuple[int, str]], what: str) -> str:
        """The first of ``rows`` in full, then how many more and which (``what``: how they are called)."""
        (first, message), rest = rows[0], rows[1:]
        text = f"{row_name(self.split, self.cols, first)}: {message}"
        if rest:
            shown = ", ".join(self._short_name(i) for i, _ in rest[: self.SHOWN])
            more = ", ..." if len(rest) > self.SHOWN else ""
            text += f" (and {len(rest)} more {what} of the {self.split} split: {shown}{more})"
        return text

    def _short_name(self, index: int) -> str:
        sources = self.cols.get(ROW_SOURCE)
        return str(sources[index][1]) if sources else str(index)

    def raise_if_any(self, kept: int | None = None, max_length: int | None = None) -> None:
        """Raises one DataError for the recorded bad rows (none: nothing); then warns of the skipped ones.

        Args:
            kept: How many rows of the split were kept (to say how many were skipped, and to refuse a split whose
                every row was skipped); ``None`` when nothing is skipped.
            max_length: The data module's ``max_length``, named in the warning.

        Raises:
            DataError: If a row was bad, or every row of the split was too long.
        """
        if self.failed:
            raise DataError(self._listed(self.failed, "row(s)"))
        if not self.skipped:
            return
        listed = self._listed(self.skipped, "too-long row(s)")
        if not kept:
            raise DataError(f"every row of the {self.split} split is too long for data.max_length={max_length}: "
                            f"{listed}")
        from lightning.pytorch.utilities import rank_zero_warn  # lazy: reading files needs no Lightning

        rank_zero_warn(f"peftplug: skipped {len(self.skipped)} of {len(self.skipped) + kept} {self.split} rows that "
                       f"do not fit data.max_length={max_length}, {listed}; raise data.max_length to train on them")


def row_text(value: object, name: str, blank_ok: bool = False) -> str:
    """One text cell of a row, checked: the one rule every data module applies to its text columns.

    ``datasets`` gives a JSON ``null``, a missing key or an empty CSV cell back as ``None``; ``str(None)`` would
    train on the text "None", so such a row is refused instead (the caller names the row, with :func:`row_name`).

    Args:
        value: The cell as read.
        name: What the cell is, for the message (``prompt``, ``response``, ``text``).
        blank_ok: Accept an empty or whitespace-only string (a prompt may be empty; an answer may not).

    Returns:
        The cell as text.

    Raises:
        DataError: For a missing value, a list or dict, or (unless ``blank_ok``) blank text.
    """
    if isinstance(value, (list, dict)):
        raise DataError(f"the {name} is a {type(value).__name__}, expected text (for conversational turns use a "
                        "`messages` column)")
    if value is None or (not blank_ok and not str(value).strip()):
        raise DataError(f"the {name} is empty")
    return str(value)


def no_room(taken_by: str, tokens: int, left_for: str, max_length: int) -> TooLongRow:
    """The error of a row whose fixed part leaves nothing of the part that must be kept within ``max_length``.

    Args:
        taken_by: What fills the room (``the prompt``, ``the chat template and the answer``).
        tokens: How many tokens it takes.
        left_for: What gets no room (``the response``, ``the prompt``).
        max_length: The data module's ``max_length``.
    """
    return TooLongRow(f"{taken_by} take{'' if ' and ' in taken_by else 's'} {tokens} tokens, leaving no room for "
                      f"{left_for} within max_length={max_length}")


def read_splits(files: dict[str, str | None], columns: Sequence[str], val_fraction: float,
                seed: int, text_columns: Sequence[str] = ()) -> dict[str, dict[str, list]]:
    """Reads the configured split files; without a validation file, holds out ``val_fraction`` of train.

    Args:
        files: ``{"train": path, "validation": path or None, "test": path or None}``.
        columns: Columns every file must have (the first one sizes the held-out split).
        val_fraction: Fraction of the training file held out when there is no validation file.
        seed: Seed of that split.
        text_columns: Columns read as text exactly as written (see :func:`read_table`).

    Returns:
        ``{split: {column: values}}`` for every split present; each split also has :data:`ROW_SOURCE`, the file
        and row number (from 1, a CSV header not counted) of every row, so errors can name them
        (:func:`row_name`) after the held-out split has mixed them.
    """
    if files["train"] is None:
        raise ConfigError("data.train_file is required")
    raw = {}
    for split, path in files.items():
        if path is not None:
            raw[split] = read_table(path, columns, text_columns)
            raw[split][ROW_SOURCE] = [(path, i + 1) for i in range(len(raw[split][columns[0]]))]
    if "validation" not in raw:
        full = raw["train"]
        train_idx, val_idx = _split(len(full[columns[0]]), val_fraction, seed)
        raw["train"] = {k: [v[i] for i in train_idx] for k, v in full.items()}
        raw["validation"] = {k: [v[i] for i in val_idx] for k, v in full.items()}
    return raw
