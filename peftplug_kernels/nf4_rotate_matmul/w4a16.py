"""Triton W4A16 GEMMs over a bitsandbytes 4-bit weight: the fused forward ``y = (x R) deq(W)ᵀ + b`` and the
backward's ``dX' = dY deq(W)``, laid out like Triton's matmul tutorial (the design: docs/kernels.md, "The NF4
forward from its FLOP/byte table").

``_forward_kernel``: program (token tile, output tile) in grouped order (weight tiles stay in L2 across the
``GROUP_T`` token tiles that share them) × a K split. Per ``BLOCK_K`` (≥ 64) step it loads the x tile and, with
``ROTATE``, rotates it by the ``BLOCK_K / b`` rotation blocks it holds (one batched tf32 tensor-core dot over
``[blocks, BLOCK_T, b]``), then rounds it to x's dtype like the unfused path does. It decodes the ``[BLOCK_N, BLOCK_K]`` weight tile in
registers (:func:`peftplug_kernels.nf4_dequantize.tile.weight_tile`: packed bytes as vectors, the code table in registers,
one scale per row) and accumulates one bf16/fp16 tensor-core dot in fp32. ``SPLIT_K > 1`` adds partial sums into
an fp32 workspace with atomics, so few tokens still fill the GPU. The loads are independent of the accumulator,
so Triton software-pipelines them over ``num_stages`` buffers.

``_grad_input_kernel``: program (token tile, input-feature tile) × an N split. Same tile decode, with the
weight tile in its natural orientation ``[BLOCK_N, BLOCK_K]`` and the reduction over output features.

Both need fp16/bf16 activations, ``K % quant blocksize == 0`` and a quant blocksize divisible by ``BLOCK_K``
(:mod:`peftplug_kernels.nf4_rotate_matmul.fit` says which layers qualify). Weight offsets are int64 per row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from peftplug_kernels._tiles import next_pow2
from peftplug_kernels.block_rotate.triton import block_matmul
from peftplug_kernels.nf4_dequantize.reference import packed_bytes
from peftplug_kernels.nf4_dequantize.tile import cached_state, load_table, weight_tile
from peftplug_kernels.nf4_dequantize.triton import dequantize_4bit
from peftplug_kernels.nf4_rotate_matmul.fit import w4a16_unfit


@triton.jit
def _forward_kernel(
    x_ptr, r_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, bias_ptr, y_ptr,
    T, N, K, stride_xt, stride_rb, stride_yt, k_per_split,
    QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, ROTATE: tl.constexpr, RB: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Builtins only (no tl.cdiv / min): Triton's own @jit helpers fail in the interpreter (docs/kernels.md).
    tiles_t = (T + BLOCK_T - 1) // BLOCK_T
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    in_group = GROUP_T * tiles_n
    first_t = (pid // in_group) * GROUP_T
    group_t = tl.minimum(tiles_t - first_t, GROUP_T)
    pid_t = first_t + (pid % in_group) % group_t
    pid_n = (pid % in_group) // group_t
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < T
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    table = load_table(code_ptr)
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + (k0 + kk)[None, :], mask=row_ok[:, None], other=0.0)
        if ROTATE:
            # The K step holds BLOCK_K / RB whole rotation blocks (k0 % RB == 0): one batched tf32 dot
            # [blocks, BLOCK_T, RB] @ [blocks, RB, RB] over the contiguous R blocks, rounded to x's dtype like
            # the unfused path's rotated input.
            nb = tl.arange(0, BLOCK_K // RB)
            ii = tl.arange(0, RB)
            rt = tl.load(r_ptr + (k0 // RB + nb)[:, None, None] * stride_rb + ii[None, :, None] * RB
                         + ii[None, None, :])
            x3 = tl.permute(tl.reshape(xt.to(tl.float32), (BLOCK_T, BLOCK_K // RB, RB)), (1, 0, 2))
            xr = tl.dot(x3, rt.to(tl.float32), input_precision="tf32")
            xt = tl.reshape(tl.permute(xr, (1, 0, 2)), (BLOCK_T, BLOCK_K)).to(x_ptr.dtype.element_ty)
        w = weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset, table, cols, col_ok, k0, K,
                        QBLOCK, QBLOCK2, NESTED, BLOCK_N, BLOCK_K)
        if FP32_DOT:  # the interpreter's bf16 dot is wrong
            acc += tl.dot(xt.to(tl.float32), tl.trans(w.to(x_ptr.dtype.element_ty).to(tl.float32)))
        else:
            acc += tl.dot(xt, tl.trans(w.to(x_ptr.dtype.element_ty)))
    if HAS_BIAS:  # added once: by the first K split
        first = (pid_k == 0).to(tl.float32)
        acc += (tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * first)[None, :]
    out = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit
def _grad_input_kernel(
    g_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset, out_ptr,
    T, N, K, stride_gt, stride_ot, n_per_split,
    QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr, NESTED: tl.constexpr, SPLIT_N: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    k0 = pid_k * BLOCK_K
    nn = tl.arange(0, BLOCK_N)
    table = load_table(code_ptr)
    acc = tl.full((BLOCK_T, BLOCK_K), 0.0, tl.float32)
    n_begin = pid_s * n_per_split
    for n0 in range(n_begin, n_begin + n_per_split, BLOCK_N):
        ns = (n0 + nn).to(tl.int64)
        n_ok = ns < N
        g = tl.load(g_ptr + rows[:, None] * stride_gt + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        w = weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset, table, ns, n_ok, k0, K,
                        QBLOCK, QBLOCK2, NESTED, BLOCK_N, BLOCK_K).to(g_ptr.dtype.element_ty)
        if FP32_DOT:
            acc += tl.dot(g.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(g, w)
    out = out_ptr + rows[:, None] * stride_ot + (k0 + tl.arange(0, BLOCK_K))[None, :]
    if SPLIT_N == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.atomic_add(out, acc, mask=row_ok[:, None], sem="relaxed")


INTERPRETED = type(_forward_kernel).__name__ == "InterpretedFunction"
# Token counts up to which the single W4A16 kernel runs (forward; backward's dX'), above them rotate once +
# dequantize once + cuBLAS. From the FLOP/byte table in docs/kernels.md; untimed until
# benchmarks/kernels/nf4_sweep.py runs on a GPU (it prints the measured crossover).
FUSED_MAX_TOKENS = 64
FUSED_GRAD_MAX_TOKENS = 64


class W4A16Config(NamedTuple):
    """One launch configuration: tiles, the K (forward) or N (backward) split, warps and pipeline stages, and
    (forward) whether x is rotated once beforehand instead of per output tile in the prologue."""

    block_t: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int
    prerotate: bool = False


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _split(programs: int, steps: int, want: int) -> int:
    """Largest power-of-two split ≤ 16 of ``steps`` loop steps (≥ 2 steps each) with ``programs × split`` ≤ ``want``."""
    split = 1
    while split < 16 and programs * split * 2 <= want and steps % (split * 2) == 0 and steps // (split * 2) >= 2:
        split *= 2
    return split


def resolve(cfg: W4A16Config, tokens: int, steps: int, tiles_out: int, programs_wanted: int) -> W4A16Config:
    """Fills a candidate's automatic fields: ``block_t == 0`` fits the token tile to the tokens (16–64), and
    ``split == 0`` splits the reduction until the grid has ``programs_wanted`` programs.

    Args:
        cfg: A configuration, maybe with zeros.
        tokens: Rows of the activation.
        steps: Loop steps of the whole reduction (forward: K / block_k; dX': ⌈N / block_n⌉).
        tiles_out: Output-feature tiles (forward: ⌈N / block_n⌉; dX': K / block_k).
        programs_wanted: Programs that fill the device.
    """
    block_t = cfg.block_t or min(64, max(16, next_pow2(tokens)))
    split = cfg.split or _split(tiles_out * -(-tokens // block_t), steps, programs_wanted)
    return cfg._replace(block_t=block_t, split=split)


# The candidates the GPU sweep (benchmarks/kernels/nf4_sweep.py) times, ≤ 8 per regime, and that
# benchmarks/kernels/compile_check.py compiles for sm_90; zeros are filled by :func:`resolve`. DEFAULTS are the
# wrappers' choice until a sweep says otherwise.
DECODE_CANDIDATES = (
    W4A16Config(0, 64, 64, 0, 4, 3), W4A16Config(0, 64, 128, 0, 4, 3), W4A16Config(0, 32, 128, 0, 4, 4),
    W4A16Config(0, 128, 64, 0, 4, 3), W4A16Config(0, 64, 64, 0, 8, 4), W4A16Config(0, 64, 64, 1, 4, 3),
    W4A16Config(0, 32, 64, 0, 4, 4), W4A16Config(0, 64, 64, 0, 4, 3, prerotate=True),
)
GEMM_CANDIDATES = tuple(c._replace(prerotate=True) for c in (  # many tokens: rotate x once (the table)
    W4A16Config(128, 128, 64, 1, 8, 3), W4A16Config(128, 64, 64, 1, 4, 3), W4A16Config(64, 128, 64, 1, 4, 3),
    W4A16Config(128, 128, 64, 1, 4, 4), W4A16Config(256, 128, 64, 1, 8, 3), W4A16Config(128, 256, 64, 1, 8, 3),
    W4A16Config(64, 64, 64, 1, 4, 4), W4A16Config(128, 128, 128, 1, 8, 2),
))
GRAD_CANDIDATES = (
    W4A16Config(0, 64, 64, 0, 4, 3), W4A16Config(0, 128, 64, 0, 4, 3), W4A16Config(0, 64, 64, 0, 8, 4),
    W4A16Config(0, 64, 64, 1, 4, 3),
)


@functools.lru_cache(maxsize=1024)  # called per forward: keep Python off the decode path's critical microseconds
def forward_config(tokens: int, n: int, k: int, qblock: int, programs_wanted: int) -> W4A16Config:
    """Default forward tiles: a 16–64-token tile streaming the weight once for few tokens, GEMM tiles for many.

    Args:
        tokens: Rows of x.
        n: Output features.
        k: Input features.
        qblock: Quantization blocksize (``BLOCK_K`` must divide it).
        programs_wanted: Programs that fill the device (2 per multiprocessor).
    """
    if INTERPRETED:  # the interpreter pays per program and per loop step: the biggest tiles
        return W4A16Config(min(128, max(16, next_pow2(tokens))), min(128, max(16, next_pow2(n))),
                           min(128, qblock), 1, 4, 1)
    cfg = DECODE_CANDIDATES[0] if tokens <= 64 else GEMM_CANDIDATES[0]
    cfg = cfg._replace(block_k=min(cfg.block_k, qblock))
    return resolve(cfg, tokens, k // cfg.block_k, -(-n // cfg.block_n), programs_wanted)


@functools.lru_cache(maxsize=1024)
def grad_config(tokens: int, n: int, k: int, qblock: int, programs_wanted: int) -> W4A16Config:
    """Default tiles of ``dX' = dY deq(W)``: output tiles ``[block_t, block_k]``, the N loop split for few tokens.

    Args:
        tokens: Rows of dY.
        n: Output features (the reduction).
        k: Input features.
        qblock: Quantization blocksize.
        programs_wanted: Programs that fill the device.
    """
    if INTERPRETED:
        return W4A16Config(min(128, max(16, next_pow2(tokens))), min(128, max(16, next_pow2(n))),
                           min(128, qblock), 1, 4, 1)
    cfg = GRAD_CANDIDATES[0]._replace(block_k=min(GRAD_CANDIDATES[0].block_k, qblock))
    return resolve(cfg, tokens, -(-n // cfg.block_n), k // cfg.block_k, programs_wanted)


def refuse_unfit(x2: torch.Tensor, quant_state) -> None:
    """Raises the one-line ``ValueError`` of :func:`w4a16_unfit` for a layer these kernels do not take.

    Args:
        x2: The activations (or output gradient) the kernel would read.
        quant_state: The weight's ``QuantState``.
    """
    why = w4a16_unfit(x2.dtype, tuple(quant_state.shape), quant_state)
    if why:
        raise ValueError(f"the W4A16 NF4 kernel cannot run this layer: {why}")


def fused_forward(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                  bias: torch.Tensor | None, config: W4A16Config | None = None) -> torch.Tensor:
    """``y = (x R) deq(W)ᵀ + bias`` with one W4A16 kernel (plus a rotation pass when blocks do not tile K steps).

    Args:
        x2: ``[tokens, in]`` contiguous fp16/bf16 activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` contiguous blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        bias: Optional ``[out]`` bias.
        config: Launch configuration (:func:`forward_config` by default; the GPU sweep passes its candidates).

    Raises:
        ValueError: For a layer :func:`peftplug_kernels.nf4_rotate_matmul.fit.w4a16_unfit` refuses (one line).
    """
    refuse_unfit(x2, quant_state)
    tokens, k = x2.shape
    n = int(quant_state.shape[0])
    b = rotation.shape[-1]
    qs = cached_state(quant_state, x2.device)
    wanted = 2 * _multiprocessors(x2.device)
    if config is not None:  # a K step never crosses a quantization block
        config = config._replace(block_k=min(config.block_k, qs.blocksize))
    cfg = forward_config(tokens, n, k, qs.blocksize, wanted) if config is None else resolve(
        config, tokens, k // config.block_k, -(-n // config.block_n), wanted)
    if tokens == 0:
        return torch.empty(0, n, device=x2.device, dtype=x2.dtype)
    # Rotate in the prologue when each K step holds whole power-of-two rotation blocks (a batched dot needs
    # dimensions >= 16), else rotate x once beforehand (one memory-bound pass).
    rotate_here = not cfg.prerotate and b >= 16 and b & (b - 1) == 0 and cfg.block_k % b == 0
    xin = x2 if rotate_here else block_matmul(x2, rotation)
    steps = k // cfg.block_k
    if steps % cfg.split:
        raise ValueError(f"split {cfg.split} must divide the {steps} K steps of {cfg.block_k}")
    y = (torch.zeros if cfg.split > 1 else torch.empty)(tokens, n, device=x2.device,
                                                       dtype=torch.float32 if cfg.split > 1 else x2.dtype)
    grid = (triton.cdiv(tokens, cfg.block_t) * triton.cdiv(n, cfg.block_n), cfg.split)
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _forward_kernel[grid](
        xin, rotation, packed_bytes(weight), qs.absmax, qs.code, qs.absmax2, qs.code2, qs.offset,
        bias if bias is not None else y, y, tokens, n, k, xin.stride(0), b * b if rotation.shape[0] > 1 else 0,
        y.stride(0), k // cfg.split,
        QBLOCK=qs.blocksize, QBLOCK2=qs.blocksize2, NESTED=qs.nested, ROTATE=rotate_here, RB=b if rotate_here else 16,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split, FP32_DOT=INTERPRETED, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_T=8, **launch,
    )
    return y.to(x2.dtype) if cfg.split > 1 else y


def unfused_forward(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Rotate x once, dequantize W once (one launch each), one cuBLAS matmul: the many-token forward.

    Args:
        x2: ``[tokens, in]`` contiguous activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` contiguous blocks.
        weight: Packed 4-bit weight.
        quant_state: Its ``QuantState``.
        bias: Optional ``[out]`` bias.
    """
    w = dequantize_4bit(weight, quant_state, dtype=x2.dtype)
    return F.linear(block_matmul(x2, rotation), w, None if bias is None else bias.to(x2.dtype))


def grad_rotated_input(grad2: torch.Tensor, weight: torch.Tensor, quant_state,
                       config: W4A16Config | None = None, fused: bool | None = None) -> torch.Tensor:
    """The backward's ``dX' = dY deq(W)`` (``[tokens, in]``, dY's dtype).

    Fused (no dequantized weight in memory) up to :data:`FUSED_GRAD_MAX_TOKENS` tokens, else one-launch
    dequantize + one cuBLAS matmul; layers the W4A16 kernels refuse always take the latter.

    Args:
        grad2: ``[tokens, out]`` contiguous gradient of the output.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its ``QuantState``.
        config: Launch configuration of the fused kernel (:func:`grad_config` by default).
        fused: Force the fused kernel (``True``: a refused layer raises) or the dequantize + matmul (``False``).
    """
    tokens, n = grad2.shape
    k = int(quant_state.shape[1])
    if fused is None:
        fused = tokens <= FUSED_GRAD_MAX_TOKENS and not w4a16_unfit(grad2.dtype, tuple(quant_state.shape),
                                                                      quant_state)
    if not fused:
        return grad2 @ dequantize_4bit(weight, quant_state, dtype=grad2.dtype)
    refuse_unfit(grad2, quant_state)
    qs = cached_state(quant_state, grad2.device)
    wanted = 2 * _multiprocessors(grad2.device)
    if config is not None:
        config = config._replace(block_k=min(config.block_k, qs.blocksize))
    cfg = grad_config(tokens, n, k, qs.blocksize, wanted) if config is None else resolve(
        config, tokens, -(-n // config.block_n), k // config.block_k, wanted)
    if tokens == 0:
        return grad2.new_empty(0, k)
    n_per_split = triton.cdiv(triton.cdiv(n, cfg.block_n), cfg.split) * cfg.block_n
    out = (torch.zeros if cfg.split > 1 else torch.empty)(
        tokens, k, device=grad2.device, dtype=torch.float32 if cfg.split > 1 else grad2.dtype)
    grid = (triton.cdiv(tokens, cfg.block_t), k // cfg.block_k, cfg.split)
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _grad_input_kernel[grid](
        grad2, packed_bytes(weight), qs.absmax, qs.code, qs.absmax2, qs.code2, qs.offset, out,
        tokens, n, k, grad2.stride(0), out.stride(0), n_per_split,
        QBLOCK=qs.blocksize, QBLOCK2=qs.blocksize2, NESTED=qs.nested, SPLIT_N=cfg.split, FP32_DOT=INTERPRETED,
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
    )
    return out.to(grad2.dtype) if cfg.split > 1 else out
