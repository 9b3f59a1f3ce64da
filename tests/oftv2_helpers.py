"""Helpers shared by the OFTv2 tests in tests/oftv2 and tests/test_compile_adapters.py (a uniquely named module:
several test folders have a conftest.py)."""

from __future__ import annotations

import torch
from torch import nn


def randomize_q(model, std: float = 0.02, seed: int = 0, key: str = "oftv2_Q") -> None:
    """Fills every OFTv2 parameter (or every parameter named with ``key``: PEFT's OFT is ``"oft_R"``) with
    N(0, std²) so rotations differ from the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if key in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


class MixedLayers(nn.Module):
    """Embedding, Conv2d and Linear layers (the conv and linear ones biased) plus a head for ``modules_to_save``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.embed(ids)  # [B, T, 8]
        h = self.conv(h.transpose(1, 2)[..., None])[..., 0].transpose(1, 2)
        return self.head(torch.relu(self.proj(h)))
