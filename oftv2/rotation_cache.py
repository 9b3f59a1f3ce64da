"""Rotation blocks kept across forwards without autograd: evaluation and generation with unmerged adapters.

In training every forward computes the series under autograd, since its backward reaches the skew parameters. A
forward in eval mode without autograd (``torch.no_grad``, ``torch.inference_mode``: validation loops, ``generate``)
only reads the blocks, and they depend only on the adapter's parameter, settings and kernel plan. So an OFTv2 layer
computes them on its first such forward and then only rotates: on the torch path one kernel call per adapter and
forward instead of six, and no b³ series products per decoded token (docs/benchmarks/oftv2_decode.md measures
it).

An entry is valid while the parameter is the same tensor at the same version (``load_state_dict`` and in-place
writes under ``no_grad`` bump the version; moving the layer gives the parameter new storage, and the entry holds the
old storage so its address cannot be reused), with the same settings and plan objects, and no ``torch.optim``
optimizer has stepped since it was filled. The last condition is needed because the fused optimizers (``Adam``,
``AdamW``, ``SGD`` ... with ``fused=True``) write the parameters in place without bumping their version: an entry
remembers the global count of :mod:`peftplug.parameter_writes` it was filled at. Not seen: in-place writes through
``param.data`` outside an optimizer step, which bypass the version counter; after such writes call
:func:`peftplug.parameter_writes.parameters_written` (every model's caches, steering's too) or :func:`clear`. Switching a layer to training mode drops its entries. Eager only:
under ``torch.compile`` the series is traced with the rest of the graph (dynamo cannot trace data pointers).

Not for a parameter that carries derivatives the blocks must keep: a ``torch.func`` transform's tensor (``vmap`` over
stacked adapters, ``jvp``, ``grad`` through ``functional_call``: it has no storage to key on) or a forward-mode AD
dual tensor (``torch.autograd.forward_ad``: it shares the primal's storage and version, so an entry filled before
would drop its tangent). Those forwards compute the blocks every time (tests/oftv2/test_oftv2_review5_cache.py).

Not inside an FSDP unit either (:func:`peftplug.parameter_writes.managed_by_fsdp`: the gathered parameters keep their
version and may keep their address across a write to the shards; tests/oftv2/test_oftv2_cache_review2.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad

from peftplug.parameter_writes import managed_by_fsdp, write_count

#: Where a layer keeps its entries (in ``__dict__``, not a module attribute: no state_dict entry, no buffer).
CACHE_ATTR = "_oftv2_inference_rotations"
#: Set to ``False`` to compute the series on every forward again (an A/B of the cache: docs/benchmarks/oftv2_decode.md).
ENABLED = True


def cache_usable(module: nn.Module) -> bool:
    """Whether this forward of ``module`` may read and fill the cache (eval mode, no autograd, not compiling, not
    managed by FSDP).

    Args:
        module: An OFTv2 layer, or the model the stacking hook runs on.
    """
    return (ENABLED and not module.training and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not managed_by_fsdp(module))


def cached_rotation(layer: Any, adapter_name: str, q_param: torch.Tensor, settings: Any, plan: Any) -> torch.Tensor:
    """The adapter's rotation blocks, computed on the first call and reused while still valid.

    Args:
        layer: The OFTv2 layer (its ``get_rotation`` computes the blocks).
        adapter_name: The adapter.
        q_param: Its parameter, ``layer.oftv2_Q[adapter_name]``.
        settings: Its settings object, ``layer.oftv2_settings[adapter_name]``.
        plan: Its kernel plan for the parameter's device.
    """
    if not _plain(q_param):
        return layer.get_rotation(adapter_name)  # (blocks that keep the batch dimension or tangent; not stored)
    cache = layer.__dict__.setdefault(CACHE_ATTR, {})
    entry = cache.get(adapter_name)
    version, address, steps = q_param._version, q_param.data_ptr(), write_count()
    if (entry is not None and entry[1] == version and entry[2] == address and entry[3] is settings
            and entry[4] is plan and entry[6] == steps):
        return entry[5]
    blocks = layer.get_rotation(adapter_name)
    # The detached parameter pins its storage while the entry lives (see the module docstring).
    cache[adapter_name] = (q_param.detach(), version, address, settings, plan, blocks, steps)
    return blocks


def _plain(q_param: torch.Tensor) -> bool:
    """Whether ``q_param`` is an ordinary tensor whose blocks may be stored: not a ``torch.func`` wrapper, and without
    a forward-mode tangent (checked only inside a ``forward_ad.dual_level``, a module global read otherwise).

    Args:
        q_param: The adapter's parameter as this forward sees it (``functional_call`` may have swapped it).
    """
    if _IS_FUNCTORCH_WRAPPED is not None and _IS_FUNCTORCH_WRAPPED(q_param):
        return False
    return getattr(forward_ad, "_current_level", -1) < 0 or forward_ad.unpack_dual(q_param).tangent is None


# Private torch API (2.13): read once, and a torch without it only loses the functorch case, never every forward.
_IS_FUNCTORCH_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def clear(module: nn.Module) -> None:
    """Drops the cached blocks of ``module`` and every layer inside it.

    Args:
        module: A layer or a whole model.
    """
    for m in module.modules():
        m.__dict__.pop(CACHE_ATTR, None)
