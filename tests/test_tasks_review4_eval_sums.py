"""Fourth review of the non-causal-LM tasks: an evaluation loop that stopped with an exception (an out-of-memory
batch, a Ctrl-C in a notebook) must not leave its partial sums to the next run of that loop.

The reference is the split's loss and accuracy computed here row by row from the module's own logits."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from peftplug.data import TextClassificationData
from peftplug.lightning import PeftModule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = [{"text": f"item {i} " + "x" * (i % 5), "label": "abc"[i % 3]} for i in range(12)]


class _FailsOnce(TextClassificationData):
    """Raises while collating the third batch of 4 (rows 8-11) of the evaluation split, until ``fail`` is cleared."""

    fail = True

    def collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().collate(features)
        if self.fail and features[0] is self.splits[self.failing_split][8]:
            raise RuntimeError("out of memory (simulated)")
        return batch


def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_an_evaluation_retried_after_an_exception_counts_each_row_once(tmp_path, stage):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    torch.manual_seed(0)
    module = PeftModule("tiny:llama", task="seq_cls", num_labels=3,
                        peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]})
    data = _FailsOnce(train_file=str(path), validation_file=str(path), test_file=str(path), batch_size=4)
    data.failing_split = "validation" if stage == "validate" else "test"
    with pytest.raises(RuntimeError, match="simulated"):  # after two of the three batches were summed
        getattr(_trainer(tmp_path), stage)(module, datamodule=data, verbose=False)
    data.fail = False
    metrics = getattr(_trainer(tmp_path), stage)(module, datamodule=data, verbose=False)[0]

    rows = data.splits[data.failing_split]
    module.eval()
    with torch.no_grad():
        logits = torch.cat([module(**data.collate([row])).logits for row in rows])
    labels = torch.tensor([row["labels"] for row in rows])
    prefix = "val" if stage == "validate" else "test"
    # Before the fix the retry also counted the 8 rows of the failed run: 20 rows, accuracy and loss off.
    assert metrics[f"{prefix}_acc"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    assert metrics[f"{prefix}_loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)
