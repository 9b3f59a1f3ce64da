"""Third review: QOFT 4-bit layers whose quantization blocks straddle weight rows (in_features not a multiple of the
blocksize), on CPU.

bitsandbytes 0.50's CPU 4-bit kernels (``dequantize_4bit`` and the no-grad ``gemm_4bit``) restart the quantization
blocks at every row for even widths, but its quantizer (and its CUDA kernels) lay the blocks over the flat weight:
on such a layer bitsandbytes' CPU forward multiplies by a scrambled weight (27 % off at in_features 96, blocksize
64). A QOFT layer's forward, its gradients, its disabled-adapter forward and its merged forward must still be
``x R deq(W)ᵀ + b`` with ``deq(W)`` the stored format (decoded here by hand, fp64).
"""

from __future__ import annotations

import peft
import pytest
import torch
from test_numerics_review2_dequant import _decode, _Wrapper

import oftv2
from oftv2 import bnb as qoft
from peftplug.quantized_layout import keep_exact_4bit_layout

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BLOCK = 16


def _linear4bit(in_f: int, out_f: int, blocksize: int, nested: bool, compute: torch.dtype | None, device: str):
    gen = torch.Generator().manual_seed(0)
    layer = bnb.nn.Linear4bit(in_f, out_f, bias=True, compute_dtype=compute, compress_statistics=nested,
                              quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(out_f, in_f, generator=gen) * 0.1, requires_grad=False,
                                     blocksize=blocksize, compress_statistics=nested, quant_type="nf4", module=layer)
    layer.bias = torch.nn.Parameter(torch.randn(out_f, generator=gen) * 0.1)
    layer = layer.to(device)
    keep_exact_4bit_layout(layer)
    return layer


def _decoded(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's stored weight decoded by hand over the flat row-major layout (fp64; the numerics review's)."""
    return _decode(layer.weight.data, layer.weight.quant_state)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("in_f", "blocksize", "nested", "compute"), [
    (96, 64, True, torch.float32),
    (96, 64, False, torch.bfloat16),
    (192, 128, True, torch.float32),
    (160, 64, False, None),  # compute dtype set from the first input, as bitsandbytes does
])
def test_forward_and_gradients_use_the_stored_weight(device, in_f, blocksize, nested, compute):
    base = _linear4bit(in_f, 48, blocksize, nested, compute, device)
    weight, bias = _decoded(base), base.bias.detach().double().cpu()
    model = peft.get_peft_model(_Wrapper(base), oftv2.OFTv2Config(block_size=BLOCK, target_modules=["proj"],
                                                                  kernel_impl="auto"))
    layer = model.base_model.model.proj
    assert isinstance(layer, qoft.Linear4bit)
    with torch.no_grad():
        layer.oftv2_Q["default"].copy_(torch.randn(layer.oftv2_Q["default"].shape,
                                                   generator=torch.Generator().manual_seed(1)) * 0.05)
    model.train()
    x = torch.randn(2, 3, in_f, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    y = model(x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
    (y.float() * grad).sum().backward()

    q64 = layer.oftv2_Q["default"].detach().double().cpu().requires_grad_()
    x64 = x.detach().double().cpu().requires_grad_()
    expected = x64 @ _dense_rotation(q64, layer) @ weight.T + bias
    (expected * grad.double().cpu()).sum().backward()
    tol = 1e-5 if (compute or torch.float32) == torch.float32 else 2e-2
    errors = {"y": _rel(y, expected), "dX": _rel(x.grad, x64.grad), "dQ": _rel(layer.oftv2_Q["default"].grad,
                                                                              q64.grad)}
    assert max(errors.values()) < tol, errors

    # Adapters disabled, and merged: the base's stored weight too (bitsandbytes' CPU forward scrambled both).
    x_eval = x.detach()[:1]
    with torch.no_grad(), model.disable_adapter():
        assert _rel(model(x_eval), x_eval.double().cpu() @ weight.T + bias) < tol
    model.eval()
    with torch.no_grad():
        unmerged = model(x_eval)
        layer.merge()
        assert _rel(model(x_eval), unmerged) < 0.1  # one requantization of the rotated weight
        assert _rel(model(x_eval), x_eval.double().cpu() @ _decoded(base).T + bias) < tol


def _dense_rotation(q64: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """The adapter's block-diagonal R from fp64 triangles, by the Taylor series ``I + 2 Σ_{k<terms} Qᵏ``."""
    rows, cols = torch.triu_indices(BLOCK, BLOCK, 1)
    upper = q64.new_zeros(q64.shape[0], BLOCK, BLOCK)
    upper[:, rows, cols] = q64
    skew = upper - upper.transpose(-1, -2)
    rotation, power = torch.eye(BLOCK, dtype=q64.dtype).repeat(q64.shape[0], 1, 1), None
    for _ in range(layer.oftv2_settings["default"].terms - 1):
        power = skew if power is None else power @ skew
        rotation = rotation + 2 * power
    return torch.block_diag(*rotation.unbind(0))
