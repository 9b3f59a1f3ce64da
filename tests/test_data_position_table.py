"""Rows longer than the model's learned position table (BERT's, GPT-2's) are one line naming ``data.max_length``
and the limit (virtual prompt tokens counted), instead of torch's ``IndexError: index out of range in self`` at the
first long batch; rotary models and rows that fit are not refused."""

from __future__ import annotations

import json

import lightning as L
import pytest

from peftplug.data import TextClassificationData
from peftplug.errors import DataError
from peftplug.lightning import PeftModule


def _fit(tmp_path, model, text_length, peft=None):
    rows = [{"text": "ab" * (text_length // 2), "label": i % 2} for i in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    module = PeftModule(model, task="seq_cls", num_labels=2, peft=peft)
    data = TextClassificationData(train_file=str(path), validation_file=str(path), batch_size=2, max_length=1024)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.parametrize("model", ["tiny:bert", "tiny:gpt2"])
def test_rows_beyond_the_position_table_are_one_line(tmp_path, model):
    # The tiny models hold 256 positions; the char tokenizer gives a token per character.
    with pytest.raises(DataError, match=r"the train split has rows of \d+ tokens, but the model's learned position "
                                        r"table \(.*\) holds 256 positions: set data.max_length to 256 or less"):
        _fit(tmp_path, model, 300)


def test_virtual_tokens_count(tmp_path):
    prompt = {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 8}
    with pytest.raises(DataError, match=r"rows of \d+ tokens \+ 8 virtual, .* set data.max_length to 248 or less"):
        _fit(tmp_path, "tiny:bert", 250, peft=prompt)


@pytest.mark.parametrize("model, length", [("tiny:bert", 200), ("tiny:llama", 300)])
def test_rows_that_fit_or_rotary_models_train(tmp_path, model, length):
    assert _fit(tmp_path, model, length).global_step == 1
