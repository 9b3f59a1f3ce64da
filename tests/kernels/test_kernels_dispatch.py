"""impl dispatch: auto/torch/triton resolution, clear errors, and the light import of the kernels package."""

from __future__ import annotations

import pytest
import torch

import peftplug_kernels._triton_available as avail
from peftplug_kernels import ops


def test_auto_uses_reference_on_cpu():
    assert ops.resolve_impl("auto", torch.zeros(2)) == "torch"
    assert ops.resolve_impl("torch", torch.zeros(2)) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_uses_triton_on_cuda():
    expected = "triton" if avail.triton_available() else "torch"
    assert ops.resolve_impl("auto", torch.zeros(2, device="cuda")) == expected


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.block_rotate(torch.zeros(2, 4), torch.eye(4)[None], impl="cuda")


def test_forced_triton_without_triton_says_how_to_install(monkeypatch):
    monkeypatch.setattr(avail, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"peftplug\[triton\]"):
        ops.block_rotate(torch.zeros(2, 4), torch.eye(4)[None], impl="triton")


def test_forced_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.block_rotate(torch.zeros(2, 4), torch.eye(4)[None], impl="triton")


def test_light_import_and_interpreter_after_an_early_triton_import(run_fresh, needs_triton, device):
    if device == "cuda":
        # An interpreter-order test; on the GPU machine the kernels are tested compiled (and the image's Triton 3.6
        # interpreter does not run on numpy 2.x, see docs/kernels.md).
        pytest.skip("interpreter-mode test; this run tests the compiled kernels")
    # In the single-process test suite, other packages (peft) import triton before tests/kernels/conftest.py sets
    # TRITON_INTERPRET=1. Triton's own @jit helpers (tl.zeros, tl.sum, ...) are then compiled-mode functions the
    # interpreter cannot call, so our kernels must use builtins only. This reproduces that order.
    proc = run_fresh(
        """
        import os, sys
        import peftplug_kernels.ops
        assert "triton" not in sys.modules, "peftplug_kernels.ops imported triton eagerly"
        assert not [m for m in sys.modules if m.endswith(".triton") and m.startswith("peftplug_kernels")]
        import triton.language  # early import, not in interpreter mode
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from peftplug_kernels import ops
        from peftplug_kernels.nf4_rotate_matmul.reference import dequantize_4bit

        class State:  # a 4-bit state, built by hand (no bitsandbytes import needed)
            shape, blocksize, dtype, nested, offset = (8, 64), 64, torch.float16, False, 0.0
            code = torch.linspace(-1, 1, 16)
            absmax = torch.tensor([1.0] * 8)

        packed = torch.randint(0, 256, (256, 1), dtype=torch.uint8)
        x = torch.randn(3, 64, dtype=torch.float16, requires_grad=True)
        q = torch.zeros(4, 120, requires_grad=True)
        rot = ops.cayley_neumann(q, 16, impl="triton")
        y = ops.nf4_rotate_matmul(ops.block_rotate(x, rot, impl="triton"), rot, packed, State(), impl="triton")
        y.float().sum().backward()
        r = torch.block_diag(*rot.detach())
        ref = (x.detach().float() @ r) @ r @ dequantize_4bit(packed, State()).float().T
        assert torch.allclose(y.float(), ref, atol=2e-2 * ref.abs().max()), (y.float() - ref).abs().max()
        assert q.grad is not None and x.grad is not None
        print("ok")
        """,
        timeout=180,
        bare=True,  # import order is what this tests: a bare interpreter, not the fork server
    )
    assert proc.stdout.strip().endswith("ok")


def test_no_top_level_kernels_package_of_ours():
    # Hugging Face's `kernels` owns that import name; the installed peftplug must not provide it.
    import importlib.metadata

    try:
        importlib.metadata.distribution("peftplug")
    except importlib.metadata.PackageNotFoundError:  # the GPU run imports the source tree from PYTHONPATH
        pytest.skip("peftplug is not installed as a distribution here (source tree on PYTHONPATH)")
    providers = importlib.metadata.packages_distributions()
    assert "peftplug" not in [name.lower() for name in providers.get("kernels", [])]
    assert "peftplug_kernels" in providers and "peftplug" in [n.lower() for n in providers["peftplug_kernels"]]


def test_hugging_face_kernels_imports_beside_ours():
    # bitsandbytes 0.50 does `from kernels import get_kernel` at import (its AVX512-BF16 CPU GEMM); with Hugging
    # Face's package installed in the same environment that import must reach it, and our ops still dispatch.
    import importlib.metadata

    try:  # not importorskip: without the distribution, `import kernels` finds tests/kernels/ as a namespace package
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed (dev extra)")
    import kernels as hf_kernels
    from kernels import get_kernel  # noqa: F401

    assert "peftplug_kernels" not in hf_kernels.__file__
    x, rot = torch.randn(3, 8), torch.linalg.qr(torch.randn(2, 4, 4)).Q
    assert torch.allclose(ops.block_rotate(x, rot, impl="torch"), x @ torch.block_diag(*rot), atol=1e-6)
