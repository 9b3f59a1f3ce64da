"""Which kernels an OFTv2 adapter runs, resolved once per device instead of on every forward.

The first GPU run (``../shared/gpu/2026-12-04-h200``) measured the per-call dispatch (``resolve_impl`` →
``triton_available`` on every op of every forward) as a large share of a launch-bound step, and dynamo broke the
graph there. So each layer keeps one :class:`KernelPlan` per adapter, built when the adapter is created and
rebuilt when the layer moves (``_apply``), its settings change or ``peftplug_kernels.dispatch_table`` is changed; the
forward only reads it and passes the already-resolved ``"torch"``/``"triton"`` to ``peftplug_kernels.ops``, which
then does no availability check.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from peftplug_kernels import dispatch_table, ops


class KernelPlan(NamedTuple):
    """The resolved kernels of one adapter on one device.

    Args:
        settings: The adapter's ``RotationSettings`` the plan was built from (a plan is stale once they change).
        device: Device of the adapter's parameters when the plan was built (stale when they move).
        cayley: ``impl`` for ``ops.cayley_neumann``: ``"torch"`` or ``"triton"``.
        rotate: ``impl`` for ``ops.block_rotate`` (and the weight rotation of ``oftv2.conv``).
        fused_max_tokens: 4-bit layers only: the largest token count (batch × sequence) that runs the fused
            rotate + dequantize + matmul kernel; ``0`` never fuses, ``FUSE_ALWAYS`` fuses at any size.
        table_generation: ``peftplug_kernels.dispatch_table.generation()`` when the plan was built (stale once the
            per-device table changes).
    """

    settings: Any
    device: torch.device
    cayley: str
    rotate: str
    fused_max_tokens: int = 0
    table_generation: int = 0


# fused_max_tokens of a forced kernel (``kernel_impl="triton"``): fused at any token count.
FUSE_ALWAYS = 2**62


def choose_impl(requested: str, op: str, probe: torch.Tensor, kernel_fits: bool = True) -> str:
    """The implementation one op runs: ``requested`` when forced, the device's choice for ``"auto"``.

    A forced ``"triton"`` is passed on unchanged even where it cannot run, so that the op raises its own error
    (naming why) on the first forward, as before plans existed, and not when the adapter is built (a model may be
    built on CPU and moved to CUDA).

    Args:
        requested: ``"auto"``, ``"torch"`` or ``"triton"`` (the config's ``kernel_impl``).
        op: Kernel sub-package of ``peftplug_kernels`` (e.g. ``"block_rotate"``).
        probe: A tensor on the device the op will run on (an adapter parameter).
        kernel_fits: Whether the Triton kernel supports this layer's shapes; ``"auto"`` picks torch otherwise.
    """
    if requested != "auto":
        return requested
    return ops.resolve_impl("auto", probe, op=op) if kernel_fits else "torch"


def plan_kernels(settings: Any, block_size: int, q_param: torch.Tensor) -> KernelPlan:
    """The plan of a (non-quantized) OFTv2 adapter.

    Args:
        settings: The adapter's ``oftv2.layer.RotationSettings``.
        block_size: Its rotation block size.
        q_param: Its skew parameters (their device decides ``"auto"``).
    """
    cayley_fits = ops.cn_kernel_fits(settings.form, block_size)
    return KernelPlan(
        settings=settings,
        device=q_param.device,
        cayley=choose_impl(settings.impl, "cayley_neumann", q_param, cayley_fits),
        rotate=choose_impl(settings.impl, "block_rotate", q_param),
        table_generation=dispatch_table.generation(),
    )
