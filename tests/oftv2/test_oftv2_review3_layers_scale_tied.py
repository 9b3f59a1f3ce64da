"""diffusers' LoRA-scale calls on OFTv2 layers (oftv2/scaling.py) and tied embeddings both adapted refusing to merge.

Both failed before the fixes (AttributeError; merge composed the tied rotations).
"""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import tiny_model


def _unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, in_channels=4, out_channels=4,
    ).eval()


def test_diffusers_lora_scale_paths_do_not_crash_and_leave_the_rotation_unscaled():
    """diffusers calls scale_layer / unscale_layer on every BaseTunerLayer when a pipeline passes
    cross_attention_kwargs={"scale": s} (and fuse_lora(lora_scale=s)), set_scale on set_adapters(weights=...):
    AttributeError on OFTv2 layers today. PEFT's OFT warns and keeps the scale 1; so should OFTv2."""
    gen = torch.Generator().manual_seed(1)
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=gen), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 5, 32, generator=gen)}
    model = _unet()
    model.add_adapter(OFTv2Config(target_modules=["to_q", "to_v", "conv1"], block_size=8, init_weights=False))
    with torch.no_grad():
        plain = model(**inputs).sample
        with pytest.warns(UserWarning, match="scale"):
            scaled = model(**inputs, cross_attention_kwargs={"scale": 0.5}).sample
        torch.testing.assert_close(scaled, plain, rtol=0, atol=0)
        with pytest.warns(UserWarning, match="scale"):
            model.set_adapters(["default"], [0.7])
        torch.testing.assert_close(model(**inputs).sample, plain, rtol=0, atol=0)


def test_tied_embedding_and_head_both_adapted_refuse_to_merge_and_keep_the_weight():
    """embed_tokens and lm_head of a tied model share one tensor: merging composes both rotations on it (both layers
    then compute the wrong function) and unmerge_adapter, undoing them in module order, does not restore it (the
    logits stayed 0.25 off after merge + unmerge). Refuse the merge in one ValueError instead."""
    base = tiny_model("llama", tie_word_embeddings=True)
    model = peft.get_peft_model(copy.deepcopy(base), OFTv2Config(
        block_size=8, target_modules=["embed_tokens", "lm_head"], init_weights=False))
    shared = base.lm_head.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="lm_head"):
            model.base_model.merge_adapter()
    torch.testing.assert_close(model.base_model.model.lm_head.get_base_layer().weight.detach(), shared, rtol=0, atol=0)
