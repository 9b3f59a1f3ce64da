"""QOFT through the Lightning module: ``quantization="nf4"`` + an OFTv2 config trains end to end on CPU (on the GPU
with PEFTPLUG_KERNELS_ON_GPU=1)."""

from __future__ import annotations

import pytest
import torch

from oftv2 import bnb as qoft

pytestmark = pytest.mark.filterwarnings("ignore")

L = pytest.importorskip("lightning")


class _Batches(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        row = self.ids[i % len(self.ids)]
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row}


def test_lightning_nf4_oftv2_trains(tiny_checkpoint, device, tmp_path):
    from peftplug.lightning import PeftModule
    from peftplug.tiny import char_tokenizer

    char_tokenizer().save_pretrained(tiny_checkpoint)
    module = PeftModule(str(tiny_checkpoint), quantization="nf4",
                        peft={"peft_type": "OFTV2", "block_size": 16, "target_modules": "all-linear"})
    assert sum(isinstance(m, qoft.Linear4bit) for m in module.model.modules()) == 14
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    ids = torch.randint(4, 90, (4, 16), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(max_steps=2, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(_Batches(ids), batch_size=4))
    after = dict(module.named_parameters())
    # Lightning moved the model to `device`; `before` was taken on the CPU.
    assert before and all(not torch.equal(before[n], after[n].detach().cpu()) for n in before)
