"""OFTv2 on ``nn.Conv2d`` subclasses with a forward of their own (oftv2/conv.py: ``Conv2d.custom_forward``).

BiT's ``WeightStandardizedConv2d`` (also the backbone of ViT-hybrid and DPT-hybrid) standardizes its kernel and pads
dynamically in its forward; Perceiver's ``Conv2dSamePadding`` pads in its forward. The OFTv2 layer called
``_conv_forward`` (or unfolded the input) itself, skipping both: before the fix the adapted BiT model differed from the
base model by 0.30 in the logits at init (Q = 0) with adapters on its 1x1 convs, and raised a shape error with
one on a 3x3 conv ("SAME" padding done in the forward), as did the Perceiver conv.
"""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from oftv2_helpers import randomize_q
from transformers import AutoConfig, AutoModelForImageClassification

import oftv2
from oftv2 import OFTv2Config

PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
TARGETS = ["conv1", "conv2", "conv3"]  # the bottleneck's 1x1, 3x3 and 1x1 WeightStandardizedConv2d layers


def _bit():
    config = AutoConfig.for_model(
        "bit", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, layer_type="bottleneck",
        global_padding="SAME", num_groups=4,
    )
    torch.manual_seed(0)
    return AutoModelForImageClassification.from_config(config).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=PIXELS).logits.clone()


@pytest.mark.parametrize(("evaluation", "stack"), [("weight", False), ("input", False), ("auto", False),
                                                   ("input", True)])
def test_weight_standardized_convs_identity_train_merge_and_reload(evaluation, stack, tmp_path):
    base = _bit()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    expected = _logits(base)
    model = peft.get_peft_model(base, OFTv2Config(
        target_modules=TARGETS, block_size=4, conv_evaluation=evaluation, stack_rotations=stack))
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)  # identity at init: 0.30 before the fix
    layers = [m for m in model.modules() if isinstance(m, oftv2.Conv2d)]
    assert len(layers) == 6 and all(layer.evaluation_for(PIXELS) == "weight" for layer in layers)

    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(pixel_values=PIXELS).logits.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    trained = _logits(model)
    assert (trained - expected).abs().max() > 1e-3

    model.save_pretrained(tmp_path)
    fresh = _bit()
    fresh.load_state_dict(state)
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path).eval()
    torch.testing.assert_close(_logits(reloaded), trained, rtol=0, atol=1e-6)
    merged = model.merge_and_unload()
    assert type(merged.bit.encoder.stages[0].layers[0].conv2).__name__ == "WeightStandardizedConv2d"
    torch.testing.assert_close(_logits(merged), trained, rtol=0, atol=1e-5)


def test_same_padding_conv_runs_its_own_padding_with_the_rotated_kernel():
    from transformers.models.perceiver.modeling_perceiver import Conv2dSamePadding

    torch.manual_seed(0)
    conv = Conv2dSamePadding(4, 8, kernel_size=4)  # even kernel: asymmetric "same" padding done in its forward
    net = torch.nn.Sequential(conv)
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = net(x)
    model = peft.get_peft_model(net, OFTv2Config(target_modules=["0"], block_size=8))
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # RuntimeError (shapes) before the fix
    randomize_q(model, std=0.05)
    layer = model.base_model.model[0]
    with torch.no_grad():
        rotation = layer.get_delta_weight("default")
        weight = conv.weight.reshape(8, -1) @ rotation.T
        reference = F.conv2d(conv.zero_pad_2d(x), weight.reshape(conv.weight.shape), conv.bias)
        out = model(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    assert (out - expected).abs().max() > 1e-3
    with torch.no_grad():
        torch.testing.assert_close(model.merge_and_unload()(x), reference, rtol=0, atol=1e-5)
