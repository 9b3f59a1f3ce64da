"""LM-BFF's k-shot splits, drawn from where the data lives: the Hugging Face hub's copies of GLUE, SNLI, SuperGLUE
and the sentence tasks, sampled exactly as princeton-nlp/LM-BFF's ``tools/generate_k_shot_data.py`` (and MeZO's
``k-shot-1k-test`` variant of it) samples its original files.

LM-BFF's procedure, per task and per seed (13, 21, 42, 87, 100; k = 16, and k = 512 for seed 42 in MeZO):

- ``np.random.seed(seed)`` then ``np.random.shuffle`` of the training rows (header excluded);
- the rows are grouped by label in order of first appearance; ``train`` is the first ``k`` of each group, group
  after group, and ``dev`` the next ``k``;
- ``test`` is the original dev set (GLUE, SNLI) or test set (the sentence tasks); MeZO keeps at most 1,000 of it:
  GLUE-style tasks ``np.random.seed(42)`` + shuffle + the first 1,000, the others
  ``DataFrame.sample(n=1000, random_state=42)`` (= ``RandomState(42).permutation(n)[:1000]``).

Two quirks of that script are reproduced because they change CoLA's files: CoLA's file has no header, so the script
shuffles the loaded list itself rather than a copy, and the shuffles of the five seeds compound in the order the
loop ran (``100, 13, 21, 42, 87``: its default ``--seed`` list, also for the k = 512 run); and CoLA's dev file ends
without a newline, so where its last line lands inside the kept 1,000 it swallows the line after it (999 rows).

The sampler takes rows (:func:`sample_kshot`, :func:`subsample_test`), so the same code runs on a local GLUE file
and on hub rows; :data:`HUB_SOURCES` says which hub copy stands for each LM-BFF task and how its rows map to the
LM-BFF files' columns and labels. Only a hub copy in the original files' row order gives LM-BFF's exact files.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from peftplug.data.kshot import cap_test, sample_pool_splits
from peftplug.data.prompt_tasks import PROMPT_TASKS, get_task
from peftplug.errors import ConfigError, DataError, MissingFileError

#: The seeds of LM-BFF's (and MeZO's) released splits.
LMBFF_SEEDS = (13, 21, 42, 87, 100)
#: The order LM-BFF's generation loop ran its seeds (its ``--seed`` default); CoLA's shuffles compound in it.
GENERATION_ORDER = (100, 13, 21, 42, 87)
#: MeZO's ``k-shot-1k-test``: at most this many test rows, drawn with this seed.
TEST_LIMIT, TEST_SEED = 1000, 42


def lmbff_permutation(n: int, seeds: Sequence[int]) -> np.ndarray:
    """Row order after LM-BFF's shuffles: ``np.random.seed(s); np.random.shuffle(rows)`` for each seed in turn.

    Legacy ``RandomState.shuffle`` makes the same swaps for a list and for an array, so shuffling ``arange(n)``
    gives the permutation LM-BFF applied to its list of lines.

    Args:
        n: Number of rows.
        seeds: The seeds, in the order their shuffles were applied (one seed for every task but CoLA).
    """
    order = np.arange(n)
    for seed in seeds:
        np.random.RandomState(seed).shuffle(order)
    return order


def shuffle_seeds(seed: int, compounding: bool) -> tuple[int, ...]:
    """The shuffles LM-BFF applied before sampling ``seed``: just ``seed``, or for CoLA every seed the loop ran up to
    it (a seed outside :data:`GENERATION_ORDER` gets its own shuffle only).

    Args:
        seed: The split's seed.
        compounding: Whether the task's shuffles compound (CoLA).
    """
    if compounding and seed in GENERATION_ORDER:
        return GENERATION_ORDER[: GENERATION_ORDER.index(seed) + 1]
    return (seed,)


def check_draw(k: int, seeds: Sequence[int]) -> None:
    """Refuses a draw numpy cannot make, in one line.

    Args:
        k: Rows per class.
        seeds: Split seeds.

    Raises:
        ConfigError: If ``k`` < 1 or a seed is outside numpy's ``[0, 2**32 - 1]``.
    """
    if k < 1:
        raise ConfigError(f"k must be >= 1; got {k}")
    bad = [s for s in seeds if not 0 <= s < 2 ** 32]
    if bad:  # numpy's RandomState refuses them with a traceback from inside its seeding
        raise ConfigError(f"split seed {bad[0]} is outside [0, 2**32 - 1]")


def sample_kshot(labels: Sequence[Hashable], k: int, seeds: Sequence[int]) -> tuple[list[int], list[int]]:
    """LM-BFF's balanced k-shot draw over rows given by their labels: shuffle, group by label in order of first
    appearance, ``train`` = the first ``k`` of each group and ``dev`` the next ``k``, group after group.

    Args:
        labels: Each training row's label as LM-BFF groups it (STS-B: ``score < 2.5``).
        k: Rows per class in train and in dev.
        seeds: :func:`shuffle_seeds`' result for the split.

    Returns:
        The indices into ``labels`` of the train rows and of the dev rows, in file order. A class with fewer than
        ``2 k`` rows gives what it has, as LM-BFF's slicing does (its ``cr/512-42`` and ``trec/512-42``).

    Raises:
        ConfigError: If ``k`` < 1 or a seed is outside numpy's ``[0, 2**32 - 1]``.
    """
    check_draw(k, seeds)
    groups: dict[Hashable, list[int]] = {}
    for index in lmbff_permutation(len(labels), seeds).tolist():
        groups.setdefault(labels[index], []).append(index)
    train = [i for members in groups.values() for i in members[:k]]
    dev = [i for members in groups.values() for i in members[k:2 * k]]
    return train, dev


def subsample_test(n: int, glue_style: bool, shuffles: int = 1, unterminated_last: bool = False) -> list[int]:
    """MeZO's test rows: all ``n`` if ``n`` <= 1,000, else 1,000 chosen with seed 42.

    Args:
        n: Rows of the original dev/test set.
        glue_style: ``np.random.seed(42)`` + shuffle + first 1,000 (GLUE, SNLI) rather than ``DataFrame.sample``.
        shuffles: How many seed-42 shuffles the list has had (CoLA: they compound over the seeds, see
            :func:`shuffle_seeds`).
        unterminated_last: The original file's last line has no newline (CoLA dev): it then swallows the line
            written after it, which is dropped here (its text, glued onto the last row in LM-BFF's file, is lost).

    Returns:
        Indices of the test rows, in file order.
    """
    if n <= TEST_LIMIT:
        return list(range(n))
    if not glue_style:
        return np.random.RandomState(TEST_SEED).permutation(n)[:TEST_LIMIT].tolist()
    order = lmbff_permutation(n, (TEST_SEED,) * shuffles)[:TEST_LIMIT].tolist()
    if unterminated_last and n - 1 in order[:-1]:
        del order[order.index(n - 1) + 1]
    return order


@dataclass(frozen=True)
class HubSource:
    """Where an LM-BFF task lives on the Hugging Face hub and how its rows map to LM-BFF's files.

    Args:
        path: Hub dataset id.
        name: Its configuration (``None``: the default).
        train: Hub split sampled for train/dev.
        tests: LM-BFF test file stem -> hub split (GLUE's dev sets; the sentence tasks' test sets).
        columns: LM-BFF file column (header name, or index for a headerless file) -> hub column.
        label_column: The hub's label column.
        labels: Hub label value -> LM-BFF's raw label (``None``: ``str(value)``).
        glue_style: A GLUE-style ``.tsv`` task (test subsampled by shuffle) rather than an LM-BFF ``.csv`` one.
        compounding: The task's shuffles compound across seeds (CoLA).
        unterminated_dev: The original dev file ends without a newline (CoLA).
        drop_labels: Hub label values of rows the original files do not have (SNLI's ``-1``, no gold label).
        note: What is known about this copy's rows against LM-BFF's originals.
        file_label: The label's column in LM-BFF's file (header name, or index for a headerless file).
        group: Maps a label to the class LM-BFF balances over (STS-B: ``score >= 2.5``; ``None``: the label).
    """

    path: str
    name: str | None
    train: str
    tests: dict[str, str]
    columns: dict[str | int, str]
    label_column: str = "label"
    labels: dict[int, str] | None = None
    glue_style: bool = True
    compounding: bool = False
    unterminated_dev: bool = False
    drop_labels: tuple[int, ...] = ()
    note: str = ""
    file_label: str | int = "label"
    group: Callable[[str], Hashable] | None = field(default=None, compare=False)


_NLI2 = {0: "entailment", 1: "not_entailment"}
_NLI3 = {0: "entailment", 1: "neutral", 2: "contradiction"}
_GLUE_ORDER = "GLUE's own files as the hub's glue loader read them, in their order (idx = line number)"
_SENTENCE = ("a common hub copy, not LM-BFF's own train/test cut: the same procedure, different rows (only the "
             "folder source gives LM-BFF's files)")



def _sentence_task(path: str, note: str, **kwargs) -> HubSource:
    """An LM-BFF ``.csv`` task (``label,sentence``) from a hub copy with ``text``/``label`` and train/test splits."""
    return HubSource(path, None, "train", {"test": "test"}, {1: "text"}, file_label=0, glue_style=False, note=note,
                     **kwargs)


#: LM-BFF task folder (``k-shot/<folder>``) -> its hub copy. MPQA has none that we could identify: folder only.
HUB_SOURCES: dict[str, HubSource] = {
    "SST-2": HubSource("nyu-mll/glue", "sst2", "train", {"test": "validation"}, {"sentence": "sentence"},
                       note=_GLUE_ORDER),
    "CoLA": HubSource("nyu-mll/glue", "cola", "train", {"test": "validation"}, {3: "sentence"},
                      file_label=1, compounding=True, unterminated_dev=True, note=_GLUE_ORDER),
    "MRPC": HubSource("nyu-mll/glue", "mrpc", "train", {"test": "validation"},
                      {"#1 String": "sentence1", "#2 String": "sentence2"}, file_label="Quality",
                      note="built by the hub loader from MSR's files with GLUE's dev ids; order believed GLUE's"),
    "QQP": HubSource("nyu-mll/glue", "qqp", "train", {"test": "validation"},
                     {"question1": "question1", "question2": "question2"}, file_label="is_duplicate",
                     note=_GLUE_ORDER),
    "STS-B": HubSource("nyu-mll/glue", "stsb", "train", {"test": "validation"},
                       {"sentence1": "sentence1", "sentence2": "sentence2"}, file_label="score",
                       note=_GLUE_ORDER, group=lambda score: float(score) >= 2.5),
    "QNLI": HubSource("nyu-mll/glue", "qnli", "train", {"test": "validation"},
                      {"question": "question", "sentence": "sentence"}, labels=_NLI2, note=_GLUE_ORDER),
    "RTE": HubSource("nyu-mll/glue", "rte", "train", {"test": "validation"},
                     {"sentence1": "sentence1", "sentence2": "sentence2"}, labels=_NLI2, note=_GLUE_ORDER),
    "MNLI": HubSource("nyu-mll/glue", "mnli", "train",
                      {"test_matched": "validation_matched", "test_mismatched": "validation_mismatched"},
                      {"sentence1": "premise", "sentence2": "hypothesis"}, labels=_NLI3, file_label="gold_label",
                      note=_GLUE_ORDER),
    "SNLI": HubSource("stanfordnlp/snli", None, "train", {"test": "validation"},
                      {"sentence1": "premise", "sentence2": "hypothesis"}, labels=_NLI3, drop_labels=(-1,),
                      file_label="gold_label",
                      note="SNLI 1.0 in its release order; GLUE's copy (LM-BFF's source) lacks the no-gold rows"),
    "sst-5": _sentence_task("SetFit/sst5", "SST-5 sentence level, 8,544/2,210 (LM-BFF's sizes); order unverified"),
    "mr": _sentence_task("cornell-movie-review-data/rotten_tomatoes", _SENTENCE),
    "cr": _sentence_task("SetFit/SentEval-CR", _SENTENCE),
    # SetFit's copy labels 0 objective, 1 subjective (its label_text); LM-BFF's files (SentEval's) the reverse.
    "subj": _sentence_task("SetFit/subj", "SUBJ 8,000/2,000 (LM-BFF's sizes); order unverified; the hub's 0 "
                           "objective / 1 subjective mapped to LM-BFF's 1 / 0", labels={0: "1", 1: "0"}),
    "trec": _sentence_task("CogComp/trec", "TREC 5,452/500; the hub's ABBR ENTY DESC HUM LOC NUM mapped to "
                           "LM-BFF's DESC ENTY ABBR HUM LOC NUM", label_column="coarse_label",
                           labels={0: "2", 1: "1", 2: "0", 3: "3", 4: "4", 5: "5"}),
    # Not an LM-BFF task: the catalogue's BoolQ draws its splits from SuperGLUE val (kshot.sample_pool_splits).
    "SuperGLUE/val/BoolQ/val.jsonl": HubSource("aps/super_glue", "boolq", "validation", {},
                                               {"passage": "passage", "question": "question"},
                                               labels={0: "false", 1: "true"}, note="SuperGLUE BoolQ val"),
}


def hub_source(task: str) -> HubSource:
    """The hub copy of a catalogue task (:data:`peftplug.data.prompt_tasks.PROMPT_TASKS`).

    Args:
        task: A catalogue task name.

    Raises:
        ConfigError: For an unknown task, or one with no hub copy.
    """
    spec = get_task(task)
    if spec.folder not in HUB_SOURCES:
        raise ConfigError(f"data.source: hub has no hub copy of task {spec.name!r}; use data.source: folder")
    return HUB_SOURCES[spec.folder]


def hub_records(dataset, source: HubSource, indices: Sequence[int] | None = None) -> list[dict]:
    """Rows of a hub split as LM-BFF file records: ``{file column: text, "label": LM-BFF's raw label}``.

    Args:
        dataset: A ``datasets.Dataset`` shaped like the hub's (the columns named in ``source``).
        source: Its :class:`HubSource`.
        indices: Rows to take, in this order (``None``: all).

    Raises:
        DataError: If a column is missing or a label has no LM-BFF counterpart.
    """
    want = [*source.columns.values(), source.label_column]
    absent = [c for c in want if c not in dataset.column_names]
    if absent:
        raise DataError(f"hub dataset {source.path!r} has no column {absent}; its columns are {dataset.column_names}")
    rows = dataset if indices is None else dataset.select(list(indices))
    out = []
    for row in rows:
        value = row[source.label_column]
        if source.labels is not None and value not in source.labels:
            raise DataError(f"hub dataset {source.path!r}: label {value!r} is not one of {sorted(source.labels)}")
        label = source.labels[value] if source.labels is not None else str(value)
        out.append({**{c: row[h] for c, h in source.columns.items()}, "label": label})
    return out


def label_values(dataset, source: HubSource) -> list:
    """The label column as a list, read in one piece through Arrow (a ``datasets`` column read item by item takes
    minutes on MNLI's 393k rows)."""
    return dataset.with_format("arrow")[source.label_column].to_pylist()


def kept_rows(dataset, source: HubSource) -> list[int]:
    """Indices of the rows LM-BFF's original files have (all but :attr:`HubSource.drop_labels`)."""
    if not source.drop_labels:
        return list(range(len(dataset)))
    return [i for i, v in enumerate(label_values(dataset, source)) if v not in source.drop_labels]


def sample_hub_split(train, tests: dict[str, object], source: HubSource, k: int,
                     seed: int) -> dict[str, list[dict]]:
    """LM-BFF's ``train``/``dev``/test files of one split, as records, from hub-shaped datasets.

    Args:
        train: The ``datasets.Dataset`` of :attr:`HubSource.train`.
        tests: LM-BFF test file stem -> its ``datasets.Dataset``.
        source: The task's :class:`HubSource`.
        k: Rows per class.
        seed: The split's seed.

    Returns:
        ``{"train": ..., "dev": ..., <test stem>: ...}``, each a list of records in file order.
    """
    keep = kept_rows(train, source)
    values = label_values(train, source)
    labels = [(source.group or (lambda v: v))(values[i]) for i in keep]
    seeds = shuffle_seeds(seed, source.compounding)
    train_idx, dev_idx = sample_kshot(labels, k, seeds)
    out = {"train": hub_records(train, source, [keep[i] for i in train_idx]),
           "dev": hub_records(train, source, [keep[i] for i in dev_idx])}
    for stem, dataset in tests.items():
        keep = kept_rows(dataset, source)
        order = subsample_test(len(keep), source.glue_style, len(seeds), source.unterminated_dev)
        out[stem] = hub_records(dataset, source, [keep[i] for i in order])
    return out


def load_hub(source: HubSource, split: str, task: str):
    """One hub split through ``datasets.load_dataset`` (its cache serves it offline once downloaded).

    Args:
        source: The task's :class:`HubSource`.
        split: The hub split.
        task: The task's name, for the error line.

    Raises:
        MissingFileError: If the hub cannot be reached and the split is not cached: one line naming both options.
    """
    import datasets  # a dependency, imported only when the hub is asked

    try:
        return datasets.load_dataset(source.path, source.name, split=split)
    except OSError as err:  # ConnectionError (offline / unreachable), DatasetNotFoundError, HTTP errors
        reason = " ".join(str(err).split())[:160]
        raise MissingFileError(
            f"task {task!r}: the hub copy {source.path}{f' ({source.name})' if source.name else ''} cannot be "
            f"loaded ({reason}); either load it once with network access (data.source: hub, it is cached), or use "
            f"data.source: folder with LM-BFF's k-shot files under data.data_dir (or $PEFTPLUG_DATA_DIR)"
        ) from None


def hub_split_rows(task: str, k: int, split_seed: int, max_test: int | None = None,
                   load: Callable[[HubSource, str, str], object] = load_hub) -> dict[str, list[dict[str, str]]]:
    """The rows of each split of a catalogue task from its hub copy, as :func:`peftplug.data.kshot.split_rows`
    gives them from the folder (same keys, same row dicts, same ``max_test`` subset rule).

    Args:
        task: A catalogue task name.
        k: Shots per class.
        split_seed: The split's seed.
        max_test: Keep at most this many test rows, a fixed random subset (as the folder source does).
        load: ``(source, split, task) -> datasets.Dataset``; the hub by default (tests pass local datasets).

    Raises:
        ConfigError: If the task has no hub copy.
        MissingFileError: If the hub cannot be reached (see :func:`load_hub`).
        DataError: If the hub rows do not fit the task (a missing column, a label outside the task's).
    """
    spec = get_task(task)
    source = hub_source(task)

    def to_rows(records: list[dict]) -> list[dict[str, str]]:
        bad = next((r["label"] for r in records if r["label"] not in spec.labels), None)
        if bad is not None:
            raise DataError(f"hub dataset {source.path!r}: label {bad!r} is not one of task {spec.name!r}'s "
                            f"{spec.labels}")
        return [{**{f: str(r[c]) for f, c in spec.fields.items()}, "label": r["label"]} for r in records]

    train = load(source, source.train, spec.name)
    if spec.suffix == ".jsonl":  # pooled task: the same draw as from the folder's pool file
        out = sample_pool_splits(to_rows(hub_records(train, source)), spec.labels, k, split_seed)
    else:
        stem = spec.test_name
        files = sample_hub_split(train, {stem: load(source, source.tests[stem], spec.name)}, source, k, split_seed)
        out = {"train": to_rows(files["train"]), "validation": to_rows(files["dev"]),
               "test": to_rows(files[stem])}
    out["test"] = cap_test(out["test"], max_test)
    return out


def _file_row(record: dict, source: HubSource, header: list) -> list[str]:
    """One record as a line's fields, in ``header`` order; GLUE's ``.tsv`` has no quoting, so tabs and newlines
    inside a text would break its rows."""
    fields = [str(record[c]) if c in record else "" for c in header]
    if source.glue_style and any(ch in f for f in fields for ch in "\t\r\n"):
        raise DataError(f"hub dataset {source.path!r}: a text holds a tab or newline, which a .tsv row cannot")
    return fields


def write_kshot_folder(folder: str, data_dir: str | Path, k: int = 16, seeds: Sequence[int] = LMBFF_SEEDS,
                       load: Callable[[HubSource, str, str], object] = load_hub) -> Path:
    """Writes one task's k-shot splits, sampled from its hub copy, in LM-BFF's folder layout (the layout that
    ``data.source: folder`` reads): ``k-shot/<folder>/<k>-<seed>/{train,dev}`` and ``k-shot/<folder>/test*``
    (CoLA: ``test`` in each seed folder, as it differs per seed); BoolQ's pool as ``SuperGLUE/val/BoolQ/val.jsonl``.

    The files carry the columns the catalogue reads (GLUE column names, header first; CoLA and the ``.csv`` tasks by
    position, without header), not every column of the original files.

    Args:
        folder: An LM-BFF task folder (a key of :data:`HUB_SOURCES`, e.g. ``SST-2``) or a catalogue task name.
        data_dir: The data folder to write under (use it as ``data.data_dir`` or ``$PEFTPLUG_DATA_DIR``).
        k: Rows per class.
        seeds: Split seeds.
        load: ``(source, split, task) -> datasets.Dataset``; the hub by default.

    Returns:
        The task's folder that was written.
    """
    import json

    if folder not in HUB_SOURCES:
        named = next((t.folder for n, t in PROMPT_TASKS.items() if folder in (n, t.folder)), None)
        if named not in HUB_SOURCES:
            raise ConfigError(f"task {folder!r} has no hub copy (those with one: {', '.join(HUB_SOURCES)}); its "
                              f"k-shot files come from LM-BFF's release only")
        folder = named
    check_draw(k, seeds)  # before the hub is read
    source, root = HUB_SOURCES[folder], Path(data_dir).expanduser()
    train = load(source, source.train, folder)
    if not source.tests:  # BoolQ: the pool itself, as the folder source keeps it
        path = root / folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in hub_records(train, source)), encoding="utf-8")
        return path
    tests = {stem: load(source, split, folder) for stem, split in source.tests.items()}
    header = [*source.columns, source.file_label]
    if not source.glue_style or isinstance(source.file_label, int):  # by position, no header row
        header = list(range(max(c for c in header if isinstance(c, int)) + 1))
    suffix, task_dir = (".tsv" if source.glue_style else ".csv"), root / "k-shot" / folder
    for seed in seeds:
        files = sample_hub_split(train, tests, source, k, seed)
        split_dir = task_dir / f"{k}-{seed}"
        split_dir.mkdir(parents=True, exist_ok=True)
        for stem, records in files.items():
            name = "dev_matched" if stem == "dev" and "test_matched" in files else stem
            where = split_dir if stem in ("train", "dev") or source.compounding else task_dir
            rows = [_file_row({**r, source.file_label: r["label"]}, source, header) for r in records]
            if isinstance(header[0], str):
                rows.insert(0, header)
            with (where / f"{name}{suffix}").open("w", encoding="utf-8", newline="") as handle:
                if source.glue_style:  # GLUE's .tsv: fields joined by tabs, no quoting (what its reader expects)
                    handle.writelines("\t".join(row) + "\n" for row in rows)
                else:  # LM-BFF's .csv: pandas' to_csv quoting, which csv's default dialect matches
                    csv.writer(handle, lineterminator="\n").writerows(rows)
    return task_dir

