"""Fixtures of the benchmark tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def keep_threads():
    """The benchmarks pin torch's thread count; the rest of the suite gets its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
