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


@pytest.fixture
def kernel_page(tmp_path, monkeypatch):
    """A scratch QOFT page with a CPU section, and ``benchmarks.kernels.gpu`` writing its results and GPU section
    under ``tmp_path`` (``gpu.RESULTS``, ``gpu.PAGE``) instead of the committed ones; returns the page's path."""
    from benchmarks.kernels import gpu

    page = tmp_path / "qoft.md"
    page.write_text("# QOFT\n\n<!-- qoft-cpu:begin -->\nCPU part\n<!-- qoft-cpu:end -->\n")
    monkeypatch.setattr(gpu, "RESULTS", tmp_path / "results" / "gpu.json")
    monkeypatch.setattr(gpu, "PAGE", page)
    return page
