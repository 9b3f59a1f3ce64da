"""The kernels as ``torch.library`` custom ops: ``opcheck`` of every op (Triton in interpreter mode on CPU), the
ops against the reference, the eager bypass against the dispatcher, and ``torch.compile(fullgraph=True)`` over the
public ops on the torch and Triton paths with zero graph breaks."""

from __future__ import annotations

import warnings

import pytest
import torch

from peftplug_kernels import library, ops
from peftplug_kernels._triton_available import triton_available
from peftplug_kernels.block_rotate import reference as rotate_ref
from peftplug_kernels.cayley_neumann import reference as cn_ref
from peftplug_kernels.nf4_dequantize import reference as deq_ref
from peftplug_kernels.quant_state import flatten_quant_state, state_view

peftplug = torch.ops.peftplug


def _rot(n_blocks, b, device, grad=True):
    return torch.linalg.qr(torch.randn(n_blocks, b, b, device=device))[0].requires_grad_(grad)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize(("lead", "n_blocks", "b", "transpose"), [((5,), 2, 16, False), ((2, 3), 1, 16, True)])
def test_opcheck_block_rotate(device, lead, n_blocks, b, transpose):
    x = torch.randn(*lead, 2 * b, device=device, requires_grad=True)
    torch.library.opcheck(peftplug.block_rotate, (x, _rot(n_blocks, b, device), transpose))
    grad = torch.randn_like(x)
    torch.library.opcheck(peftplug.block_rotate_grad_rotation, (x.detach(), grad, n_blocks, b))
    torch.library.opcheck(peftplug.block_rotate_backward, (x.detach(), grad, _rot(n_blocks, b, device, grad=False)))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("form", ["cayley_neumann", "peft_cn"])
def test_opcheck_cayley_neumann(device, form):
    q = (0.1 * torch.randn(3, cn_ref.triangle_size(16), device=device)).requires_grad_(True)
    torch.library.opcheck(peftplug.cayley_neumann, (q, 16, 4, form))
    torch.library.opcheck(peftplug.cayley_neumann_backward, (q.detach(), torch.randn(3, 16, 16, device=device), 4,
                                                             form))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("nested", [False, True])
def test_opcheck_4bit_ops(device, quantize, nested):
    # fp16: the fused kernels' activations (fp32 layers are refused by rule and never reach the op).
    _, packed, state = quantize((24, 64), torch.float16, "nf4", nested, device=device)
    flat = flatten_quant_state(state)
    torch.library.opcheck(peftplug.dequantize_4bit, (packed, *flat, torch.float16))
    x = torch.randn(3, 64, device=device, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(24, device=device, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(peftplug.nf4_rotate_matmul, (x, _rot(4, 16, device), packed, *flat, bias))
    torch.library.opcheck(peftplug.nf4_grad_rotated_input,
                          (torch.randn(2, 3, 24, device=device, dtype=torch.float16), packed, *flat))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("tokens", [3, 80])  # the fused dY deq(W) kernel (<= 64 tokens), dequantize + matmul above
def test_nf4_backward_op_matches_reference(device, quantize, tokens):
    # bf16 activations and blocksize 64 (the W4A16 kernels' smallest K step): layers the fused backward takes.
    _, packed, state = quantize((32, 128), torch.bfloat16, "nf4", True, device=device, blocksize=64)
    flat = flatten_quant_state(state)
    grad = torch.randn(tokens, 32, device=device, dtype=torch.bfloat16)
    got = peftplug.nf4_grad_rotated_input(grad, packed, *flat)
    expected = grad.float() @ deq_ref.dequantize_4bit(packed, state).float()
    assert got.shape == (tokens, 128) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_flat_quant_state_round_trips(quantize):
    for nested in (False, True):
        _, packed, state = quantize((8, 96), torch.float32, "fp4", nested)
        view = state_view(*flatten_quant_state(state))
        torch.testing.assert_close(deq_ref.dequantize_4bit(packed, view), deq_ref.dequantize_4bit(packed, state),
                                   rtol=0, atol=0)


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("transpose", [False, True])
def test_block_rotate_op_gradients_match_reference(device, close, transpose):
    # opcheck compares the op with itself; this checks the registered backward against autograd of the reference,
    # including the transposed form the backward itself calls.
    x = torch.randn(7, 48, device=device, requires_grad=True)
    rot = _rot(3, 16, device)
    grad = torch.randn(7, 48, device=device)
    expected_out = rotate_ref.block_rotate(x, rot.transpose(-1, -2) if transpose else rot)
    expected = torch.autograd.grad(expected_out, (x, rot), grad)
    out = peftplug.block_rotate(x, rot, transpose)
    # Both gradients (one fused backward kernel when not transposed), then each alone (the single kernels).
    for name, got, e in zip(("dX", "dR"), torch.autograd.grad(out, (x, rot), grad, retain_graph=True), expected):
        close(got, e, torch.float32, name)
    close(torch.autograd.grad(out, x, grad, retain_graph=True)[0], expected[0], torch.float32, "dX alone")
    close(torch.autograd.grad(out, rot, grad)[0], expected[1], torch.float32, "dR alone")


@pytest.mark.usefixtures("needs_triton")
def test_eager_bypass_equals_dispatcher(device, monkeypatch, quantize):
    _, packed, state = quantize((16, 64), torch.float16, "nf4", True, device=device)
    q = (0.1 * torch.randn(4, cn_ref.triangle_size(16), device=device)).requires_grad_(True)
    x = torch.randn(4, 64, device=device, dtype=torch.float16, requires_grad=True)
    results = []
    for bypass in (True, False):
        monkeypatch.setattr(library, "EAGER_BYPASS", bypass)
        rot = ops.cayley_neumann(q, 16, impl="triton")
        y = ops.nf4_rotate_matmul(ops.block_rotate(x, rot, impl="triton"), rot, packed, state, impl="triton")
        w = ops.dequantize_4bit(packed, state, impl="triton")
        results.append([y, w, *torch.autograd.grad(y.square().sum(), (x, q))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _layer(x, q, impl):
    rot = ops.cayley_neumann(q, 16, terms=5, impl=impl)
    return ops.block_rotate(x, rot, impl=impl).square().sum()


@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
def test_ops_compile_fullgraph_without_breaks(device, impl):
    if impl == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    torch._dynamo.reset()
    q = (0.1 * torch.randn(2, cn_ref.triangle_size(16), device=device)).requires_grad_(True)
    x = torch.randn(3, 32, device=device, requires_grad=True)
    explained = torch._dynamo.explain(_layer)(x, q, impl)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    loss = compiled(x, q, impl)
    grads = torch.autograd.grad(loss, (x, q))
    eager_loss = _layer(x, q, impl)
    torch.testing.assert_close(loss, eager_loss)
    for g, e in zip(grads, torch.autograd.grad(eager_loss, (x, q))):
        torch.testing.assert_close(g, e)
    if impl == "triton":  # the kernels ran as custom ops, not through a fallback
        graph = str(explained.graphs[0].graph)
        assert "peftplug.cayley_neumann" in graph and "peftplug.block_rotate" in graph


@pytest.mark.usefixtures("needs_triton")
def test_4bit_ops_compile_fullgraph(device, quantize):
    torch._dynamo.reset()
    _, packed, state = quantize((16, 64), torch.float16, "nf4", True, device=device)
    rot = _rot(4, 16, device)
    x = torch.randn(3, 64, device=device, dtype=torch.float16, requires_grad=True)

    def fused(x, rot):
        return ops.nf4_rotate_matmul(x, rot, packed, state, impl="triton").sum() + ops.dequantize_4bit(
            packed, state, impl="triton").sum()

    explained = torch._dynamo.explain(fused)(x, rot)
    assert explained.graph_break_count == 0, explained.break_reasons
    loss = torch.compile(fused, fullgraph=True, backend="aot_eager")(x, rot)
    grads = torch.autograd.grad(loss, (x, rot))
    eager = fused(x, rot)
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, torch.autograd.grad(eager, (x, rot))):
        torch.testing.assert_close(g, e)


def test_triton_available_is_a_compile_constant():
    def probe(x):
        return x * 2 if triton_available() else x + 1

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch._dynamo.explain(probe)(torch.ones(2)).graph_break_count == 0
    # Called at trace time as a constant, not traced through (dynamo warns when it traces into an lru_cache).
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def test_resolved_impl_skips_the_availability_check(monkeypatch):
    # The hot path: impl="torch" never asks whether Triton is there; "auto" and a forced "triton" do.
    calls = []
    monkeypatch.setattr(ops, "resolve_impl", lambda *a, **k: calls.append(a) or "torch")
    x, rot = torch.randn(2, 8), _rot(2, 4, "cpu", grad=False)
    ops.block_rotate(x, rot, impl="torch")
    ops.cayley_neumann(torch.zeros(2, 6), 4, impl="torch")
    assert calls == []
    ops.block_rotate(x, rot, impl="auto")
    assert len(calls) == 1


def test_offset_read_once_per_tensor_version(quantize):
    # The double-quantization offset is read from the device once per tensor (a sync per call stalled the GPU and
    # breaks CUDA-graph capture), and read again after an in-place change.
    _, _, state = quantize((8, 64), torch.float32, "nf4", True)
    first = deq_ref.kernel_quant_state(state, state.absmax.device).offset
    assert first == pytest.approx(float(state.offset)) and state.offset in deq_ref._OFFSETS
    with torch.no_grad():
        state.offset.add_(1.0)
    assert deq_ref.kernel_quant_state(state, state.absmax.device).offset == pytest.approx(first + 1.0)


@pytest.mark.usefixtures("needs_triton")
def test_kernel_state_cache_follows_an_in_place_offset_change(quantize):
    # The per-state cache the Triton kernels read sits in front of the offset read above: it must go stale too.
    from peftplug_kernels.nf4_dequantize.tile import cached_state

    _, _, state = quantize((8, 64), torch.float32, "nf4", True)
    first = cached_state(state, state.absmax.device).offset
    with torch.no_grad():
        state.offset.add_(1.0)
    assert cached_state(state, state.absmax.device).offset == pytest.approx(first + 1.0)
