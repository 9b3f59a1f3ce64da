"""The fused NF4 forward and backward entry points (the kernels live in ``w4a16.py``).

``rotate_dequant_matmul`` (what ``function.py`` and the custom op call) runs, for a layer the W4A16 kernels take
(:func:`peftplug_kernels.nf4_rotate_matmul.fit.w4a16_unfit`):
  - up to :data:`FUSED_MAX_TOKENS` tokens, :func:`fused_forward`: one launch of the W4A16 kernel, which rotates
    the x tile in its prologue and streams the packed weight once;
  - above, :func:`unfused_forward`: rotate x once, dequantize W once, one cuBLAS matmul. Decoding the weight
    inside a GEMM's K loop costs once per token tile, which at many tokens outweighs the GEMM itself
    (docs/kernels.md, "The NF4 forward from its FLOP/byte table").
Other layers (fp32 activations, quantization blocks straddling rows or narrower than 64, no 4-bit code table) are
refused with a one-line ``ValueError``: dispatch (``ops.nf4_rotate_matmul``, the QOFT layer's kernel plan) sends
them to the unfused path by the same rule before any kernel loads. The first, general fused kernel that ran them
(code-table gathers per element, 0.46 ms at 16 tokens on an H200 against 0.21 for dequantize + matmul) is retired:
no measurement ever found it faster than not fusing. :func:`grad_rotated_input` is the backward's ``dX' = dY deq(W)``.
"""

from __future__ import annotations

import torch

from peftplug_kernels.nf4_rotate_matmul.w4a16 import (  # noqa: F401  (re-exported for function.py, benchmarks, tests)
    DECODE_CANDIDATES,
    FUSED_GRAD_MAX_TOKENS,
    FUSED_MAX_TOKENS,
    GEMM_CANDIDATES,
    GRAD_CANDIDATES,
    INTERPRETED,
    W4A16Config,
    fused_forward,
    grad_rotated_input,
    refuse_unfit,
    unfused_forward,
)


def rotate_dequant_matmul(x2: torch.Tensor, rotation: torch.Tensor, weight: torch.Tensor, quant_state,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Forward on a 2-D input by the rule in the module docstring.

    Args:
        x2: ``[tokens, in]`` contiguous fp16/bf16 activations.
        rotation: ``[in / b, b, b]`` or ``[1, b, b]`` contiguous blocks.
        weight: Packed 4-bit weight of an ``out × in`` matrix.
        quant_state: Its bitsandbytes ``QuantState`` (read by attribute).
        bias: Optional ``[out]`` bias.

    Returns:
        ``[tokens, out]`` in ``x2``'s dtype.

    Raises:
        ValueError: For a layer the W4A16 kernels do not take (one line saying why), at any token count.
    """
    refuse_unfit(x2, quant_state)
    if x2.shape[0] <= FUSED_MAX_TOKENS:
        return fused_forward(x2, rotation, weight, quant_state, bias)
    return unfused_forward(x2, rotation, weight, quant_state, bias)
