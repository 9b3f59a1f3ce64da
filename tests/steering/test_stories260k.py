"""The llama2.c stories260K converter: the real model reproduces its documented greedy story."""

from __future__ import annotations

import struct

import pytest
import torch

from steering.stories260k import _interleaved_to_half_split, load_stories260k, read_llama2c_state_dict

LILY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_greedy_from_bos_reproduces_the_documented_story(data_dir):
    model, tokenizer = load_stories260k(data_dir)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 5
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    out = model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)
    assert out[0, 1:8].tolist() == [403, 407, 261, 378, 432, 383, 286]  # FORMAT_NOTES.py's first ids
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith(LILY)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "stories260K" / "tok512.model"))
    for text in ["She was very happy! Tom said: \"hi\"  ok\n\nThe end.", " lead", "é€ 123"]:
        assert tokenizer(text)["input_ids"] == [1] + sp.encode(text)
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(text))
    # Teacher-forced NLL of its own story is low (a real model, not noise).
    ids = tokenizer([LILY], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss < 1.0


def test_rope_permutation_turns_interleaved_pairs_into_halves():
    # One head of size 4, rows (re0, im0, re1, im1) -> (re0, re1, im0, im1).
    w = torch.arange(8.0).reshape(4, 2)
    assert _interleaved_to_half_split(w, 1)[:, 0].tolist() == [0.0, 4.0, 2.0, 6.0]


def test_truncated_checkpoint_is_rejected(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<7i", 8, 16, 1, 2, 2, 32, 16) + b"\0" * 100)
    with pytest.raises(ValueError, match="implies"):
        read_llama2c_state_dict(path)
