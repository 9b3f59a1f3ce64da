"""Whether an OFTv2 layer's forward runs inside an activation-checkpointed region (for :mod:`oftv2.stacking`).

A hand-placed ``torch.utils.checkpoint`` or ``checkpoint_wrapper`` (Lightning's activation checkpointing) recomputes a
region's forward during backward, after the stacking hook dropped the model's stacked blocks: the recomputed layers
compute their own series. Their first forward must compute it too (tests/oftv2/test_oftv2_stacking.py).
"""

from __future__ import annotations

import torch


def inside_activation_checkpoint(stacked: dict[str, torch.Tensor]) -> bool:
    """Whether this forward runs in an activation-checkpointed region that ``oftv2.stacking`` cannot see (transformers'
    ``gradient_checkpointing`` turns stacking off; a hand-placed ``torch.utils.checkpoint`` or ``checkpoint_wrapper``
    does not). Its recomputation in backward comes after the stacking hook dropped the blocks, so it computes this
    layer's own series: the first forward must too (else a non-reentrant checkpoint stops on ops that differ, and a
    reentrant one recomputes with other dropout masks, gradients silently off).

    Args:
        stacked: This forward's stacked blocks of the layer (non-empty).
    """
    if torch.compiler.is_compiling():
        return False  # (a compiled graph traces checkpoints as its own op; the private hook query is not traceable)
    if not torch.is_grad_enabled():
        # A reentrant checkpoint runs its first forward without autograd; the hook computed the blocks with it.
        return any(rotation.requires_grad for rotation in stacked.values())
    # A non-reentrant checkpoint installs saved-tensor hooks around its region (so does save_on_cpu: per-layer then,
    # the same result).
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (private: may move)
    return top_hooks is not None and top_hooks(False) is not None
