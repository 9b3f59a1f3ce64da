"""Third review of OFTv2 layers: ``merge_drift`` on a float (not quantized) base must leave the model as it found it.

A bf16 merge/unmerge round trip rounds the base weights (up to one bf16 ulp per entry); ``merge_drift`` promised to
leave the model unchanged but restored only bitsandbytes weights, so measuring a bf16 model moved its weights and its
outputs for good.
"""

from __future__ import annotations

import copy

import peft
import torch

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from oftv2.drift import merge_drift


def test_merge_drift_leaves_a_bf16_model_bit_identical(tiny_model, tokens):
    torch.manual_seed(0)
    base = tiny_model("llama", tie_word_embeddings=True).to(torch.bfloat16)
    model = peft.get_peft_model(copy.deepcopy(base), OFTv2Config(
        block_size=8, target_modules=["q_proj", "v_proj", "embed_tokens"], init_weights=False))
    model.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(tokens).logits
    report = merge_drift(model, {"input_ids": tokens})
    # The round trip itself does round in bf16 (what the report measures), so restoring is not a no-op here.
    assert report["unmerged_vs_adapter"] > 0
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    shared = model.base_model.model.lm_head.weight
    assert shared is model.base_model.model.model.embed_tokens.get_base_layer().weight  # the tie survives
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, logits)
    assert not model.training and not any(getattr(m, "merged", False) for m in model.modules())
