"""OFTv2 on diffusion models: a tiny randomly initialised diffusers UNet2DConditionModel (attention projections
and convs) and SD3Transformer2DModel (joint attention projections and the patch-embedding conv), through
``peft.get_peft_model`` and through ``inject_adapter_in_model`` / diffusers' ``add_adapter``."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft import PeftModel

import oftv2  # noqa: F401
from oftv2 import Conv2d, OFTv2Config

diffusers = pytest.importorskip("diffusers")

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "conv_shortcut", "proj_in", "proj_out"]
SD3_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "pos_embed.proj",
]


def _unet():
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
    ).eval()


def _sd3():
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    ).eval()


MODELS = {"unet": (_unet, UNET_TARGETS), "sd3": (_sd3, SD3_TARGETS)}


def _inputs(kind: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=gen),
    }
    sample = torch.randn(2, 4, 8, 8, generator=gen)
    if kind == "unet":
        return {"sample": sample, **inputs}
    return {"hidden_states": sample, "pooled_projections": torch.randn(2, 16, generator=gen), **inputs}


def _out(model, inputs) -> torch.Tensor:
    return model(**inputs).sample


@pytest.mark.parametrize("kind", list(MODELS))
def test_get_peft_model_identity_train_merge_save_load(kind, tmp_path):
    build, targets = MODELS[kind]
    model, inputs = build(), _inputs(kind)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        base = _out(model, inputs)
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=targets, block_size=8))
    convs = [m for m in peft_model.modules() if isinstance(m, Conv2d)]
    assert convs and all(isinstance(m.get_base_layer(), torch.nn.Conv2d) for m in convs)
    with torch.no_grad():
        assert torch.allclose(_out(peft_model, inputs), base, atol=1e-5)

    # One training step changes the output (and only the adapter's parameters move).
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all("oftv2_Q" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    torch.nn.functional.mse_loss(_out(peft_model, inputs), torch.zeros_like(base)).backward()
    optimizer.step()
    peft_model.eval()
    with torch.no_grad():
        trained = _out(peft_model, inputs)
    assert (trained - base).abs().max() > 1e-3

    # Merge reproduces the adapter; unmerge restores the base weights.
    with torch.no_grad():
        peft_model.merge_adapter()
        merged = _out(peft_model, inputs)
        peft_model.unmerge_adapter()
    assert torch.allclose(merged, trained, atol=1e-4), (merged - trained).abs().max()
    restored = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in peft_model.named_parameters()
    }
    assert all(torch.allclose(restored[n], w, atol=1e-5) for n, w in weights.items())

    # Save / load into a fresh model.
    peft_model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(build(), tmp_path)
    with torch.no_grad():
        assert torch.allclose(_out(loaded, inputs), trained, atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_diffusers_add_adapter_and_state_dict_round_trip(kind):
    """diffusers' own ``add_adapter`` (it calls ``peft.inject_adapter_in_model``), then the state-dict functions
    diffusers' LoRA loaders use to save and restore adapter weights."""
    build, targets = MODELS[kind]
    model, inputs = build(), _inputs(kind)
    with torch.no_grad():
        base = _out(model, inputs)
    model.add_adapter(OFTv2Config(target_modules=targets, block_size=8))
    with torch.no_grad():
        assert torch.allclose(_out(model, inputs), base, atol=1e-5)
    randomize_q(model, std=0.02)
    with torch.no_grad():
        adapted = _out(model, inputs)
    assert (adapted - base).abs().max() > 1e-3
    state = peft.get_peft_model_state_dict(model)
    assert state and all(k.endswith("oftv2_Q.weight") for k in state)

    fresh = build()
    peft.inject_adapter_in_model(OFTv2Config(target_modules=targets, block_size=8), fresh)
    result = peft.set_peft_model_state_dict(fresh, state)
    assert not result.unexpected_keys
    with torch.no_grad():
        assert torch.allclose(_out(fresh, inputs), adapted, atol=1e-6)
