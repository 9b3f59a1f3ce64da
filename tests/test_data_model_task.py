"""A classification data module under a model of another task is refused in one line when the trainer sets it up:
``TextClassificationData`` under a causal LM stopped with a batch-size ``ValueError`` from the loss, and
``PromptClassificationData`` under a ``seq_cls`` model trained the head on the template text, ignoring the label
words, without a word."""

from __future__ import annotations

import json

import lightning as L
import pytest

from peftplug.data import PromptClassificationData, TextClassificationData
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule

ROWS = 8


def _files(root):
    (root / "cls.jsonl").write_text("\n".join(json.dumps({"text": f"film {i}", "label": i % 2}) for i in range(ROWS)))
    sst = root / "k-shot" / "SST-2"
    (sst / "16-42").mkdir(parents=True)
    rows = ["sentence\tlabel"] + [f"{'good' if i % 2 else 'bad'} movie {i}\t{i % 2}" for i in range(ROWS)]
    for name in ("16-42/train.tsv", "16-42/dev.tsv", "test.tsv"):
        (sst / name).write_text("\n".join(rows) + "\n")


def _data(kind, root):
    if kind == "text":
        return TextClassificationData(train_file=str(root / "cls.jsonl"), validation_file=str(root / "cls.jsonl"),
                                      batch_size=2)
    return PromptClassificationData("sst2", data_dir=str(root), template="{sentence}={answer}",
                                    label_words=["n", "p"], batch_size=2)


def _fit(module, data, root):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=str(root))
    trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("kind, task, served", [("text", "causal_lm", "seq_cls"), ("text", "prompt_cls", "seq_cls"),
                                                ("prompt", "seq_cls", "prompt_cls"),
                                                ("prompt", "causal_lm", "prompt_cls")])
def test_rows_of_another_task_are_one_line(tmp_path, kind, task, served):
    _files(tmp_path)
    module = PeftModule("tiny:llama", task=task, num_labels=2 if task == "seq_cls" else None,
                        peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]})
    with pytest.raises(ConfigError, match=rf"serves model.task '{served}', but model.task is '{task}': set "
                                          rf"model.task: {served}, or "):
        _fit(module, _data(kind, tmp_path), tmp_path)


@pytest.mark.parametrize("kind, task", [("text", "seq_cls"), ("prompt", "prompt_cls")])
def test_rows_of_the_models_task_train(tmp_path, kind, task):
    _files(tmp_path)
    module = PeftModule("tiny:llama", task=task, num_labels=2 if task == "seq_cls" else None,
                        peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]})
    _fit(module, _data(kind, tmp_path), tmp_path)
    assert module.trainer.global_step == 1
