"""Fixtures of the benchmark tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def keep_threads():
    """The benchmarks pin torch's thread count; every test here gives the rest of the suite its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
