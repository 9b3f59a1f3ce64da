"""LM-BFF's k-shot sampling (peftplug.data.lmbff) against LM-BFF's released files in the shared data (GLUE sources
rebuilt from the local copies), the hub-row adapter on locally built ``datasets.Dataset`` objects shaped like the
hub's, the LM-BFF-layout writer, and the one-line errors of a missing folder and an unreachable hub."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from datasets import Dataset

from peftplug.data.kshot import _read_rows, kshot_files, split_rows
from peftplug.data.lmbff import (
    GENERATION_ORDER,
    HUB_SOURCES,
    LMBFF_SEEDS,
    hub_split_rows,
    lmbff_permutation,
    load_hub,
    sample_hub_split,
    sample_kshot,
    shuffle_seeds,
    subsample_test,
    write_kshot_folder,
)
from peftplug.data.prompt_cls import PromptClassificationData
from peftplug.data.prompt_tasks import get_task
from peftplug.errors import ConfigError, DataError, MissingFileError

SPLITS = [(16, s) for s in LMBFF_SEEDS] + [(512, 42)]


def _lines(path):
    with open(path, encoding="utf-8", newline="") as handle:
        return handle.readlines()


def _rte_train_lines(data_dir):
    """GLUE RTE train in GLUE's order: the two local parts hold all 2,490 rows with GLUE's index column."""
    header, *rows = _lines(data_dir / "RTE" / "train_split.tsv")
    rows += _lines(data_dir / "RTE" / "val_split.tsv")  # this part has no header
    rows.sort(key=lambda line: int(line.split("\t")[0]))
    assert [int(r.split("\t")[0]) for r in rows] == list(range(2490))
    return header, rows


def _loader(datasets_by_split):
    """A ``load`` for hub_split_rows / write_kshot_folder that serves local datasets instead of the hub."""
    return lambda source, split, task: datasets_by_split[split]


def _hub_rte(data_dir):
    """Local GLUE RTE shaped like ``nyu-mll/glue``'s ``rte``: sentence1, sentence2, label (0 = entailment), idx."""
    def table(lines):
        cells = [line.rstrip("\n").split("\t") for line in lines]
        return Dataset.from_dict({"sentence1": [c[1] for c in cells], "sentence2": [c[2] for c in cells],
                                  "label": [("entailment", "not_entailment").index(c[3]) for c in cells],
                                  "idx": [int(c[0]) for c in cells]})
    _, train = _rte_train_lines(data_dir)
    return {"train": table(train), "validation": table(_lines(data_dir / "RTE" / "glue_dev.tsv")[1:])}


# --- the sampler itself, against numpy / pandas as LM-BFF calls them -------------------------------------------


def test_permutation_is_lmbffs_shuffle_of_a_list_even_when_seeds_compound():
    lines = [f"row {i}\n" for i in range(97)]
    for seeds in [(42,), (100, 13, 21)]:
        expected = list(lines)
        for seed in seeds:  # exactly what LM-BFF runs: global seed, then shuffle of the Python list
            np.random.seed(seed)
            np.random.shuffle(expected)
        assert [lines[i] for i in lmbff_permutation(len(lines), seeds)] == expected
    assert shuffle_seeds(21, compounding=True) == (100, 13, 21)
    assert shuffle_seeds(21, compounding=False) == (21,) and shuffle_seeds(7, compounding=True) == (7,)


def test_sample_kshot_groups_by_first_appearance_and_takes_k_then_k():
    labels = ["b", "a", "c"] * 10 + ["a"] * 5
    train, dev = sample_kshot(labels, 3, (13,))
    order = lmbff_permutation(len(labels), (13,)).tolist()
    first_seen = list(dict.fromkeys(labels[i] for i in order))
    assert [labels[i] for i in train] == [x for x in first_seen for _ in range(3)]
    for label in first_seen:  # per class: the first 3 in shuffled order go to train, the next 3 to dev
        members = [i for i in order if labels[i] == label]
        assert [i for i in train if labels[i] == label] == members[:3]
        assert [i for i in dev if labels[i] == label] == members[3:6]
    # A class short of 2k rows gives what it has (LM-BFF's cr/512-42), it is not an error.
    train, dev = sample_kshot(["x"] * 5 + ["y"] * 40, 4, (42,))
    assert sorted(map(len, ([i for i in dev if i < 5], [i for i in dev if i >= 5]))) == [1, 4]
    with pytest.raises(ConfigError, match="k must be >= 1; got 0"):
        sample_kshot(labels, 0, (42,))


def test_test_subsample_is_meZOs():
    frame = pd.DataFrame({"x": range(2210)})
    assert subsample_test(2210, glue_style=False) == frame.sample(n=1000, random_state=42).index.tolist()
    lines = list(range(5463))
    np.random.seed(42)
    np.random.shuffle(lines)
    assert subsample_test(5463, glue_style=True) == lines[:1000]
    assert subsample_test(872, glue_style=True) == list(range(872))  # small dev sets are kept whole
    # CoLA: the unterminated last line swallows the next one, which is dropped.
    order = subsample_test(1043, glue_style=True, shuffles=3)
    merged = subsample_test(1043, glue_style=True, shuffles=3, unterminated_last=True)
    p = order.index(1042)
    assert merged == order[:p + 1] + order[p + 2:] and len(merged) == 999


# --- LM-BFF's released files, rebuilt from the local GLUE copies -------------------------------------------------


def test_rte_splits_are_reproduced_exactly(data_dir):
    header, rows = _rte_train_lines(data_dir)
    labels = [line.rstrip("\n").split("\t")[-1] for line in rows]
    for k, seed in SPLITS:
        train, dev = sample_kshot(labels, k, shuffle_seeds(seed, compounding=False))
        split = data_dir / "k-shot" / "RTE" / f"{k}-{seed}"
        assert _lines(split / "train.tsv") == [header] + [rows[i] for i in train], (k, seed)
        assert _lines(split / "dev.tsv") == [header] + [rows[i] for i in dev], (k, seed)


def test_cola_test_files_are_reproduced_exactly_with_compounding_shuffles(data_dir):
    dev = _lines(data_dir / "CoLA" / "glue_dev.tsv")
    assert not dev[-1].endswith("\n")  # the quirk the 999-row files come from
    for k, seed in SPLITS:
        shuffles = len(shuffle_seeds(seed, compounding=True))  # 512-42 too: that run looped over all five seeds
        order = lmbff_permutation(len(dev), (42,) * shuffles)[:1000]
        text = (data_dir / "k-shot" / "CoLA" / f"{k}-{seed}" / "test.tsv").read_text(encoding="utf-8")
        assert "".join(dev[i] for i in order) == text, (k, seed)
    # A single shuffle, as the seed alone would give, does not reproduce seed 13's file: the compounding matters.
    single = "".join(dev[i] for i in lmbff_permutation(len(dev), (42,))[:1000])
    assert single != (data_dir / "k-shot" / "CoLA" / "16-13" / "test.tsv").read_text(encoding="utf-8")


@pytest.mark.parametrize("task, parts, label_of", [
    ("SST-2", ["train_subset_6735.tsv", "train_subset_60614.tsv"], lambda c: c[-1]),
    ("CoLA", ["train_split.tsv", "val_split.tsv"], lambda c: c[1]),
])
def test_shuffled_local_copies_hold_the_same_rows_but_not_the_order(data_dir, task, parts, label_of):
    """The local SST-2 and CoLA train copies are re-ordered (SST-2 split at random in two, CoLA cut into train/val),
    so LM-BFF's draw cannot be replayed on them; what holds: every released k-shot row is a GLUE train row, with
    k per class in train and in dev, and our sampler gives the same shape on the local rows."""
    rows = []
    for name in parts:
        lines = _lines(data_dir / task / name)
        rows += lines[1:] if task == "SST-2" else lines
    pool = set(rows)
    labels = [label_of(line.rstrip("\n").split("\t")) for line in rows]
    for k, seed in SPLITS:
        split = data_dir / "k-shot" / task / f"{k}-{seed}"
        released = {s: _lines(split / f"{s}.tsv")[1 if task == "SST-2" else 0:] for s in ("train", "dev")}
        ours = sample_kshot(labels, k, shuffle_seeds(seed, compounding=task == "CoLA"))
        for (name, lines), picked in zip(released.items(), ours):
            assert all(line in pool for line in lines), (task, k, seed, name)
            counts = sorted(pd.Series([label_of(x.rstrip("\n").split("\t")) for x in lines]).value_counts())
            assert counts == [k, k] == sorted(pd.Series([labels[i] for i in picked]).value_counts())
        assert not set(released["train"]) & set(released["dev"])
    assert _lines(data_dir / "k-shot" / "SST-2" / "test.tsv") == _lines(data_dir / "SST-2" / "glue_dev.tsv")


# --- the hub-row adapter, on local datasets shaped like the hub's ----------------------------------------------


def test_hub_rows_of_rte_equal_the_released_folder_rows(data_dir):
    load = _loader(_hub_rte(data_dir))
    for k, seed in SPLITS:
        folder = split_rows("rte", kshot_files(data_dir, "rte", k, seed), k, seed)
        assert hub_split_rows("rte", k, seed, load=load) == folder, (k, seed)
    capped = hub_split_rows("rte", 16, 42, max_test=50, load=load)["test"]
    assert capped == split_rows("rte", kshot_files(data_dir, "rte", 16, 42), 16, 42, max_test=50)["test"]


def test_hub_rows_of_cola_test_equal_the_released_rows_but_the_glued_one(data_dir):
    cells = [line.rstrip("\n").split("\t") for line in _lines(data_dir / "CoLA" / "glue_dev.tsv")]
    hub_dev = Dataset.from_dict({"sentence": [c[3] for c in cells], "label": [int(c[1]) for c in cells],
                                 "idx": list(range(len(cells)))})
    source, cola = HUB_SOURCES["CoLA"], get_task("cola")
    hub_train = Dataset.from_dict({"sentence": ["a", "b", "c", "d"], "label": [0, 1, 0, 1], "idx": [0, 1, 2, 3]})
    last = cells[-1][3]
    for seed in GENERATION_ORDER:
        ours = sample_hub_split(hub_train, {"test": hub_dev}, source, 1, seed)["test"]
        released = _read_rows(data_dir / "k-shot" / "CoLA" / f"16-{seed}" / "test.tsv", cola)
        assert len(ours) == len(released) == 999
        differ = [(o[3], r["sentence"]) for o, r in zip(ours, released) if (o[3], o["label"]) != (r["sentence"],
                                                                                              r["label"])]
        # The one row LM-BFF glued: the dev set's last sentence + the next line's source code ("gj04" etc.).
        assert len(differ) == 1 and differ[0][0] == last and differ[0][1].startswith(last), seed


def _tiny_hub(n=60, labels=(0, 1), text="text", seed=0):
    rng = np.random.default_rng(seed)
    return Dataset.from_dict({text: [f'row {i}, with "quotes"' for i in range(n)],
                              "label": rng.choice(labels, n).tolist()})


def test_writer_round_trips_through_the_folder_source(tmp_path):
    # A GLUE-style task (header tsv), a csv task (quoted commas), TREC's relabelled classes and the BoolQ pool.
    sst2 = {"train": _tiny_hub(80).rename_column("text", "sentence"),
            "validation": _tiny_hub(20, seed=1).rename_column("text", "sentence")}
    cr = {"train": _tiny_hub(70), "test": _tiny_hub(30, seed=2)}
    trec = {s: d.rename_column("label", "coarse_label") for s, d in
            {"train": _tiny_hub(200, tuple(range(6))), "test": _tiny_hub(40, tuple(range(6)), seed=3)}.items()}
    boolq = {"validation": Dataset.from_dict({"passage": [f"p{i}" for i in range(40)],
                                              "question": [f"q{i}" for i in range(40)],
                                              "label": [i % 2 for i in range(40)], "idx": list(range(40))})}
    for task, hub in [("sst2", sst2), ("cr", cr), ("trec", trec), ("boolq", boolq)]:
        k = 4
        write_kshot_folder(task, tmp_path, k=k, seeds=(13, 42), load=_loader(hub))
        for seed in (13, 42):
            from_folder = split_rows(task, kshot_files(tmp_path, task, k, seed), k, seed)
            assert from_folder == hub_split_rows(task, k, seed, load=_loader(hub)), (task, seed)
    # TREC: hub class 0 (ABBR) is LM-BFF's label 2.
    rows = hub_split_rows("trec", 4, 42, load=_loader(trec))["train"]
    texts = dict(zip(trec["train"]["text"], trec["train"]["coarse_label"]))
    assert all({0: "2", 1: "1", 2: "0"}.get(texts[r["sentence"]], str(texts[r["sentence"]])) == r["label"]
               for r in rows)


def test_written_rte_folder_equals_the_released_files(data_dir, tmp_path):
    write_kshot_folder("RTE", tmp_path, k=16, seeds=LMBFF_SEEDS, load=_loader(_hub_rte(data_dir)))
    for seed in LMBFF_SEEDS:
        ours = split_rows("rte", kshot_files(tmp_path, "rte", 16, seed), 16, seed)
        assert ours == split_rows("rte", kshot_files(data_dir, "rte", 16, seed), 16, seed)


def test_hub_rows_that_do_not_fit_are_one_line_errors():
    with pytest.raises(DataError, match="has no column \\['sentence'\\]"):
        hub_split_rows("sst2", 2, 42, load=_loader({"train": _tiny_hub(), "validation": _tiny_hub()}))
    bad = _tiny_hub(labels=(0, 1, 2)).rename_column("text", "sentence")
    with pytest.raises(DataError, match="label '2' is not one of task 'sst2'"):
        hub_split_rows("sst2", 2, 42, load=_loader({"train": bad, "validation": bad}))
    with pytest.raises(DataError, match="label 7 is not one of \\[0, 1\\]"):
        rte = Dataset.from_dict({"sentence1": ["a"], "sentence2": ["b"], "label": [7]})
        hub_split_rows("rte", 1, 42, load=_loader({"train": rte, "validation": rte}))


# --- the data module's source option and its error lines ---------------------------------------------------------


def _offline_and_uncached(monkeypatch, tmp_path):
    """The hub unreachable (what HF_DATASETS_OFFLINE=1 sets) and empty caches, whatever this machine has cached."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))



def test_missing_folder_and_unreachable_hub_each_name_both_options(tmp_path, monkeypatch):
    with pytest.raises(MissingFileError) as err:
        PromptClassificationData("sst2", data_dir=str(tmp_path))
    line = str(err.value)
    assert "\n" not in line and str(tmp_path / "k-shot" / "SST-2") in line
    assert "data.data_dir" in line and "$PEFTPLUG_DATA_DIR" in line and "data.source: hub" in line
    _offline_and_uncached(monkeypatch, tmp_path)
    with pytest.raises(MissingFileError) as err:
        load_hub(HUB_SOURCES["SST-2"], "train", "sst2")
    line = str(err.value)
    assert "\n" not in line and "nyu-mll/glue (sst2)" in line
    assert "data.source: folder" in line and "$PEFTPLUG_DATA_DIR" in line and "data.source: hub" in line
    dm = PromptClassificationData("sst2", source="hub", template="{sentence}={answer}", label_words=["n", "p"])
    with pytest.raises(MissingFileError, match="cannot be loaded"):
        dm.setup()  # before any tokenizer is asked for


def test_source_option_checks():
    with pytest.raises(ConfigError, match="data.source must be one of folder, hub; got 'web'"):
        PromptClassificationData("sst2", source="web")
    assert all(get_task(t).folder in HUB_SOURCES for t in ("sst2", "rte", "cola", "mnli", "boolq", "trec"))
    assert "mpqa" not in HUB_SOURCES  # no hub copy identified: folder only


def test_folder_writer_command_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    from peftplug.data.lmbff_cli import main

    _offline_and_uncached(monkeypatch, tmp_path)
    assert main(["RTE", "--data-dir", str(tmp_path)]) == 2
    assert main(["mpqa", "--data-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "nyu-mll/glue (rte) cannot be loaded" in lines[0]
    assert "task 'mpqa' has no hub copy" in lines[1] and not (tmp_path / "k-shot").exists()


def test_snli_rows_without_gold_label_are_left_out_before_sampling():
    rng = np.random.default_rng(5)
    labels = rng.integers(-1, 3, 300).tolist()
    snli = Dataset.from_dict({"premise": [f"p{i}" for i in range(300)], "hypothesis": [f"h{i}" for i in range(300)],
                              "label": labels})
    gold = snli.filter(lambda row: row["label"] != -1)
    source = HUB_SOURCES["SNLI"]
    got = sample_hub_split(snli, {"test": snli}, source, 8, 21)
    # Reference: the same draw on the rows GLUE's SNLI file has, indexed from scratch.
    train_idx, dev_idx = sample_kshot(gold["label"], 8, (21,))
    names = ("entailment", "neutral", "contradiction")
    assert [r["sentence1"] for r in got["train"]] == [gold[i]["premise"] for i in train_idx]
    assert [r["label"] for r in got["dev"]] == [names[gold[i]["label"]] for i in dev_idx]
    assert len(got["test"]) == len(gold) and "-1" not in {r["label"] for r in got["test"]}
