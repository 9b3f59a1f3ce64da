"""The W4A16 NF4 kernels (``peftplug_kernels/nf4_rotate_matmul/w4a16.py``): the fused forward and the backward's
``dX' = dY deq(W)`` against the unfused oracle (``block_rotate`` -> ``bitsandbytes`` dequantize -> matmul), over
the launch shapes they take (prologue rotation and pre-rotation, K and N splits, partial tiles), and their
refusals of layers they do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peftplug_kernels._triton_available import load_kernel_module
from peftplug_kernels.block_rotate.reference import block_rotate
from peftplug_kernels.nf4_rotate_matmul.fit import w4a16_unfit

bnbf = pytest.importorskip("bitsandbytes.functional")
pytestmark = pytest.mark.usefixtures("needs_triton")


def _layer(quantize, device, out_f, in_f, b, dtype, quant_type="nf4", nested=True, blocksize=64, shared=False):
    _, packed, state = quantize((out_f, in_f), dtype, quant_type, nested, blocksize, device, seed=out_f + b)
    rot = torch.linalg.qr(torch.randn(1 if shared else in_f // b, b, b, device=device))[0].contiguous()
    return packed, state, rot


@pytest.mark.parametrize(
    ("tokens", "out_f", "in_f", "b", "quant_type", "nested", "blocksize", "shared", "cfg"),
    [
        (5, 48, 256, 32, "nf4", True, 64, False, (16, 16, 64, 1)),  # prologue rotation, 3 output tiles, 4 K steps
        (5, 48, 256, 32, "nf4", True, 64, False, (16, 32, 64, 2)),  # split-K (fp32 atomics), partial output tile
        (5, 48, 128, 32, "nf4", True, 64, False, (16, 32, 64, 1, True)),  # x rotated once beforehand (asked)
        (20, 40, 128, 16, "fp4", False, 128, True, (16, 32, 128, 1)),  # shared block, 2 token tiles, qblock 128
        (3, 32, 192, 24, "nf4", True, 64, False, (16, 32, 64, 1)),  # block 24: x rotated once beforehand
        (33, 16, 128, 64, "nf4", False, 64, False, None),  # block 64, the default launch
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_forward_matches_oracle(device, close, quantize, tokens, out_f, in_f, b, quant_type, nested, blocksize,
                                      shared, cfg, dtype):
    kernels = load_kernel_module("nf4_rotate_matmul")
    packed, state, rot = _layer(quantize, device, out_f, in_f, b, dtype, quant_type, nested, blocksize, shared)
    x = torch.randn(tokens, in_f, device=device, dtype=dtype)
    bias = torch.randn(out_f, device=device, dtype=dtype)
    config = None if cfg is None else kernels.W4A16Config(*cfg[:4], 4, 3, *cfg[4:])
    y = kernels.fused_forward(x, rot, packed, state, bias, config=config)
    expected = F.linear(block_rotate(x, rot), bnbf.dequantize_4bit(packed, state).to(dtype), bias)
    assert y.shape == expected.shape and y.dtype == dtype
    close(y, expected, dtype, "y")


@pytest.mark.parametrize(("tokens", "out_f", "in_f", "cfg"), [(7, 80, 128, (16, 32, 64, 1)),
                                                              (18, 96, 192, (16, 32, 64, 2)),
                                                              (3, 40, 64, None)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_grad_input_matches_oracle(device, close, quantize, tokens, out_f, in_f, cfg, dtype):
    kernels = load_kernel_module("nf4_rotate_matmul")
    packed, state, _ = _layer(quantize, device, out_f, in_f, 32, dtype)
    grad = torch.randn(tokens, out_f, device=device, dtype=dtype)
    config = None if cfg is None else kernels.W4A16Config(*cfg, 4, 3)
    got = kernels.grad_rotated_input(grad, packed, state, config=config, fused=True)
    expected = grad @ bnbf.dequantize_4bit(packed, state).to(dtype)
    close(got, expected, dtype, "dX'")
    # The unfused branch (many tokens, or forced) gives the same.
    close(kernels.grad_rotated_input(grad, packed, state, fused=False), expected, dtype, "dX' unfused")


def test_rotate_dequant_matmul_takes_each_path(device, close, quantize):
    """Few tokens: the fused kernel; many: rotate + dequantize + matmul; fp32: refused at any token count."""
    kernels = load_kernel_module("nf4_rotate_matmul")
    for tokens in (kernels.FUSED_MAX_TOKENS, kernels.FUSED_MAX_TOKENS + 1):
        packed, state, rot = _layer(quantize, device, 32, 128, 32, torch.bfloat16)
        x = torch.randn(tokens, 128, device=device, dtype=torch.bfloat16)
        expected = F.linear(block_rotate(x, rot), bnbf.dequantize_4bit(packed, state).to(torch.bfloat16))
        close(kernels.rotate_dequant_matmul(x, rot, packed, state, None), expected, torch.bfloat16, f"{tokens} tokens")
    packed, state, rot = _layer(quantize, device, 32, 128, 32, torch.float32)
    for tokens in (4, kernels.FUSED_MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="cannot run this layer: its tensor-core dots take float16/bfloat16"):
            kernels.rotate_dequant_matmul(torch.randn(tokens, 128, device=device), rot, packed, state, None)


def test_layers_the_w4a16_kernels_refuse(device, quantize):
    kernels = load_kernel_module("nf4_rotate_matmul")
    packed, state, rot = _layer(quantize, device, 16, 96, 32, torch.float16)  # 96 % 64: blocks straddle rows
    assert "not a multiple of the quantization blocksize 64" in w4a16_unfit(torch.float16, (16, 96), state)
    assert "float16/bfloat16" in w4a16_unfit(torch.float32, (16, 128), state)
    x = torch.randn(2, 96, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot run this layer: the input width 96") as err:
        kernels.fused_forward(x, rot, packed, state, None)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot run this layer"):
        kernels.grad_rotated_input(torch.randn(2, 16, device=device, dtype=torch.float16), packed, state, fused=True)
    _, small_blocks, _ = _layer(quantize, device, 16, 128, 32, torch.float16, blocksize=32)
    assert "power of two >= 64, got 32" in w4a16_unfit(torch.float16, (16, 128), small_blocks)

    class Int8State:  # not a 4-bit state: no 16-entry code table
        blocksize, code = 64, torch.zeros(256)

    assert "16-entry" in w4a16_unfit(torch.float16, (16, 128), Int8State())
