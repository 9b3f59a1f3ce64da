"""What every autograd Function of this package wraps its forward and backward in: autocast off, first order only.

Autocast. The Functions choose their own compute dtypes.

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

First order only. The hand-written backwards compute from saved tensors without a graph of their own, so a
``create_graph=True`` backward through them (Hessian-vector products, gradient penalties) gave wrong second
derivatives silently on some paths and an unrelated error on others. An eager backward with grad mode on (which
autograd sets only for ``create_graph=True``) now stops with one line saying so; ``torch.autograd.function.
once_differentiable`` would say the same later, in the second backward, at the cost of a wrapper per call.
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


def guarded_forward(method: Callable) -> Callable:
    """Wraps an autograd Function's ``forward(ctx, ...)`` to run with autocast disabled on the device of its first
    tensor argument (no context is entered when autocast is off there).

    Args:
        method: The static method, taking ``ctx`` first.
    """

    @functools.wraps(method)
    def run(ctx, *args):
        device = _first_device_type(args)
        if device is None:
            return method(ctx, *args)
        return call_without_autocast(device, method, ctx, *args)

    return run


def guarded_backward(method: Callable) -> Callable:
    """:func:`guarded_forward` for a ``backward(ctx, ...)``, in eager mode only, which also refuses
    ``create_graph=True`` (module docstring).

    Args:
        method: The static method, taking ``ctx`` first.
    """
    guarded = guarded_forward(method)

    @functools.wraps(method)
    def run(ctx, *args):
        if torch.compiler.is_compiling():
            return method(ctx, *args)
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: peftplug's OFTv2 kernels have first-order gradients "
                "only; a create_graph=True backward (double backward, Hessian-vector products) is not supported")
        return guarded(ctx, *args)

    return run


def call_without_autocast(device_type: str, function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` with autocast disabled on ``device_type`` when it is on there: the guard of the
    Functions above, and of the composed torch references (exact Cayley, PEFT's product form, longer series,
    ``block_rotate``'s reference), whose products autocast would run in its dtype.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        function: The reference to call.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.
    """
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return function(*args, **kwargs)
    return function(*args, **kwargs)
