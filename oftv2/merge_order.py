"""In which order an OFTv2 layer folds rotations into its weight, also across several merge calls.

Rotations do not commute, so a merged weight must hold them in the order the forward applies them (active
adapters first, in ``active_adapters`` order): ``W Rₙᵀ … R₁ᵀ`` on the input side, ``W R₁ … Rₙ`` on the output
side (``OFTv2Layer.rotates_output``). ``merged_adapters`` records the fold order (the first entry was folded into
the weight first). A second ``merge_adapter`` call must not simply fold its rotations on top of the weight: on
the input side that would put them on the wrong side of those merged before (``merge(["a"]); merge(["b"])`` gave
``x R_b R_a`` where the forward computes ``x R_a R_b``), unlike LoRA, whose additive updates merge in any order.
"""

from __future__ import annotations

import torch


def forward_order(layer, names: list[str]) -> list[str]:
    """``names`` in the order the forward applies them: active adapters in ``active_adapters`` order, then the
    others in the order given.

    Args:
        layer: The OFTv2 layer.
        names: Adapter names.
    """
    active = list(layer.active_adapters)
    return sorted(names, key=lambda a: active.index(a) if a in active else len(active))


def fold_order(layer, forward: list[str]) -> list[str]:
    """The order in which to fold adapters that the forward applies in order ``forward`` into the weight.

    The forward applies R₁ first. On the input side its transpose must end up rightmost (fold from the last
    adapter); on the output side R₁ is folded first.

    Args:
        layer: The OFTv2 layer.
        forward: Adapter names in forward order.
    """
    return list(forward) if layer.rotates_output else list(reversed(forward))


def merged_weight(layer, weight: torch.Tensor, merged: list[str], new: list[str], safe_merge: bool = False
                  ) -> tuple[torch.Tensor, list[str]]:
    """``weight`` (which holds the adapters ``merged``, in fold order) with the adapters ``new`` folded in too, all
    in forward order.

    When the new rotations belong after the merged ones in fold order they are simply folded on top; otherwise the
    merged ones are undone first (exact inverse) and everything is folded again, in one pass, so that a quantized
    base is requantized only once. Adapters merged and since deleted cannot be undone: then the new ones are folded
    on top, as before.

    Args:
        layer: The OFTv2 layer (its ``_apply_rotation_to_weight`` does the math).
        weight: The current base weight, ``out × in``.
        merged: The adapters already folded into ``weight``, in fold order (``layer.merged_adapters``).
        new: Adapters to fold in now.
        safe_merge: Raise ``ValueError`` (before anything is written) when the result is not finite.

    Returns:
        The new weight and the fold order of every adapter it holds.
    """
    undoable = all(name in layer.oftv2_Q for name in merged)
    target = fold_order(layer, forward_order(layer, fold_order(layer, merged) + list(new))) if undoable else None
    if target is not None and target[: len(merged)] == list(merged):
        to_fold = target[len(merged):]
    elif target is not None:
        for name in reversed(merged):
            weight = layer._apply_rotation_to_weight(weight, name, inverse=True)
        to_fold, merged = target, []
    else:
        to_fold = fold_order(layer, forward_order(layer, list(new)))
    for name in to_fold:
        weight = layer._apply_rotation_to_weight(weight, name, inverse=False)
        if safe_merge and not torch.isfinite(weight).all():
            raise ValueError(f"NaNs or infs in the merged weight: the OFTv2 adapter {name!r} seems to be broken")
    return weight, list(merged) + to_fold
