"""OFTv2 on nn.Conv2d: the function conv(x, W_flat Rᵀ), both evaluations, merge/unmerge, parity with PEFT's OFT
where PEFT's is right (1 × 1 kernels, merged weights), and the diagnosis of PEFT 0.21.2's k > 1 forward."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from torch import nn

import oftv2  # noqa: F401
from oftv2 import OFTv2Config, oftv2_config_from_oft, state_dict_from_peft_oft
from oftv2.conv import Conv2d
from peftplug_kernels.cayley_neumann.reference import cayley_neumann

# (kwargs of nn.Conv2d(in=8, out=6, ...)): square and non-square kernels, stride, padding (int, tuple, "same",
# non-zero modes), dilation, groups.
CONV_CASES = {
    "3x3_pad1": {"kernel_size": 3, "padding": 1},
    "3x3_nopad": {"kernel_size": 3},
    "3x2_stride2_dil": {"kernel_size": (3, 2), "stride": 2, "padding": (1, 0), "dilation": (1, 2)},
    "same_reflect": {"kernel_size": 3, "padding": "same", "padding_mode": "reflect"},
    "groups2": {"kernel_size": 3, "padding": 1, "groups": 2},
    "1x1_stride2": {"kernel_size": 1, "stride": 2},
}


def _conv_model(seed: int = 0, **conv_kwargs) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(8, 6, **conv_kwargs))


def _dense_rotation(layer: Conv2d, adapter: str = "default") -> torch.Tensor:
    """The block-diagonal R built from the raw parameters by the pure-torch reference, not by the layer."""
    q = layer.oftv2_Q[adapter].detach()
    b = layer.oftv2_block_size[adapter]
    settings = layer.oftv2_settings[adapter]
    blocks = cayley_neumann(q, b, terms=settings.terms, form=settings.form)
    blocks = blocks.expand(layer.oftv2_n_blocks[adapter], b, b)
    return torch.block_diag(*blocks.unbind(0))


def _reference(conv: nn.Conv2d, x: torch.Tensor, rotations: list[torch.Tensor]) -> torch.Tensor:
    """conv(x, W_flat (R₁ … Rₙ)ᵀ) with the base conv's own stride/padding/dilation/groups."""
    weight = conv.weight.reshape(conv.out_channels, -1)
    total = torch.eye(weight.shape[1])
    for rotation in rotations:
        total = total @ rotation
    return conv._conv_forward(x, (weight @ total.T).reshape(conv.weight.shape), conv.bias)


@pytest.mark.parametrize("evaluation", ["weight", "input"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_identity_at_init_and_forward_is_rotated_conv(case, evaluation):
    model = _conv_model(**CONV_CASES[case])
    conv = model[0]
    x = torch.randn(2, 8, 9, 10)
    with torch.no_grad():
        base = model(x)
    config = OFTv2Config(
        target_modules=["0"], block_size=4, orthogonalization="cayley", conv_evaluation=evaluation
    )
    peft_model = peft.get_peft_model(model, config)
    layer = peft_model.base_model.model[0]
    assert isinstance(layer, Conv2d)
    with torch.no_grad():
        assert torch.allclose(peft_model(x), base, atol=1e-6)
    randomize_q(peft_model, std=0.2)
    with torch.no_grad():
        out = peft_model(x)
        expected = _reference(conv, x, [_dense_rotation(layer)])
    assert (out - base).abs().max() > 1e-2  # the rotation does something
    assert torch.allclose(out, expected, atol=2e-5), (out - expected).abs().max()


@pytest.mark.parametrize("case", ["3x2_stride2_dil", "same_reflect", "groups2"])
def test_weight_and_input_evaluations_agree_in_value_and_gradient(case):
    x = torch.randn(2, 8, 9, 10)
    results = []
    for evaluation in ("weight", "input"):
        peft_model = peft.get_peft_model(
            _conv_model(**CONV_CASES[case]),
            OFTv2Config(target_modules=["0"], block_size=4, conv_evaluation=evaluation),
        )
        randomize_q(peft_model, std=0.1)
        out = peft_model(x)
        out.square().sum().backward()
        results.append((out.detach(), peft_model.base_model.model[0].oftv2_Q["default"].grad.clone()))
    (out_w, grad_w), (out_i, grad_i) = results
    assert torch.allclose(out_w, out_i, atol=2e-5)
    assert grad_w.abs().max() > 0
    assert torch.allclose(grad_w, grad_i, rtol=1e-4, atol=1e-4), (grad_w - grad_i).abs().max()


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_auto_evaluation_counts_output_pixels_and_picks_the_smaller_rotation(case):
    """auto: input-centric iff batch · H_out · W_out · groups < out_channels; both regimes compute the reference."""
    model = nn.Sequential(nn.Conv2d(8, 48, **CONV_CASES[case]))
    conv = model[0]
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["0"], block_size=4))
    layer = peft_model.base_model.model[0]
    randomize_q(peft_model, std=0.1)
    for shape in ((1, 8, 5, 4), (4, 8, 9, 10), (8, 5, 4)):
        x = torch.randn(shape)
        with torch.no_grad():
            out = layer(x)
            expected = _reference(conv, x, [_dense_rotation(layer)])
        pixels = expected.numel() // 48
        assert layer.output_pixels(x) == pixels
        assert layer.evaluation_for(x) == ("input" if pixels * conv.groups < 48 else "weight")
        assert torch.allclose(out, expected, atol=2e-5)


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.SiLU(),
        nn.Conv2d(8, 8, (3, 1), stride=2, padding=(1, 0)),
        nn.SiLU(),
        nn.Conv2d(8, 4, 1),
    )


def weights_conv(weights: dict[str, torch.Tensor]) -> nn.Conv2d:
    """The first conv of :func:`_stack` rebuilt from saved weights (the reference must not see the adapter)."""
    conv = nn.Conv2d(4, 8, 3, padding=1)
    conv.load_state_dict({"weight": weights["0.weight"], "bias": weights["0.bias"]})
    return conv


@pytest.mark.parametrize("evaluation", ["weight", "input"])
@pytest.mark.parametrize("form", ["cayley_neumann", "cayley"])
def test_merge_matches_forward_and_unmerge_restores(evaluation, form):
    model = _stack()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = OFTv2Config(
        target_modules=["0", "2", "4"], block_size=4, orthogonalization=form, conv_evaluation=evaluation
    )
    peft_model = peft.get_peft_model(model, config)
    peft_model.add_adapter("second", OFTv2Config(target_modules=["0", "2"], r=3, orthogonalization=form))
    randomize_q(peft_model, std=0.1)
    peft_model.base_model.set_adapter(["default", "second"])  # two rotations compose: x R_default R_second
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        adapted = peft_model(x)
        layer = peft_model.base_model.model[0]
        expected = _reference(
            weights_conv(weights), x, [_dense_rotation(layer), _dense_rotation(layer, "second")]
        )
        first = peft_model.base_model.model[0](x)
        peft_model.merge_adapter()
        merged = peft_model(x)
        peft_model.unmerge_adapter()
        unmerged = peft_model(x)
    assert torch.allclose(first, expected, atol=2e-5)
    assert torch.allclose(merged, adapted, atol=2e-5), (merged - adapted).abs().max()
    assert torch.allclose(unmerged, adapted, atol=2e-5)
    restored = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in peft_model.named_parameters()
    }
    for name, before in weights.items():
        assert torch.allclose(restored[name], before, atol=1e-6), name
    merged_model = peft_model.merge_and_unload()
    assert all(type(m) is nn.Conv2d for m in merged_model if isinstance(m, nn.Conv2d))
    with torch.no_grad():
        assert torch.allclose(merged_model(x), adapted, atol=2e-5)


def test_training_step_changes_output_and_disable_restores_base():
    model = _stack()
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        base = model(x)
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["0", "2", "4"], block_size=4))
    assert {n for n, p in peft_model.named_parameters() if p.requires_grad} == {
        f"base_model.model.{i}.oftv2_Q.default.weight" for i in (0, 2, 4)
    }
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        peft_model(x).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        trained = peft_model(x)
        with peft_model.disable_adapter():
            disabled = peft_model(x)
    assert (trained - base).abs().max() > 1e-3
    assert torch.equal(disabled, base)


@pytest.mark.parametrize(
    "kwargs, form",
    [
        ({"kernel_size": 1}, {"use_cayley_neumann": True, "num_cayley_neumann_terms": 5}),
        ({"kernel_size": 1, "stride": 2, "padding": 1}, {"use_cayley_neumann": False}),
    ],
)
def test_parity_with_peft_oft_on_1x1_convs(kwargs, form):
    """PEFT's OFT Conv2d forward is right for 1 × 1 kernels: same Q (converted by oftv2.interop) -> same output."""

    x = torch.randn(2, 8, 7, 7)
    oft_config = peft.OFTConfig(target_modules=["0"], oft_block_size=4, r=0, init_weights=False, **form)
    reference = peft.get_peft_model(_conv_model(**kwargs), oft_config)
    ours = peft.get_peft_model(_conv_model(**kwargs), oftv2_config_from_oft(oft_config))
    converted = state_dict_from_peft_oft(peft.get_peft_model_state_dict(reference), oft_config)
    result = peft.set_peft_model_state_dict(ours, converted)
    assert not result.unexpected_keys
    with torch.no_grad():
        expected = reference(x)
        with reference.disable_adapter():
            assert (reference(x) - expected).abs().max() > 1e-2  # the adapter really rotates
        assert torch.allclose(ours(x), expected, atol=1e-5), (ours(x) - expected).abs().max()


def test_equals_peft_oft_merged_weights_on_3x3():
    """PEFT's merge (W_flat Rᵀ) is right for any kernel: ours unmerged equals PEFT's merged model."""
    x = torch.randn(2, 8, 9, 9)
    oft_config = peft.OFTConfig(target_modules=["0"], oft_block_size=8, r=0, init_weights=False)
    reference = peft.get_peft_model(_conv_model(kernel_size=3, padding=1), oft_config)
    ours = peft.get_peft_model(
        _conv_model(kernel_size=3, padding=1),
        OFTv2Config(target_modules=["0"], block_size=8, orthogonalization="peft_cn", neumann_terms=5),
    )
    with torch.no_grad():
        ours.base_model.model[0].oftv2_Q["default"].copy_(
            reference.base_model.model[0].oft_R["default"].weight
        )
        expected = reference.merge_and_unload()(x)
        assert torch.allclose(ours(x), expected, atol=1e-5), (ours(x) - expected).abs().max()


def test_peft_0_21_oft_conv_is_not_identity_at_init_for_k_gt_1():
    """PEFT 0.21.2's OFT Conv2d forward unfolds the image at stride 1, rotates the patches and folds them back
    (F.fold sums overlapping windows, and its reshape before F.fold interleaves kernel offsets with pixel
    positions), so at R = I it changes the output unless the kernel is 1 × 1 (docs/oftv2.md has the diagnosis).
    If this fails, PEFT changed its Conv2d forward: update docs/oftv2.md and the interop notes."""
    x = torch.randn(2, 8, 9, 9)
    for kwargs, broken in (
        ({"kernel_size": 3, "padding": 1}, True),
        ({"kernel_size": 3}, True),
        ({"kernel_size": 1}, False),
    ):
        model = _conv_model(**kwargs)
        with torch.no_grad():
            base = model(x)
        peft_model = peft.get_peft_model(model, peft.OFTConfig(target_modules=["0"], oft_block_size=8, r=0))
        with torch.no_grad():
            relative = float((peft_model(x) - base).norm() / base.norm())
        assert (relative > 0.5) if broken else (relative < 1e-6), (kwargs, relative)


def test_bad_block_size_lists_valid_sizes_and_unsupported_types_are_named():
    with pytest.raises(
        ValueError,
        match=r"filter width \(in_channels / groups · kh · kw\) 27 .*valid block sizes: \[3, 9, 27\]",
    ):
        peft.get_peft_model(
            nn.Sequential(nn.Conv2d(3, 4, 3)), OFTv2Config(target_modules=["0"], block_size=4)
        )
    with pytest.raises(
        TypeError, match=r"of type Conv3d: supported are .*torch.nn.Conv2d, torch.nn.Embedding"
    ):
        peft.get_peft_model(
            nn.Sequential(nn.Conv3d(4, 4, 1)), OFTv2Config(target_modules=["0"], block_size=2)
        )
    with pytest.raises(ValueError, match="`conv_evaluation` must be one of"):
        OFTv2Config(conv_evaluation="fold")


def test_exported_conv_adapter_is_correct_in_peft_once_merged(tmp_path):
    """Export to PEFT's OFT format: vanilla PEFT loads it, and its merged model computes our forward."""
    from peft import PeftModel

    from oftv2 import export_peft_oft_adapter, load_peft_oft_adapter

    ours = peft.get_peft_model(
        _stack(), OFTv2Config(target_modules=["0", "4"], block_size=4, orthogonalization="peft_cn")
    )
    randomize_q(ours, std=0.05)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        expected = ours(x)
    export_peft_oft_adapter(ours, tmp_path)
    vanilla = PeftModel.from_pretrained(_stack(), tmp_path)
    back = load_peft_oft_adapter(_stack(), tmp_path)
    with torch.no_grad():
        assert torch.allclose(back(x), expected, atol=1e-5)
        assert torch.allclose(vanilla.merge_and_unload()(x), expected, atol=1e-5)
