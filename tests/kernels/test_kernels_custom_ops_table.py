"""The per-device dispatch table: what ``impl="auto"`` chooses, the measurement behind each choice, and the
``ValueError`` for an unknown op, kernel or device kind."""

from __future__ import annotations

import pytest
import torch

from peftplug_kernels import dispatch_table as table
from peftplug_kernels import ops


@pytest.fixture
def restore_table(monkeypatch):
    """Overrides write into ``TABLE``; give every test its own copy of the dict."""
    monkeypatch.setattr(table, "TABLE", dict(table.TABLE))


@pytest.fixture
def as_h200(monkeypatch):
    """``cuda:0`` reads as an sm_90 device (no GPU here: the capability cache is filled by hand)."""
    monkeypatch.setitem(table._KIND_BY_DEVICE, torch.device("cuda", 0), "cuda:sm_90")


def test_every_entry_is_complete_and_cites_its_measurement():
    for kind, entry in table.TABLE.items():
        assert set(entry.choices) == set(table.OPS), kind
        for op, choice in entry.choices.items():
            assert choice.kernel in table.KERNELS, (kind, op)
            assert choice.evidence, (kind, op)
        assert entry.fused_nf4_max_tokens >= 0
    for op in table.OPS:  # the GPU entries name the run they come from
        assert "2026-12-04" in table.TABLE["cuda:sm_90"].choices[op].evidence
    assert "2026-12-04" in table.TABLE["cuda:sm_90"].fused_evidence


def test_cpu_always_runs_the_reference():
    for op in table.OPS:
        assert table.kernel_choice(op, "cpu") == "torch"
    assert table.fused_nf4_max_tokens(torch.device("cpu")) == 0
    assert table.device_kind("meta") == "cpu"


def test_h200_choices_follow_its_measurements(as_h200):
    # Cayley–Neumann Triton 0.058 / 0.270 ms vs torch 0.160 / 0.898; the fused NF4 kernel slower at every size.
    assert table.device_kind("cuda:0") == "cuda:sm_90"
    assert table.kernel_choice("cayley_neumann", "cuda:0") == "triton"
    assert table.kernel_choice("block_rotate", "cuda:0") == "triton"
    assert table.kernel_choice("nf4_rotate_matmul", "cuda:0") == "torch"
    assert table.fused_nf4_max_tokens("cuda:0") == 0
    assert "0.270" in table.evidence("cayley_neumann", "cuda:0")
    assert "never" in table.evidence("fused_nf4_max_tokens", "cuda:0")


def test_unmeasured_gpu_falls_back_to_the_cuda_default(monkeypatch):
    monkeypatch.setitem(table._KIND_BY_DEVICE, torch.device("cuda", 1), "cuda:sm_80")
    assert table.device_kind("cuda:1") == "cuda"
    assert table.fused_nf4_max_tokens("cuda:1") == 0
    assert "not measured on this architecture" in table.evidence("block_rotate", "cuda:1")


@pytest.mark.usefixtures("restore_table")
def test_overrides_and_their_errors(as_h200, monkeypatch):
    table.set_choice("cuda:sm_90", "block_rotate", "torch", "my A100 run, 2027-01-01")
    assert table.kernel_choice("block_rotate", "cuda:0") == "torch"
    table.set_fused_nf4_max_tokens("cuda:sm_90", 16, "a faster fused kernel, 2027-01-01")
    assert table.fused_nf4_max_tokens("cuda:0") == 16
    with pytest.raises(ValueError, match=r"kernel must be one of \('torch', 'triton'\), got 'cuda'"):
        table.set_choice("cuda:sm_90", "block_rotate", "cuda", "")
    with pytest.raises(ValueError, match=r"op must be one of \('block_rotate', 'cayley_neumann', 'dequantize_4bit'"):
        table.set_choice("cuda:sm_90", "rotate", "torch", "")
    with pytest.raises(ValueError, match=r"device kind must be one of \('cuda:sm_90', 'cuda', 'cpu'\)"):
        table.set_choice("cuda:sm_80", "block_rotate", "torch", "")
    with pytest.raises(ValueError, match="tokens must be an integer >= 0"):
        table.set_fused_nf4_max_tokens("cuda:sm_90", -1, "")
    with pytest.raises(ValueError, match="op must be one of"):
        table.kernel_choice("matmul", "cpu")
    table.add_device_kind("cuda:sm_80", like="cuda:sm_90")
    monkeypatch.setitem(table._KIND_BY_DEVICE, torch.device("cuda", 1), "cuda:sm_80")
    assert table.device_kind("cuda:1") == "cuda:sm_80"
    assert table.kernel_choice("block_rotate", "cuda:1") == "torch"
    with pytest.raises(ValueError, match="kind must look like 'cuda:sm_80'"):
        table.add_device_kind("a100")


@pytest.mark.usefixtures("restore_table")
def test_an_unknown_kernel_written_into_the_table_is_refused_when_read():
    entry = table.TABLE["cpu"]
    bad = dict(entry.choices, block_rotate=table.Choice("cutlass", "hand-edited"))
    table.TABLE["cpu"] = table.DeviceEntry(bad, entry.fused_nf4_max_tokens, entry.fused_evidence)
    with pytest.raises(ValueError, match=r"kernel for 'block_rotate' must be one of \('torch', 'triton'\)"):
        table.kernel_choice("block_rotate", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_follows_the_table():
    from peftplug_kernels._triton_available import triton_available

    x = torch.zeros(2, device="cuda")
    for op in ("block_rotate", "cayley_neumann", "nf4_rotate_matmul"):
        expected = table.kernel_choice(op, x.device) if triton_available() else "torch"
        assert ops.resolve_impl("auto", x, op=op) == expected
    assert ops.resolve_impl("auto", x, op="nf4_dequantize") == (
        table.kernel_choice("dequantize_4bit", x.device) if triton_available() else "torch")


def test_nf4_auto_unfused_composes_the_reference(quantize):
    # Unfused under auto, nf4_rotate_matmul runs rotate -> dequantize -> matmul with each piece's own auto choice:
    # on CPU exactly the reference.
    _, packed, state = quantize((24, 64), torch.float32, "nf4", True)
    x, rot = torch.randn(5, 64), torch.linalg.qr(torch.randn(4, 16, 16))[0]
    bias = torch.randn(24)
    torch.testing.assert_close(ops.nf4_rotate_matmul(x, rot, packed, state, bias),
                               ops.nf4_rotate_matmul(x, rot, packed, state, bias, impl="torch"), rtol=0, atol=0)
