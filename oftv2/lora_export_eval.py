"""How close an OFTv2 → LoRA export stays to its OFTv2 adapter, per rank: logit errors and adapter size.

Works on any model + OFTv2 adapter (tiny test models, SmolLM2, ...). The LoRA side is evaluated by adding each
layer's ``B A`` to its base weight with the OFTv2 adapter disabled — exactly what a LoRA adapter with scaling 1
adds — and the base weights are restored bit for bit afterwards. Quantized (bnb) bases are not supported here
(writing ``W + B A`` back would requantize it); measure those on their full-precision twin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .conv import Conv2d
from .embedding import Embedding
from .layer import OFTv2Layer
from .lora_export import LoraExport, _lora_keys, lora_from_oftv2, oftv2_layers


def _delta_of(layer: OFTv2Layer, key_b: str, key_a: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The export's update in ``_get_base_weight`` layout (out × in; an embedding's rows)."""
    b, a = tensors[key_b].double(), tensors[key_a].double()
    if isinstance(layer, Conv2d):
        return b[:, :, 0, 0] @ a.flatten(1)
    delta = b @ a
    return delta.T if isinstance(layer, Embedding) else delta


@contextlib.contextmanager
def lora_applied(peft_model: nn.Module, export: LoraExport, adapter_name: str = "default") -> Iterator[None]:
    """Within the block the model computes the exported LoRA adapter instead of the OFTv2 one.

    Args:
        peft_model: The ``PeftModel`` the export was computed from.
        export: From :func:`oftv2.lora_export.lora_from_oftv2`.
        adapter_name: The OFTv2 adapter the export came from.
    """
    saved = []
    with peft_model.disable_adapter():
        try:
            for path, layer in oftv2_layers(peft_model, adapter_name):
                if type(layer).__module__.endswith(".bnb"):
                    raise ValueError(f"layer {path!r} has a quantized base: measure on the full-precision model")
                original = layer.get_base_layer().weight.detach().clone()
                saved.append((layer, original))
                key_b, key_a = _lora_keys(path, layer)
                weight = layer._get_base_weight()
                layer._set_base_weight(weight.double() + _delta_of(layer, key_b, key_a, export.tensors))
            yield
        finally:
            with torch.no_grad():
                for layer, original in saved:
                    layer.get_base_layer().weight.data.copy_(original)


@contextlib.contextmanager
def only_adapter(peft_model: nn.Module, adapter_name: str) -> Iterator[None]:
    """Within the block the model computes ``adapter_name`` alone, whatever adapters are active.

    Sets the active adapter of every tuner layer and ``modules_to_save`` / trainable-token wrapper directly, so
    that no ``requires_grad`` flag changes (``set_adapter`` would make the adapter trainable); restored on exit.

    Args:
        peft_model: A ``PeftModel`` (or a model with adapter layers injected).
        adapter_name: The adapter to compute.
    """
    saved = [(m, m._active_adapter) for m in peft_model.modules() if hasattr(m, "_active_adapter")]
    try:
        for module, _ in saved:
            module._active_adapter = [adapter_name]
        yield
    finally:
        for module, active in saved:
            module._active_adapter = active


def _logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.double()


def measure_lora_export(
    peft_model: nn.Module,
    batches: Iterable[dict],
    ranks: Iterable[int | str],
    adapter_name: str = "default",
    base_weight=None,
) -> list[dict]:
    """For each rank: max / mean |logit difference| to the OFTv2 adapter, top-1 agreement, and adapter size.

    Args:
        peft_model: A ``PeftModel`` with the OFTv2 adapter (full-precision base), put in eval mode here.
        batches: Model inputs (dicts of tensors, e.g. ``input_ids`` + ``attention_mask``); positions where an
            ``attention_mask`` is 0 are left out of the statistics.
        ranks: LoRA ranks to try (ints or ``"full"``).
        adapter_name: Which adapter.
        base_weight: Full-precision base weights, see :func:`oftv2.lora_export.lora_from_oftv2`.

    Returns:
        One dict per rank: ``rank``, ``r`` (the config's rank after clipping), ``max_abs_logit_error``,
        ``mean_abs_logit_error``, ``top1_agreement``, ``num_parameters``, ``num_bytes`` (fp32),
        ``max_dropped`` (largest per-layer relative Frobenius error of the truncated SVD), and the OFTv2 adapter's
        ``oftv2_parameters``.
    """
    peft_model.eval()
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` must hold at least one batch of model inputs")
    ranks = list(ranks)
    oftv2_parameters = sum(layer.oftv2_Q[adapter_name].numel() for _, layer in oftv2_layers(peft_model, adapter_name))
    exports = [lora_from_oftv2(peft_model, rank, adapter_name=adapter_name, base_weight=base_weight) for rank in ranks]
    # Streamed per batch: one batch's reference logits at a time and running max / sum / counts per rank (keeping
    # every batch's fp64 logits and differences took 13-16 GiB for 100 SmolLM2 prompts).
    stats = [{"max": 0.0, "sum": 0.0, "agree": 0, "count": 0} for _ in exports]
    for batch in batches:
        # The adapter the export came from, alone: not whichever adapters happen to be active.
        with only_adapter(peft_model, adapter_name):
            ref = _logits(peft_model, batch)
        mask = batch.get("attention_mask")
        keep = mask.bool() if mask is not None else torch.ones(ref.shape[:-1], dtype=torch.bool)
        for export, stat in zip(exports, stats):
            with lora_applied(peft_model, export, adapter_name):
                lora = _logits(peft_model, batch)
            diff = (lora - ref).abs()[keep]
            stat["max"] = max(stat["max"], float(diff.max()) if diff.numel() else 0.0)
            stat["sum"] += float(diff.sum())
            stat["agree"] += int((lora.argmax(-1) == ref.argmax(-1))[keep].sum())
            stat["count"] += int(keep.sum())
            del lora, diff
    rows = []
    for rank, export, stat in zip(ranks, exports, stats):
        values = stat["count"] * ref.shape[-1]
        rows.append({
            "rank": rank, "r": export.config.r, "max_abs_logit_error": stat["max"],
            "mean_abs_logit_error": stat["sum"] / max(values, 1), "top1_agreement": stat["agree"] / max(stat["count"], 1),
            "num_parameters": export.num_parameters, "num_bytes": export.num_bytes,
            "max_dropped": max(export.dropped.values()), "oftv2_parameters": oftv2_parameters,
        })
    return rows
