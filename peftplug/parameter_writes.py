"""A process-wide count of parameter writes that a version counter does not show, for caches of derived values.

OFTv2's eval rotation cache (``oftv2.rotation_cache``) and steering's decoding plan (``steering.layer``) keep, across
forwards without autograd, values computed from an adapter's parameters. They notice most writes to a parameter by
its version counter and storage address, but two kinds of write leave both unchanged:

* PyTorch's fused optimizers (``Adam``, ``AdamW``, ``SGD`` ... with ``fused=True``) write the parameters in place
  without bumping their version. One global step post-hook (registered on first use) counts the steps of every
  ``torch.optim`` optimizer, whatever its parameters.
* In-place writes through ``param.data`` (``p.data.add_(...)``, as some zeroth-order scripts perturb). Nothing can
  see them; whoever writes so calls :func:`parameters_written` afterwards.

The caches remember :func:`write_count` when they fill an entry, and an entry filled at another count is stale. A
plain int read per lookup, so the check costs nothing per forward.

Inside an FSDP unit neither key works (:func:`managed_by_fsdp`): FSDP gathers the parameters into the same tensor
on every forward, whose version never moves, and frees its memory afterwards, so the next gather may land at the
same address; a write to the shards (a zeroth-order perturbation, a loaded checkpoint) then looks like no write.
The caches are not used there.

A leaf module: it imports nothing of peftplug's, so every method package may use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# Optimizer steps taken since the hook below was registered, plus calls of parameters_written().
_count = 0
_hook: Any = None


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: one more step taken (by any optimizer, whatever its parameters).

    Args:
        optimizer: The optimizer that stepped.
        args: Its step's positional arguments.
        kwargs: Its step's keyword arguments.
    """
    parameters_written()


def parameters_written() -> None:
    """Marks every cached value derived from parameters stale (OFTv2 rotations, steering vectors), in every model.

    Call it after writing adapter parameters in a way their version counter does not record: in place through
    ``param.data``. Optimizer steps, ``load_state_dict`` and in-place writes under ``torch.no_grad`` need no call.
    """
    global _count
    _count += 1


def write_count() -> int:
    """The count caches key their entries on: optimizer steps since the first call, plus marked writes.

    The first call registers the step hook. Lazily, so a process that never caches does not run a hook on every
    optimizer step; steps before the registration do not matter to a cache, which had no entry before its first
    call.
    """
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_count_step)
    return _count


#: The attribute ``torch.distributed.fsdp`` (FSDP2's ``fully_shard`` and FSDP1) sets on every module it manages.
FSDP_MANAGED_ATTR = "_is_fsdp_managed_module"


def managed_by_fsdp(module: torch.nn.Module) -> bool:
    """Whether FSDP manages ``module`` (its parameters are gathered per forward: a cache keyed on them is unsafe).

    Args:
        module: The module that would cache.
    """
    # __dict__, not getattr: a missing attribute costs nn.Module.__getattr__ a raised AttributeError per forward.
    return bool(module.__dict__.get(FSDP_MANAGED_ATTR, False))
