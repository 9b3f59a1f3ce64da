"""Stacked rotations: the Cayley–Neumann series of every OFTv2 layer of a model as one batch per model forward.

Each OFTv2 layer computes its rotation blocks from its own parameters on every forward: on the torch path 6 kernel
calls forward and 8 backward per layer besides the rotation itself, which on a GPU are launches the step waits for
(docs/benchmarks/oftv2_overhead.md). :func:`stack_rotations` adds a forward pre-hook to a model that computes the
blocks of all its eligible adapters at once, grouped by block size, series length, dtype and device
(``peftplug_kernels.cayley_rotate.stacked``), hands each layer its slice, and a forward hook that drops them when
the forward ends. A layer then only rotates: 2 calls forward, 3 backward.

Eligible: adapters with the Taylor form (``orthogonalization="cayley_neumann"``, ``neumann_terms`` 2–5) and
``kernel_impl`` ``"auto"`` or ``"torch"`` that rotate the layer's input (Linear, Embedding, bitsandbytes layers
when not fused with the 4-bit matmul, Conv2d with ``conv_evaluation="input"``), except a shared block with block
dropout. The others, and every layer called outside the hooked model's forward, compute their own rotation as
before: the results are the same either way (tests/oftv2/test_oftv2_stacking.py).

Not stacked (the hook computes nothing) while gradient checkpointing is on (a recomputed layer must repeat the ops of
its first forward) or when the adapter parameters are sharded (FSDP2 gathers them layer by layer). Layers inside a
checkpoint the hook cannot see (a hand-placed ``torch.utils.checkpoint``, ``checkpoint_wrapper``) compute their own
series (:mod:`oftv2.activation_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from peftplug_kernels.cayley_rotate.function import compute_dtype, supports
from peftplug_kernels.cayley_rotate.stacked import stacked_rotations

from .conv import Conv2d
from .layer import STACKED_ATTR, OFTv2Layer, bound_q
from .rotation_cache import cache_usable


def eligible(layer: OFTv2Layer, adapter_name: str, q_param: torch.Tensor | None = None) -> bool:
    """Whether the stacked path computes this adapter's rotation (see the module docstring).

    Args:
        layer: An OFTv2 layer.
        adapter_name: One of its adapters.
        q_param: Its parameter when the caller holds it already (saves a lookup per layer and forward).
    """
    settings = layer.oftv2_settings[adapter_name]
    if settings.impl == "triton" or not supports(settings.form, settings.terms):
        return False
    if settings.block_share and settings.dropout > 0:
        return False
    if isinstance(layer, Conv2d) and (settings.conv_evaluation != "input" or layer.custom_forward):
        # "weight" (and "auto", per call; always for a conv class with its own forward) rotates the filter, not the
        # input
        return False
    plan = layer.kernel_plan(adapter_name) if q_param is None else layer.plan_for(adapter_name, q_param)
    return plan.fused_max_tokens == 0


def _joined_keep(members: list) -> torch.Tensor | None:
    """A group's block-dropout mask over its concatenated blocks (``None`` when no member drops blocks).

    Args:
        members: ``(layer, adapter, triangles, mask or None)`` of the group.
    """
    if all(keep is None for *_, keep in members):
        return None
    dtype = compute_dtype(members[0][2].dtype)
    return torch.cat([torch.ones(q.shape[0], 1, 1, dtype=dtype, device=q.device) if keep is None else keep
                      for _, _, q, keep in members])


def _sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a distributed tensor (FSDP2 shards parameters as DTensors)."""
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


class StackedRotations:
    """The hooks :func:`stack_rotations` registered; :meth:`remove` restores per-layer rotations.

    Args:
        model: The hooked model.
        layers: Its OFTv2 layers.
    """

    def __init__(self, model: nn.Module, layers: list[OFTv2Layer]) -> None:
        self.model = model
        self.layers = layers
        # Modules whose `gradient_checkpointing` flag transformers sets (read on every forward: it can change).
        self._checkpointing = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.enabled = True  # (dynamo cannot read the handles inside a compiled forward: a plain flag)
        for layer in layers:
            layer.oftv2_stacking = True  # read by every forward, so compiled graphs guard on it (hooks are not)
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def active(self) -> bool:
        """Whether the next forward computes stacked rotations (hooks in place, no checkpointing, not sharded)."""
        if not self.enabled or any(m.gradient_checkpointing is True for m in self._checkpointing):
            return False
        first = self.layers[0]
        return not any(_sharded(first.oftv2_Q[name]) for name in first.oftv2_Q)

    def _before(self, module: nn.Module, args) -> None:
        # Also cleared here: under torch.compile a forward that raises skips the always-called forward hook.
        self._clear()
        if not self.active() or cache_usable(module):
            return  # (without autograd in eval mode each layer reuses its cached blocks instead)
        # (layer, adapter, triangles, dropout mask) per group; masks drawn layer by layer in module order, the order
        # in which a sequential model's layers would draw them: the same seed drops the same blocks either way.
        groups: dict[tuple, list[tuple[OFTv2Layer, str, torch.Tensor, torch.Tensor | None]]] = {}
        for layer in self.layers:
            if layer.disable_adapters or layer.merged:
                continue
            params = layer.oftv2_Q
            for name in layer.active_adapters:
                q_param = params.get(name)
                if q_param is None or not eligible(layer, name, q_param):
                    continue
                settings = layer.oftv2_settings[name]
                # In the parameters' dtype: the batch casts half-precision triangles to fp32 once, after joining.
                q_vec = bound_q(q_param, settings.max_q_norm)
                keep = (layer._block_keep(name, compute_dtype(q_vec.dtype), q_vec.device) if layer.training
                        else None)
                key = (layer.oftv2_block_size[name], settings.terms, q_vec.dtype, q_vec.device)
                groups.setdefault(key, []).append((layer, name, q_vec, keep))
        for (block, terms, _, _), members in groups.items():
            q_vecs = [q for _, _, q, _ in members]
            rotations = stacked_rotations(q_vecs, block, terms, _joined_keep(members))
            for (layer, name, _, _), rotation in zip(members, rotations):
                layer.__dict__.setdefault(STACKED_ATTR, {})[name] = rotation

    def _after(self, module: nn.Module, args, output):
        self._clear()
        return output

    def _clear(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop(STACKED_ATTR, None)

    def remove(self) -> None:
        """Removes the hooks; every layer computes its own rotation again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.enabled = False
        self._clear()
        for layer in self.layers:
            layer.__dict__.pop("oftv2_stacking", None)


def oftv2_layers(model: nn.Module) -> list[OFTv2Layer]:
    """The OFTv2 layers of ``model``, in module order.

    Args:
        model: Any module.
    """
    return [m for m in model.modules() if isinstance(m, OFTv2Layer)]


def stack_rotations(model: nn.Module, layers: Iterable[OFTv2Layer] | None = None) -> StackedRotations:
    """Computes the rotations of all eligible OFTv2 adapters of ``model`` as one batch per forward of ``model``.

    The same results as without (to rounding of batched products); fewer kernel calls per layer. Call it after
    adding adapters (layers added later are not seen). A ``PeftModel`` is hooked on the transformers model inside
    it (``get_base_model()``), whose forward both the PEFT forward and ``generate`` call.

    Args:
        model: A ``PeftModel`` or any module holding OFTv2 layers.
        layers: Its OFTv2 layers (default: all of them, found now).

    Returns:
        The hooks, with ``remove()``.

    Raises:
        ValueError: When ``model`` holds no OFTv2 layer.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = list(layers) if layers is not None else oftv2_layers(target)
    if not found:
        raise ValueError(f"stack_rotations: {type(model).__name__} holds no OFTv2 layer (add an OFTv2 adapter first)")
    return StackedRotations(target, found)
