"""How far merging into a quantized base moves a model's outputs (:func:`merge_drift`), measured without changing it.

A merge into a bitsandbytes base requantizes its weights and an unmerge requantizes them again, so a merge/unmerge
round trip does not give the original weights back (NF4: ~9 % of the logits of a tiny Llama, a quarter of what the
adapter itself changes). The measurement therefore keeps the quantized weights it found and puts them back
afterwards, exactly; re-exported by :mod:`oftv2.bnb` (``oftv2.bnb.merge_drift``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn


def _quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` layers of ``model`` (none unless bitsandbytes is loaded)."""
    module = sys.modules.get("bitsandbytes.nn")
    classes = tuple(c for c in (getattr(module, n, None) for n in ("Linear4bit", "Linear8bitLt")) if c is not None)
    return [m for m in model.modules() if classes and isinstance(m, classes)]


def snapshot_float_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies (on the CPU) of the float base weights of every adapted layer that is not a bitsandbytes layer.

    A merge/unmerge round trip of a float base is exact only up to rounding in the base's dtype: in bf16 it moves
    weights by up to one ulp (~2e-4 on a tiny Llama) and the outputs by ~0.5 %. The copies live on the CPU so that
    measuring does not double the accelerator memory of the adapted weights; a weight shared by several layers (tied
    embeddings) is copied once.

    Args:
        model: The model (a ``PeftModel`` or the tuned model).
    """
    quantized = {id(m) for m in _quantized_layers(model)}
    saved, seen = [], set()
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        base = module.get_base_layer()
        weight = getattr(base, "weight", None)
        if (id(base) in quantized or not isinstance(weight, torch.Tensor) or not weight.is_floating_point()
                or id(weight) in seen):
            continue
        seen.add(id(weight))
        saved.append((weight, weight.detach().to("cpu", copy=True)))
    return saved


def restore_float_weights(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Writes back the weights recorded by :func:`snapshot_float_weights`, in place (ties and optimizers keep them).

    Args:
        saved: Its result.
    """
    with torch.no_grad():
        for weight, copy in saved:
            weight.data.copy_(copy)


def snapshot_quantized_weights(model: nn.Module) -> list[tuple[Any, ...]]:
    """What :func:`restore_quantized_weights` needs to put every quantized layer's weight back exactly.

    Merges (ours and PEFT's) replace a quantized layer's weight parameter, so keeping the old parameter object costs
    no copy; only a float weight (``Linear8bitLt`` with ``has_fp16_weights=True``, written in place) is cloned.
    ``Linear8bitLt`` keeps its int8 weight and row scales in its matmul state after a forward, and ``Linear4bit`` a
    copy of its quantization state (which bitsandbytes' quantizer updates): kept too.

    Args:
        model: The model (a ``PeftModel`` or anything holding the bitsandbytes layers).
    """
    saved = []
    for layer in _quantized_layers(model):
        weight = layer.weight
        state = getattr(layer, "state", None)  # Linear8bitLt's MatmulLtState
        saved.append((layer, weight, weight.data.clone() if weight.is_floating_point() else None,
                      None if state is None else (state.CB, state.SCB), getattr(layer, "quant_state", None)))
    return saved


def restore_quantized_weights(saved: list[tuple[Any, ...]]) -> None:
    """Puts back the weights recorded by :func:`snapshot_quantized_weights`.

    Args:
        saved: Its result.
    """
    for layer, weight, float_data, cached, quant_state in saved:
        if float_data is not None:
            with torch.no_grad():
                weight.data.copy_(float_data)
        layer.weight = weight
        if hasattr(layer, "quant_state"):
            layer.quant_state = quant_state
        if cached is not None:
            # Drops the int8 copy a forward cached of the merged weight, and gives back the original's.
            layer.state.reset_grads()
            layer.state.CB, layer.state.SCB = cached


@torch.no_grad()
def merge_drift(peft_model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Measures the output drift that requantizing a merged quantized base causes, on a calibration batch.

    Runs the unmerged adapter, merges (requantizing the quantized bases), runs again, then unmerges and runs again.
    Also reports how far the base model (adapters disabled) is from the adapter, for scale: a faithful merge has
    ``merged_vs_adapter`` much smaller than ``base_vs_adapter``. The model is left as it was: its quantized weights
    are put back exactly afterwards (the unmerge alone requantizes them a second time), and so are float base weights
    (from CPU copies: a bf16 merge/unmerge round trip rounds them).

    Args:
        peft_model: A ``PeftModel`` with OFTv2 (or PEFT) adapters, none merged (merge/unmerge/disable_adapter
            available).
        batch: Model inputs, e.g. ``{"input_ids": ..., "attention_mask": ...}``.

    Returns:
        Relative Frobenius distances of the logits: ``merged_vs_adapter``, ``base_vs_adapter`` and
        ``unmerged_vs_adapter`` (after the merge/unmerge round trip, i.e. what ``unmerge_adapter()`` would leave).

    Raises:
        ValueError: If an adapter is merged already (the "adapter" run would be the merged model, and the drift 0).
    """
    merged = [name for name, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer) and m.merged]
    if merged:
        raise ValueError(f"merge_drift measures an unmerged model, but {len(merged)} layers have merged adapters "
                         f"(first: {merged[0]!r}); call unmerge_adapter() first")
    was_training = peft_model.training
    peft_model.eval()

    def logits() -> torch.Tensor:
        out = peft_model(**batch)
        return (out.logits if hasattr(out, "logits") else out).float()

    adapter = logits()
    with peft_model.disable_adapter():
        base = logits()
    tuner = getattr(peft_model, "base_model", peft_model)
    saved = snapshot_quantized_weights(peft_model)
    saved_float = snapshot_float_weights(peft_model)
    try:
        tuner.merge_adapter()
        merged_logits = logits()
        tuner.unmerge_adapter()
        unmerged = logits()
    finally:
        if any(isinstance(m, BaseTunerLayer) and m.merged for m in peft_model.modules()):
            tuner.unmerge_adapter()  # a failed merge or forward: bookkeeping back to unmerged, weights below
        restore_quantized_weights(saved)
        restore_float_weights(saved_float)
        peft_model.train(was_training)
    norm = adapter.norm().clamp_min(1e-12)
    return {
        "merged_vs_adapter": float((merged_logits - adapter).norm() / norm),
        "base_vs_adapter": float((base - adapter).norm() / norm),
        "unmerged_vs_adapter": float((unmerged - adapter).norm() / norm),
    }
