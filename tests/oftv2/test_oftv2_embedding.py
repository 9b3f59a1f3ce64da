"""OFTv2 on nn.Embedding: y = E[ids] R, parity with PEFT's OFT Embedding, merge/unmerge, conversion both ways."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft import PeftModel
from torch import nn

import oftv2  # noqa: F401
from oftv2 import (
    OFTv2Config,
    export_peft_oft_adapter,
    load_peft_oft_adapter,
    oftv2_config_from_oft,
    state_dict_from_peft_oft,
)
from oftv2.embedding import Embedding
from peftplug_kernels.cayley_neumann.reference import cayley_neumann


class _Tagger(nn.Module):
    """Embedding -> Linear: the smallest model with both layer types (no weight tying)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(30, 16, padding_idx=0)
        self.proj = nn.Linear(16, 5)

    def forward(self, ids):
        return self.proj(self.embed(ids))


IDS = torch.tensor([[1, 5, 0, 29], [3, 3, 7, 0]])


def _dense_rotation(layer, adapter="default"):
    q = layer.oftv2_Q[adapter].detach()
    b = layer.oftv2_block_size[adapter]
    settings = layer.oftv2_settings[adapter]
    blocks = cayley_neumann(q, b, terms=settings.terms, form=settings.form).expand(
        layer.oftv2_n_blocks[adapter], b, b
    )
    return torch.block_diag(*blocks.unbind(0))


@pytest.mark.parametrize("form", ["cayley_neumann", "cayley"])
def test_identity_at_init_and_rotates_looked_up_vectors(form):
    model = _Tagger()
    table = model.embed.weight.detach().clone()
    with torch.no_grad():
        base = model(IDS)
    peft_model = peft.get_peft_model(
        model, OFTv2Config(target_modules=["embed"], block_size=4, orthogonalization=form)
    )
    layer = peft_model.base_model.model.embed
    assert isinstance(layer, Embedding) and layer.in_features == 16 and layer.out_features == 30
    with torch.no_grad():
        assert torch.equal(peft_model(IDS), base)
    randomize_q(peft_model, std=0.2)
    with torch.no_grad():
        looked_up = layer(IDS)
    expected = table[IDS] @ _dense_rotation(layer)
    assert (looked_up - table[IDS]).abs().max() > 1e-2
    assert torch.allclose(looked_up, expected, atol=1e-6)
    assert torch.equal(looked_up[0, 2], torch.zeros(16))  # the padding row stays zero


def test_merge_matches_forward_unmerge_restores_two_adapters_in_order():
    model = _Tagger()
    table = model.embed.weight.detach().clone()
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["embed", "proj"], block_size=4))
    peft_model.add_adapter("second", OFTv2Config(target_modules=["embed"], r=2, orthogonalization="cayley"))
    randomize_q(peft_model, std=0.1)
    peft_model.base_model.set_adapter(["default", "second"])
    layer = peft_model.base_model.model.embed
    with torch.no_grad():
        adapted = peft_model(IDS)
        # Output-side rotations compose left to right: E[ids] R_default R_second.
        expected = table[IDS] @ _dense_rotation(layer) @ _dense_rotation(layer, "second")
        assert torch.allclose(layer(IDS), expected, atol=1e-6)
        peft_model.merge_adapter()
        assert torch.allclose(peft_model(IDS), adapted, atol=1e-5)
        assert torch.allclose(
            layer.get_base_layer().weight,
            table @ _dense_rotation(layer) @ _dense_rotation(layer, "second"),
            atol=1e-5,
        )
        peft_model.unmerge_adapter()
    assert torch.allclose(layer.get_base_layer().weight, table, atol=1e-6)
    merged = peft_model.merge_and_unload()
    assert type(merged.embed) is nn.Embedding
    with torch.no_grad():
        assert torch.allclose(merged(IDS), adapted, atol=1e-5)


@pytest.mark.parametrize("use_cn", [True, False])
def test_parity_with_peft_oft_embedding(use_cn):
    oft_config = peft.OFTConfig(
        target_modules=["embed", "proj"], oft_block_size=4, r=0, use_cayley_neumann=use_cn, init_weights=False
    )
    reference = peft.get_peft_model(_Tagger(), oft_config)
    assert any("oft_embedding_R" in k for k in peft.get_peft_model_state_dict(reference))
    ours = peft.get_peft_model(_Tagger(), oftv2_config_from_oft(oft_config))
    state = state_dict_from_peft_oft(peft.get_peft_model_state_dict(reference), oft_config)
    assert not peft.set_peft_model_state_dict(ours, state).unexpected_keys
    with torch.no_grad():
        expected = reference(IDS)
        with reference.disable_adapter():
            assert (reference(IDS) - expected).abs().max() > 1e-2
        assert torch.allclose(ours(IDS), expected, atol=1e-5), (ours(IDS) - expected).abs().max()
        # PEFT's merged embedding equals ours merged too.
        ours_merged = ours.merge_and_unload()(IDS)
        assert torch.allclose(ours_merged, reference.merge_and_unload()(IDS), atol=1e-5)


@pytest.mark.parametrize("orthogonalization", ["peft_cn", "cayley"])
def test_export_to_peft_and_back(tmp_path, orthogonalization):
    ours = peft.get_peft_model(
        _Tagger(),
        OFTv2Config(target_modules=["embed", "proj"], block_size=8, orthogonalization=orthogonalization),
    )
    randomize_q(ours, std=0.05)
    with torch.no_grad():
        expected = ours(IDS)
    export_peft_oft_adapter(ours, tmp_path)
    vanilla = PeftModel.from_pretrained(_Tagger(), tmp_path)
    assert isinstance(vanilla.peft_config["default"], peft.OFTConfig)
    back = load_peft_oft_adapter(_Tagger(), tmp_path)
    with torch.no_grad():
        assert torch.allclose(vanilla(IDS), expected, atol=1e-5)
        assert torch.allclose(back(IDS), expected, atol=1e-5)


def test_block_size_must_divide_embedding_dimension():
    with pytest.raises(
        ValueError, match=r"embedding dimension 16 of layer 'embed'; valid block sizes: \[2, 4, 8, 16\]"
    ):
        peft.get_peft_model(_Tagger(), OFTv2Config(target_modules=["embed"], block_size=5))
