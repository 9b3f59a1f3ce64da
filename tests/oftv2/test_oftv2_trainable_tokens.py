"""OFTv2 with PEFT's trainable tokens (``trainable_token_indices``): ``merge_and_unload`` and ``unload`` hand back a
plain model computing what the adapted one did (merged) or the base (unloaded), as LoRA's do."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft.utils import TrainableTokensWrapper

import oftv2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _adapted(tiny_model):
    base = tiny_model("llama")
    model = peft.get_peft_model(copy.deepcopy(base), oftv2.OFTv2Config(
        block_size=8, target_modules=["q_proj", "v_proj"], trainable_token_indices=[5, 6, 40]))
    randomize_q(model, std=0.05)
    with torch.no_grad():  # trained token rows: the merged embedding must carry them
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    return base.eval(), model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_merge_and_unload_equals_the_unmerged_model(tiny_model, tokens):
    tokens = tokens.clone()
    tokens[:, :3] = torch.tensor([5, 6, 40])  # the trained tokens take part
    base, model = _adapted(tiny_model)
    expected = _logits(model, tokens)
    assert (expected - _logits(base, tokens)).abs().max() > 1e-3  # the adapter and the tokens do something
    merged = model.merge_and_unload()
    assert not any(isinstance(m, (oftv2.OFTv2Layer, TrainableTokensWrapper)) for m in merged.modules())
    assert type(merged.get_input_embeddings()) is torch.nn.Embedding
    torch.testing.assert_close(_logits(merged, tokens), expected, rtol=1e-5, atol=1e-5)


def test_unload_gives_back_the_base_model(tiny_model, tokens):
    tokens = tokens.clone()
    tokens[:, :3] = torch.tensor([5, 6, 40])
    base, model = _adapted(tiny_model)
    unloaded = model.unload()
    assert not any(isinstance(m, (oftv2.OFTv2Layer, TrainableTokensWrapper)) for m in unloaded.modules())
    assert isinstance(unloaded.get_input_embeddings().weight, torch.nn.Parameter)
    torch.testing.assert_close(_logits(unloaded, tokens), _logits(base, tokens), rtol=0, atol=0)
