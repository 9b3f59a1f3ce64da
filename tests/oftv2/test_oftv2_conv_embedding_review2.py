"""Second review of OFTv2 on nn.Conv2d and nn.Embedding: every output compared with the rotated weight applied by
plain ``F.conv2d`` / ``F.embedding`` (the function a merged layer computes)."""

from __future__ import annotations

import copy
import math

import peft
import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug_kernels.cayley_neumann.reference import cayley_neumann


def _dense_rotation(layer, adapter: str = "default") -> torch.Tensor:
    """The block-diagonal R of an adapter, built by the pure-torch reference from the raw parameters."""
    q = layer.oftv2_Q[adapter].detach()
    b = layer.oftv2_block_size[adapter]
    settings = layer.oftv2_settings[adapter]
    blocks = cayley_neumann(q, b, terms=settings.terms, form=settings.form)
    return torch.block_diag(*blocks.expand(layer.oftv2_n_blocks[adapter], b, b).unbind(0))


def _conv_reference(conv: nn.Conv2d, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``F.conv2d`` with ``W_flat Rᵀ``; non-zero padding modes padded explicitly, as torch's Conv2d does."""
    weight = (conv.weight.detach().reshape(conv.out_channels, -1) @ rotation.T).reshape(conv.weight.shape)
    bias = None if conv.bias is None else conv.bias.detach()
    if conv.padding_mode != "zeros":
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        return F.conv2d(x, weight, bias, conv.stride, 0, conv.dilation, conv.groups)
    return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


# Geometries the older tests do not cover: circular padding with groups and stride, asymmetric "same" padding of an
# even kernel under replicate padding, dilation with "same" on a non-square kernel, no bias, "valid" with a stride.
GEOMETRIES = {
    "circular_groups3_stride2": {"in_channels": 6, "out_channels": 6, "kernel_size": 3, "padding": 2,
                                 "padding_mode": "circular", "groups": 3, "stride": 2},
    "same_even_kernel_replicate": {"in_channels": 6, "out_channels": 4, "kernel_size": 4, "padding": "same",
                                   "padding_mode": "replicate"},
    "same_dilated_2x3": {"in_channels": 6, "out_channels": 4, "kernel_size": (2, 3), "padding": "same",
                         "dilation": 2},
    "reflect_4x2_no_bias": {"in_channels": 3, "out_channels": 8, "kernel_size": (4, 2), "padding": (1, 2),
                            "padding_mode": "reflect", "bias": False},
    "valid_stride_2x1": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": "valid",
                         "stride": (2, 1)},
}


@pytest.mark.parametrize("evaluation", ["weight", "input"])
@pytest.mark.parametrize("case", list(GEOMETRIES))
def test_conv_geometries_forward_merge_unmerge(case, evaluation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(**GEOMETRIES[case]))
    conv = model[0]
    original = conv.weight.detach().clone()
    peft_model = peft.get_peft_model(model, OFTv2Config(
        target_modules=["0"], block_size=3, conv_evaluation=evaluation, init_weights=False))
    layer = peft_model.base_model.model[0]
    x = torch.randn(2, conv.in_channels, 9, 8)
    with torch.no_grad():
        out = peft_model(x)
        expected = _conv_reference(conv, x, _dense_rotation(layer))
        assert (out - conv(x)).abs().max() > 1e-2  # the rotation does something
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
        peft_model.base_model.merge_adapter(safe_merge=True)
        torch.testing.assert_close(peft_model(x), expected, rtol=1e-5, atol=2e-6)
        peft_model.base_model.unmerge_adapter()
    torch.testing.assert_close(conv.weight.detach(), original, rtol=0, atol=1e-6)


def test_conv_bf16_base_with_fp32_adapter_in_both_evaluations():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1))
    x = torch.randn(2, 4, 6, 6)
    outputs = []
    for evaluation in ("weight", "input"):
        torch.manual_seed(1)
        peft_model = peft.get_peft_model(copy.deepcopy(base), OFTv2Config(
            target_modules=["0"], block_size=6, conv_evaluation=evaluation, init_weights=False))
        layer = peft_model.base_model.model[0]
        expected = _conv_reference(layer.get_base_layer(), x, _dense_rotation(layer))
        layer.get_base_layer().to(torch.bfloat16)
        out = peft_model(x.bfloat16())
        out.float().square().sum().backward()
        assert out.dtype == torch.bfloat16 and layer.oftv2_Q["default"].grad.dtype == torch.float32
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=3e-2)
        outputs.append(layer.oftv2_Q["default"].grad)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-1)


class _ConvEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 6, 3, padding=1, groups=2)
        self.emb = nn.Embedding(30, 8, padding_idx=0)

    def forward(self, x, ids):
        return self.conv(x), self.emb(ids)


@pytest.mark.parametrize("evaluation", ["weight", "input"])
def test_two_adapters_disable_merge_and_save_load(tmp_path, evaluation):
    base = _ConvEmbed()
    x, ids = torch.randn(2, 4, 5, 5), torch.tensor([[0, 3, 7], [29, 1, 0]])
    with torch.no_grad():
        base_out = base(x, ids)
    config = {"target_modules": ["conv", "emb"], "block_size": 2, "conv_evaluation": evaluation,
              "init_weights": False}
    peft_model = peft.get_peft_model(copy.deepcopy(base), OFTv2Config(**config))
    peft_model.add_adapter("b", OFTv2Config(**config))
    peft_model.base_model.set_adapter(["default", "b"])
    conv, emb = peft_model.base_model.model.conv, peft_model.base_model.model.emb
    # Forward order: x R_default R_b, i.e. the rotated weights W (R_d R_b)ᵀ and E R_d R_b.
    expected_conv = _conv_reference(base.conv, x, _dense_rotation(conv) @ _dense_rotation(conv, "b"))
    table = base.emb.weight.detach() @ _dense_rotation(emb) @ _dense_rotation(emb, "b")
    expected_emb = F.embedding(ids, table, padding_idx=0)
    with torch.no_grad():
        out_conv, out_emb = peft_model(x, ids)
        torch.testing.assert_close(out_conv, expected_conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_emb, expected_emb, rtol=1e-5, atol=1e-6)
        assert torch.equal(out_emb[0, 0], torch.zeros(8))  # the padding row stays zero
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(x, ids), base_out, rtol=0, atol=0)
        peft_model.base_model.merge_adapter(["default", "b"])
        merged = peft_model(x, ids)
        torch.testing.assert_close(merged[0], expected_conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(merged[1], expected_emb, rtol=1e-5, atol=1e-6)
        with peft_model.disable_adapter():  # unmerges first
            torch.testing.assert_close(peft_model(x, ids), base_out, rtol=1e-5, atol=1e-6)
    peft_model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    loaded.load_adapter(tmp_path / "b", "b")
    loaded.base_model.set_adapter(["default", "b"])
    with torch.no_grad():
        out_conv, out_emb = loaded(x, ids)
    torch.testing.assert_close(out_conv, expected_conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_emb, expected_emb, rtol=1e-5, atol=1e-6)


def test_conv_safe_merge_refuses_a_broken_adapter_and_leaves_the_kernel():
    peft_model = peft.get_peft_model(_ConvEmbed(), OFTv2Config(target_modules=["conv"], block_size=2))
    conv = peft_model.base_model.model.conv
    with torch.no_grad():
        conv.oftv2_Q["default"].fill_(float("nan"))
    kernel = conv.get_base_layer().weight.detach().clone()
    with pytest.raises(ValueError, match="'default'"):
        peft_model.base_model.merge_adapter(safe_merge=True)
    assert torch.equal(conv.get_base_layer().weight, kernel) and not conv.merged


# ------------------------------------------------------------------------------------------ Embedding max_norm
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_embedding_max_norm_bounds_the_rotated_vectors_as_the_merged_table_does(norm_type):
    """With ``max_norm`` the merged layer renormalises rows of ``E R``; the unmerged one must compute the same (it
    renormalised rows of ``E`` and rotated them afterwards, which differs unless the norm is rotation-invariant)."""
    ids = torch.tensor([[1, 5, 0, 29], [3, 3, 7, 0]])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16, padding_idx=0, max_norm=0.5, norm_type=norm_type))
    table = model[0].weight.detach().clone()
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["0"], block_size=4, init_weights=False))
    layer = peft_model.base_model.model[0]
    # What a merged layer computes: plain F.embedding on the rotated table (on a copy: it renormalises in place).
    rotated = table @ _dense_rotation(layer)
    expected = F.embedding(ids, rotated.clone(), padding_idx=0, max_norm=0.5, norm_type=norm_type)
    assert (expected - F.embedding(ids, table.clone(), max_norm=0.5, norm_type=norm_type)).abs().max() > 1e-2
    out = peft_model(ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    assert layer.oftv2_Q["default"].grad.abs().max() > 0
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids), expected, rtol=1e-5, atol=1e-6)  # renorm is idempotent
        peft_model.base_model.merge_adapter()
        torch.testing.assert_close(peft_model(ids), expected, rtol=1e-5, atol=1e-6)
        peft_model.base_model.unmerge_adapter()
        torch.testing.assert_close(peft_model(ids), expected, rtol=1e-5, atol=1e-6)


def test_tied_embedding_unmerged_leaves_the_head_and_merging_warns(tiny_model, tokens):
    """Rotating a tied input embedding must not touch the shared head weight unmerged; merging it does (the weight
    is shared), and that is not silent: PEFT's tied-module warning names the layer, as for LoRA."""
    base = tiny_model("llama", tie_word_embeddings=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    shared = base.lm_head.weight.detach().clone()
    model = peft.get_peft_model(copy.deepcopy(base), OFTv2Config(
        block_size=8, target_modules=["embed_tokens"], init_weights=False))
    with torch.no_grad():
        model(tokens)
    torch.testing.assert_close(model.base_model.model.lm_head.weight.detach(), shared, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="embed_tokens"):
        model.merge_and_unload()
