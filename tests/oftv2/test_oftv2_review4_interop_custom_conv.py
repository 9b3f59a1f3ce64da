"""Exporting to PEFT's OFT warns for a 1 x 1 conv whose class has a forward of its own (weight standardization):
PEFT's unmerged forward runs the plain conv and skips it, so only PEFT's merged model computes what ours does."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from oftv2_helpers import randomize_q

from oftv2 import OFTv2Config
from oftv2.interop import export_peft_oft_adapter


class StandardizedConv2d(torch.nn.Conv2d):
    """BiT's idea in a few lines: the kernel is standardized per output channel on every call."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.var(dim=(1, 2, 3), keepdim=True, unbiased=False) + 1e-5).sqrt()
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(StandardizedConv2d(8, 8, kernel_size=1))


def test_export_of_a_1x1_conv_with_its_own_forward_warns(tmp_path):
    ours = peft.get_peft_model(_net(), OFTv2Config(target_modules=["0"], block_size=4, orthogonalization="peft_cn"))
    randomize_q(ours, std=0.05)
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        expected = ours(x)
    with pytest.warns(UserWarning, match=r"or a forward of their own \(base_model.model.0\)"):
        export_peft_oft_adapter(ours, tmp_path)
    vanilla = peft.PeftModel.from_pretrained(_net(), tmp_path).eval()
    with torch.no_grad():
        assert (vanilla(x) - expected).abs().max() > 1e-3  # what the warning is about
        torch.testing.assert_close(vanilla.merge_and_unload()(x), expected, rtol=1e-4, atol=1e-4)
