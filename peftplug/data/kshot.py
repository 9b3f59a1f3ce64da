"""Reading the LM-BFF/MeZO k-shot splits of the catalogue's tasks (``k-shot/<TASK>/<k>-<seed>/train|dev`` and
``k-shot/<TASK>/test``; BoolQ's splits drawn from one labelled pool per seed) as untokenized rows.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from peftplug.data.prompt_tasks import PromptTask, get_task
from peftplug.datadir import DATA_DIR_ENV
from peftplug.errors import ConfigError, DataError, MissingFileError


def _read_rows(path: Path, task: PromptTask) -> list[dict[str, str]]:
    """Rows of a k-shot file as ``{field: text, "label": raw label}``."""
    if not path.is_file():
        raise MissingFileError(f"task {task.name!r}: data file {str(path)!r} does not exist")
    if task.suffix == ".jsonl":
        return _read_jsonl(path, task)
    rows = []
    with path.open(encoding="utf-8-sig", newline="") as handle:
        if task.suffix == ".tsv" and task.header:
            reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header is None:
                raise DataError(f"data file {str(path)!r} is empty")
            want = list(task.fields.values()) + [task.label_column]
            absent = [c for c in want if c not in header]
            if absent:
                raise DataError(f"data file {str(path)!r} has no column {absent}; its columns are {header}")
            index = {c: header.index(c) for c in want}
        else:  # LM-BFF .csv, or a GLUE .tsv without header (CoLA): columns by index
            reader = (csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE) if task.suffix == ".tsv"
                      else csv.reader(handle))
            index = {c: c for c in list(task.fields.values()) + [task.label_column]}
        for line, row in enumerate(reader, start=2 if task.suffix == ".tsv" and task.header else 1):
            if not row:
                continue
            if max(index.values()) >= len(row):
                raise DataError(f"data file {str(path)!r}, line {line}: {len(row)} fields, expected more")
            label = row[index[task.label_column]].strip()
            if label not in task.labels:
                raise DataError(f"data file {str(path)!r}, line {line}: label {label!r} is not one of {task.labels}")
            rows.append({**{f: row[index[c]] for f, c in task.fields.items()}, "label": label})
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows")
    return rows


def _read_jsonl(path: Path, task: PromptTask) -> list[dict[str, str]]:
    """Rows of a SuperGLUE-style ``.jsonl`` file; labels as ``str(value).lower()`` (``true``/``false``)."""
    import json

    rows = []
    # utf-8-sig, as the .tsv/.csv files are read: a byte-order mark would make line 1 "not JSON".
    with path.open(encoding="utf-8-sig") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"data file {str(path)!r}, line {line}: not JSON ({err.msg})") from None
            absent = [c for c in list(task.fields.values()) + [task.label_column] if c not in item]
            if absent:
                raise DataError(f"data file {str(path)!r}, line {line}: no key {absent}; keys are {sorted(item)}")
            label = str(item[task.label_column]).lower()  # "true" (OpenCompass copy) and true (FewGLUE) alike
            if label not in task.labels:
                raise DataError(f"data file {str(path)!r}, line {line}: label {label!r} is not one of {task.labels}")
            rows.append({**{f: str(item[c]) for f, c in task.fields.items()}, "label": label})
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows")
    return rows


def sample_pool_splits(rows: list[dict[str, str]], labels: tuple[str, ...], k: int,
                       split_seed: int) -> dict[str, list[dict[str, str]]]:
    """Train/dev/test from one labelled pool: ``k`` train and ``k`` dev rows per class drawn with ``split_seed``;
    every other row is test (so the three never overlap, and the test set differs slightly per seed).

    Args:
        rows: The pool (rows with a ``label`` key).
        labels: The class labels.
        k: Shots per class.
        split_seed: Seed of the draw.

    Raises:
        ConfigError: If ``k`` < 1 (``k`` = -3 would slice most of each class into train and none into dev).
        DataError: If a class has fewer than ``2 k`` rows.
    """
    if k < 1:
        raise ConfigError(f"k must be >= 1; got {k}")
    rng = random.Random(split_seed)
    out: dict[str, list] = {"train": [], "validation": [], "test": []}
    for label in labels:
        members = [r for r in rows if r["label"] == label]
        if len(members) < 2 * k:
            raise DataError(f"label {label!r} has {len(members)} rows; k={k} needs {2 * k} (train + dev)")
        rng.shuffle(members)
        out["train"] += members[:k]
        out["validation"] += members[k:2 * k]
        out["test"] += members[2 * k:]
    rng.shuffle(out["train"])
    rng.shuffle(out["validation"])
    return out


def _no_data(task: str, path: Path) -> str:
    """The one line for a task whose data is not where the folder source looks: both ways to get it."""
    return (f"task {task!r} has no data: {str(path)!r} does not exist; either put LM-BFF's k-shot files there "
            f"(or point data.data_dir / ${DATA_DIR_ENV} at the folder that holds them), or set data.source: hub "
            f"to sample the same splits from the Hugging Face hub")


def kshot_files(data_dir: str | Path, task: str, k: int, split_seed: int) -> dict[str, Path]:
    """The train/dev/test files of an LM-BFF k-shot split.

    Args:
        data_dir: The shared data directory (holding ``k-shot/``).
        task: A key of :data:`PROMPT_TASKS`.
        k: Shots per class (16; 512 for seed 42 where present).
        split_seed: The split's seed (13, 21, 42, 87, 100).

    Raises:
        ConfigError: For an unknown task.
        MissingFileError: If the task or split has no data under ``data_dir``.
    """
    spec = get_task(task)
    if spec.suffix == ".jsonl":  # one pooled file; the splits are drawn from it per seed (sample_pool_splits)
        pool = Path(data_dir).expanduser() / spec.folder
        if not pool.is_file():
            raise MissingFileError(_no_data(task, pool))
        return {"train": pool, "validation": pool, "test": pool}
    root = Path(data_dir).expanduser() / "k-shot" / spec.folder
    if not root.is_dir():
        raise MissingFileError(_no_data(task, root))
    split = root / f"{k}-{split_seed}"
    if not split.is_dir():
        have = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise MissingFileError(f"task {task!r} has no split {split.name!r}; available: {', '.join(have)} "
                               f"(data.source: hub samples any k and seed)")
    return {"train": split / f"train{spec.suffix}", "validation": split / f"{spec.dev_name}{spec.suffix}",
            "test": (split if spec.test_in_split else root) / f"{spec.test_name}{spec.suffix}"}


def split_rows(task: str, files: dict[str, Path], k: int, split_seed: int,
               max_test: int | None = None) -> dict[str, list[dict[str, str]]]:
    """The untokenized rows of each split, exactly as :class:`PromptClassificationData` uses them.

    Args:
        task: A key of :data:`PROMPT_TASKS`.
        files: :func:`kshot_files`' result for the split.
        k: Shots per class (a pooled task draws its splits with it).
        split_seed: The split's seed.
        max_test: Keep at most this many test rows, a fixed random subset (the same for every split seed).
    """
    spec = get_task(task)
    pooled = (sample_pool_splits(_read_rows(files["train"], spec), spec.labels, k, split_seed)
              if spec.suffix == ".jsonl" else None)
    out = {}
    for split, path in files.items():
        rows = pooled[split] if pooled is not None else _read_rows(path, spec)
        out[split] = cap_test(rows, max_test) if split == "test" else rows
    return out


def cap_test(rows: list[dict[str, str]], max_test: int | None) -> list[dict[str, str]]:
    """At most ``max_test`` test rows: a fixed random subset (seed 0), the same for every split seed and source.

    Args:
        rows: The test rows.
        max_test: The cap (``None``: keep all).
    """
    if max_test is None or len(rows) <= max_test:
        return rows
    return random.Random(0).sample(rows, max_test)
