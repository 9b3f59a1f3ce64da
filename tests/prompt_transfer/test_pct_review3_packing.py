"""Packed rows marked only by restarting position ids (transformers' ``DataCollatorWithFlattening()`` with its
defaults: no ``cu_seq_lens_q``/``seq_idx``) are refused for a PCT prompt, as TRL's packing is; padded rows are not."""

from __future__ import annotations

import peft
import pytest
import torch
from pct_testing import pct_model_on_saved_decomposition
from transformers import DataCollatorWithFlattening

from peftplug.tiny import tiny_model


@pytest.fixture
def pct_model(tmp_path):
    return pct_model_on_saved_decomposition(tiny_model, str(tmp_path / "dec"), torch.Generator().manual_seed(1))


def test_a_flattened_batch_with_default_collator_is_refused(pct_model):
    batch = DataCollatorWithFlattening()([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}])
    assert "cu_seq_lens_q" not in batch and batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    with pytest.raises(ValueError, match=r"PCT prompt cannot train on packed .*DataCollatorWithFlattening"):
        pct_model(**{k: torch.as_tensor(v) for k, v in batch.items()})


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_with_hf_position_ids_are_accepted_and_unchanged(pct_model, side):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]) if side == "right" else torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers' generate computes them
    assert bool((positions[:, 1:] <= positions[:, :-1]).any())  # a restart, but only next to padding
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        with_positions = pct_model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
        without = pct_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(with_positions) and torch.equal(with_positions, without)


def test_a_lora_model_takes_the_same_flattened_batch(pct_model):
    # The refusal is the prompt's: other adapters use the position ids, so a flattened batch is right for them.
    batch = DataCollatorWithFlattening()([{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}])
    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"]))
    out = lora(**{k: torch.as_tensor(v) for k, v in batch.items()})
    assert torch.isfinite(out.loss)
