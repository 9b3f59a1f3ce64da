"""Kernel tests run the Triton kernels on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py at import) or, with ``PEFTPLUG_KERNELS_ON_GPU=1`` on a CUDA machine, compiled on the GPU; the
``device`` fixture says which.

The catch: Triton itself is usually imported before our kernels (peft imports it), which decorates Triton's own
``@jit`` helpers (``tl.zeros``, ``tl.sum``, ...) for the GPU: our kernels use builtins only (``tl.full`` instead of
``tl.zeros``), and test_kernels_dispatch.py checks that order.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def needs_triton():
    """Skips the test cleanly when Triton is not installed (it is the optional ``triton`` extra)."""
    from peftplug_kernels._triton_available import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    eps = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    scale = expected.float().abs().max().item() + 1e-6
    # A handful of roundings of the output (fp32 reduction order differs from torch's on top of that).
    tol = 8 * eps * scale + (1e-5 * scale if dtype == torch.float32 else 0.0)
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > tolerance {tol:.3g} (scale {scale:.3g}, {dtype})"


@pytest.fixture
def close():
    """``close(actual, expected, dtype, what)``: asserts agreement within a few roundings of ``dtype``, scaled to
    the expected tensor's magnitude."""
    return _assert_close


@pytest.fixture
def quantize():
    """``quantize(shape, dtype, quant_type, nested, blocksize=64, device="cpu", seed=0) -> (w, packed, state)``:
    a random weight and its bitsandbytes 4-bit quantization (skips when bitsandbytes is not installed)."""
    bnbf = pytest.importorskip("bitsandbytes.functional")

    def make(shape, dtype, quant_type, nested, blocksize=64, device="cpu", seed=0):
        torch.manual_seed(seed)
        w = torch.randn(*shape, device=device).to(dtype)
        packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)
        return w, packed, state

    return make
