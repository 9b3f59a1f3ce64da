"""Fixtures shared by the OFTv2 tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tokens():
    """A fixed batch of token ids for the tiny char-vocabulary models."""
    return torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
