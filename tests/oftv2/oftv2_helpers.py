"""Helpers shared by the OFTv2 tests (a uniquely named module: several test folders have a conftest.py)."""

from __future__ import annotations

import torch


def randomize_q(model, std: float = 0.02, seed: int = 0) -> None:
    """Fills every OFTv2 parameter with N(0, std²) so rotations differ from the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "oftv2_Q" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
