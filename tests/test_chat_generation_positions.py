"""Chat validation generates every answer after its prompt: with a learned position table (GPT-2's), prompts that
leave no room for ``model.max_new_tokens`` are refused in one line naming both settings and the values that fit,
before training starts, instead of ``IndexError: index out of range in self`` from ``generate`` at the first
validation. Each suggested value is checked by running it."""

from __future__ import annotations

import json
import re

import lightning as L
import pytest

from peftplug.data import ChatData
from peftplug.errors import DataError
from peftplug.lightning import PeftModule

LORA = {"peft_type": "LORA", "target_modules": ["c_attn"], "r": 2}


def _fit(tmp_path, max_new_tokens=100, max_length=256, limit_val_batches=1.0, trainers=None):
    """One epoch of 2 batches on the tiny GPT-2 (256 positions, a token per character), validating at its end;
    the trainer is appended to ``trainers`` before it runs."""
    tmp_path.mkdir(exist_ok=True)
    rows = [{"prompt": "x" * 200, "response": "yes"} for _ in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    module = PeftModule("tiny:gpt2", task="causal_lm", peft=LORA, max_new_tokens=max_new_tokens)
    data = ChatData(train_file=str(path), validation_file=str(path), batch_size=2, max_length=max_length)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=limit_val_batches, default_root_dir=str(tmp_path))
    if trainers is not None:
        trainers.append(trainer)
    trainer.fit(module, datamodule=data)
    return trainer


def test_prompts_without_room_to_answer_are_refused_before_training(tmp_path):
    trainers = []
    with pytest.raises(DataError) as refused:
        _fit(tmp_path, trainers=trainers)
    assert trainers[0].global_step == 0
    message = str(refused.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"the validation split has prompts of (\d+) tokens and evaluation generates model.max_new_tokens=100 after "
        r"each, but the model's learned position table \(.*wpe\) holds 256 positions: lower data.max_length to 156 "
        r"or model.max_new_tokens to (\d+)", message), message


@pytest.mark.parametrize("setting", ["max_new_tokens", "max_length"])
def test_the_suggested_values_validate(tmp_path, setting):
    with pytest.raises(DataError) as refused:
        _fit(tmp_path / "refused")
    suggested = {k: int(v) for k, v in re.findall(r"(?:data|model)\.(\w+) to (\d+)", str(refused.value))}
    trainer = _fit(tmp_path / "fits", **{setting: suggested[setting]})
    # Validation ran and generated: the answer accuracy is logged beside the loss.
    assert trainer.global_step == 2 and {"val_loss", "val_acc"} <= set(trainer.callback_metrics)


def test_a_run_that_never_validates_is_not_refused(tmp_path):
    assert _fit(tmp_path, limit_val_batches=0).global_step == 2
