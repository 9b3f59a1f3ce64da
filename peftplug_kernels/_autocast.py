"""Autograd Functions of this package run with autocast off: they choose their own compute dtypes.

Under ``torch.autocast`` (Lightning's ``precision: bf16-mixed``, HF ``Trainer(bf16=True)``) the products inside a
Function would otherwise run in the autocast dtype while the buffers and operands the Function prepared stay in the
dtype it chose: ``bmm(..., out=fp32 buffer)`` refused a bf16 result, a shared block's fp32 rotation met a bf16
gradient. Our Functions already compute half-precision inputs in fp32 and round once (docs/kernels.md), which is
what autocast asks of precision-sensitive ops anyway.

Autograd runs a backward under the autocast state of the thread that called ``backward()`` (inside the ``with
autocast`` block in some training loops), so eager backwards get the same guard. Under ``torch.compile`` only the
forward has it. A guarded backward stopped dynamo ("Global autocast(cpu)_enabled state changed while dynamo tracing")
when the compiled callable entered autocast itself, and, entered unconditionally as ``torch.amp.custom_bwd`` does,
failed Inductor's lowering with mixed bf16/fp32 operands when a compiled model was called under autocast (as
Lightning and HF ``Trainer`` call it). Unguarded, AOTAutograd traces the backward's products in the autocast dtype:
compiled gradients then agree with eager ones to bf16 precision, not bit for bit (tests/oftv2/test_oftv2_autocast.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def _first_device_type(args: tuple) -> str | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
    return None


def autocast_off(method: Callable) -> Callable:
    """Wraps an autograd Function's ``forward(ctx, ...)`` to run with autocast disabled on the device of its first
    tensor argument (no context is entered when autocast is off there).

    Args:
        method: The static method, taking ``ctx`` first.
    """

    @functools.wraps(method)
    def run(ctx, *args):
        device = _first_device_type(args)
        if device is not None and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return method(ctx, *args)
        return method(ctx, *args)

    return run


def autocast_off_backward(method: Callable) -> Callable:
    """:func:`autocast_off` for a ``backward(ctx, ...)``, in eager mode only (module docstring).

    Args:
        method: The static method, taking ``ctx`` first.
    """
    guarded = autocast_off(method)

    @functools.wraps(method)
    def run(ctx, *args):
        if torch.compiler.is_compiling():
            return method(ctx, *args)
        return guarded(ctx, *args)

    return run
