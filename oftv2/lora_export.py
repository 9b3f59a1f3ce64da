"""OFTv2 (or PEFT OFT) adapters as standard PEFT LoRA adapters, for servers that load LoRA only (vLLM, SGLang, TGI).

Per adapted layer the exported update is ``ΔW = W' − W``, the merged weight minus the base weight, using that
layer's own merge math (``OFTv2Layer._apply_rotation_to_weight``): ``W' = W Rᵀ`` for ``nn.Linear``, GPT-2
``Conv1D`` and ``nn.Conv2d`` (flattened filters), ``E' = E R`` for ``nn.Embedding``. A truncated SVD gives
``ΔW ≈ U_k S_k V_kᵀ = B A`` with ``B = U_k S_k^½`` and ``A = S_k^½ V_kᵀ``: the best rank-``k`` approximation in
Frobenius and spectral norm (Eckart–Young). ``lora_alpha = r`` everywhere, so the LoRA scaling is 1.

Rank: ``k = min(rank, min(out, in))`` per layer (``rank="full"``: ``min(out, in)``, which reproduces the adapter to
rounding). OFT's ``ΔW = W (Rᵀ − I)`` is generally of full rank, so a small ``k`` is an approximation, not a
compression of something low-rank: measure it (:func:`measure_lora_export`). The config's ``r`` is the largest
``k`` used; layers with a smaller ``k`` are listed in ``rank_pattern`` and ``alpha_pattern`` (alpha = their ``k``),
so PEFT scales every layer by 1, and so does vLLM, which ignores the patterns and scales by ``lora_alpha / r = 1``
while taking each layer's rank from its tensors.

Bias: OFT never changes a bias (the rotation acts on the input, or on the embedding rows), so the exported adapter
has ``bias="none"`` and the base biases are right as they are. Adapters that train biases (``bias != "none"``),
``modules_to_save`` or trainable tokens have no place in a servable LoRA adapter (vLLM refuses
``modules_to_save``): exporting them raises ``ValueError``.

Quantized bases (QOFT): ΔW must come from the full-precision base. By default each layer's
``_get_base_weight()`` is used (the dequantized weight for ``oftv2.bnb`` layers); pass ``base_weight`` to supply
the weights another way (e.g. from the unquantized checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from peftplug.fileio import atomic_directory

from .config import OFTv2Config
from .conv import Conv2d
from .embedding import Embedding
from .layer import OFTv2Layer

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# base_weight(module_name, layer) -> the layer's full-precision weight as OFTv2 sees it (out × in, flattened).
BaseWeight = Callable[[str, OFTv2Layer], torch.Tensor]


@dataclass
class LoraExport:
    """A LoRA adapter computed from an OFTv2 adapter, not yet written.

    Args:
        config: The ``peft.LoraConfig``.
        tensors: PEFT's saved keys (``base_model.model.<module>.lora_A.weight``, ...) to tensors.
        ranks: Rank ``k`` per module (path without the ``base_model.model.`` prefix).
        full_ranks: ``min(out, in)`` per module.
        dropped: Per module, ``||ΔW − B A||_F / ||ΔW||_F`` (0 at full rank; 0 when ``ΔW = 0``).
    """

    config: object
    tensors: dict[str, torch.Tensor]
    ranks: dict[str, int]
    full_ranks: dict[str, int]
    dropped: dict[str, float] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        """Number of LoRA parameters."""
        return sum(t.numel() for t in self.tensors.values())

    @property
    def num_bytes(self) -> int:
        """Size of the LoRA tensors in bytes (the safetensors file is this plus a small header)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _check_rank(rank) -> None:
    if rank == "full":
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"`rank` must be a positive int or 'full', got {rank!r}")


def _check_exportable(config, adapter_name: str) -> None:
    if not isinstance(config, OFTv2Config):
        raise ValueError(  # noqa: TRY004 - a wrong adapter choice, like PEFT's adapter-name errors
            f"adapter {adapter_name!r} is not an OFTv2 adapter ({type(config).__name__}); load a PEFT OFT adapter "
            "with oftv2.load_peft_oft_adapter first"
        )
    if config.bias != "none":
        raise ValueError(
            f"adapter {adapter_name!r} trains biases (bias={config.bias!r}): a served LoRA adapter cannot carry them; "
            "merge it instead (merge_and_unload)"
        )
    for name in ("modules_to_save", "trainable_token_indices"):
        if getattr(config, name, None):
            raise ValueError(
                f"adapter {adapter_name!r} has {name}={getattr(config, name)!r}: vLLM-style LoRA serving supports "
                "LoRA matrices only; merge it instead (merge_and_unload)"
            )


def oftv2_layers(peft_model: nn.Module, adapter_name: str = "default") -> list[tuple[str, OFTv2Layer]]:
    """``(module path without the PeftModel prefix, layer)`` of every OFTv2 layer holding ``adapter_name``.

    Args:
        peft_model: A ``PeftModel`` (or a model with OFTv2 layers injected).
        adapter_name: The adapter.
    """
    found = []
    for name, module in peft_model.named_modules():
        if isinstance(module, OFTv2Layer) and adapter_name in module.oftv2_Q:
            found.append((name.removeprefix(PEFT_PREFIX), module))
    return found


def delta_weight(layer: OFTv2Layer, adapter_name: str, weight: torch.Tensor) -> torch.Tensor:
    """The update ``B A`` must equal, in float64: ``W Rᵀ − W`` (out × in) for Linear / Conv1D / Conv2d (flattened),
    ``(E R − E)ᵀ`` (dim × num_embeddings) for Embedding, as PEFT's LoRA ``Embedding`` adds ``(B A)ᵀ`` to ``E``.

    Args:
        layer: The OFTv2 layer.
        adapter_name: Whose rotation.
        weight: The layer's full-precision base weight as ``_get_base_weight`` returns it.
    """
    base = weight.detach().to(torch.float64)
    delta = layer._apply_rotation_to_weight(base, adapter_name, inverse=False) - base
    return delta.T if isinstance(layer, Embedding) else delta


def low_rank_factors(delta: torch.Tensor, rank) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(B, A, dropped)`` with ``B A`` the best rank-``k`` approximation of ``delta``, ``k = min(rank, min(shape))``.

    Args:
        delta: ``m × n``.
        rank: Requested rank or ``"full"``.

    Returns:
        ``B`` (m × k), ``A`` (k × n), and the relative Frobenius error ``||delta − B A|| / ||delta||``.
    """
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = s.numel() if rank == "full" else min(int(rank), s.numel())
    root = s[:k].sqrt()
    total = float(s.square().sum())
    dropped = (float(s[k:].square().sum()) / total) ** 0.5 if total > 0 else 0.0
    return u[:, :k] * root, root[:, None] * vh[:k], dropped


def _lora_keys(path: str, layer: OFTv2Layer) -> tuple[str, str]:
    prefix = PEFT_PREFIX + path
    if isinstance(layer, Embedding):
        return f"{prefix}.lora_embedding_B", f"{prefix}.lora_embedding_A"
    return f"{prefix}.lora_B.weight", f"{prefix}.lora_A.weight"


def _check_conv_representable(path: str, layer: OFTv2Layer) -> None:
    """Refuses a Conv2d whose update PEFT's LoRA ``Conv2d`` (0.21) cannot apply unmerged.

    PEFT builds ``lora_A`` as a dense conv with the base's kernel, stride and padding only: with ``groups != 1`` the
    flattened update has the wrong shape, with ``dilation != 1`` ``lora_A`` reads an undilated patch (a size
    mismatch or a different output), and with ``padding_mode != "zeros"`` it pads the border with zeros where the
    base reflects / wraps / replicates (a wrong output at the border). Merged, the folder would be right, but a
    server applies LoRA unmerged.

    Args:
        path: The module path (for the message).
        layer: The OFTv2 layer.
    """
    if not isinstance(layer, Conv2d):
        return
    base = layer.get_base_layer()
    unsupported = {"groups": base.groups != 1, "dilation": any(d != 1 for d in base.dilation),
                   "padding_mode": base.padding_mode != "zeros"}
    for setting, bad in unsupported.items():
        if bad:
            raise ValueError(
                f"cannot export Conv2d layer {path!r} with {setting}={getattr(base, setting)!r} as LoRA: PEFT's LoRA "
                "Conv2d applies a dense, undilated, zero-padded update, so it would not reproduce this layer "
                "unmerged; merge the adapter instead (merge_and_unload)"
            )


def _shape_factors(layer: OFTv2Layer, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT LoRA's tensor shapes: Linear ``[out, k]``/``[k, in]``; Conv2d ``[out, k, 1, 1]``/``[k, in, kh, kw]``;
    Embedding ``lora_embedding_B [dim, k]``/``lora_embedding_A [k, num_embeddings]``."""
    if isinstance(layer, Conv2d):
        return b[:, :, None, None], a.reshape(a.shape[0], *layer.get_base_layer().weight.shape[1:])
    return b, a


def lora_from_oftv2(
    peft_model: nn.Module,
    rank: int | str,
    adapter_name: str = "default",
    base_weight: BaseWeight | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoraExport:
    """Computes the LoRA adapter that approximates (or, at ``rank="full"``, reproduces) an OFTv2 adapter.

    Args:
        peft_model: A ``PeftModel`` holding the OFTv2 adapter (unmerged).
        rank: LoRA rank ``R``, clipped per layer to ``min(out, in)``; or ``"full"``.
        adapter_name: Which adapter.
        base_weight: Optional ``(module path, layer) -> weight`` giving each layer's full-precision base weight
            (out × in, a conv's filters flattened); default: the layer's own ``_get_base_weight()`` (dequantized
            for a 4-bit or 8-bit base).
        dtype: dtype of the saved LoRA tensors.

    Raises:
        ValueError: For a bad ``rank``, an adapter that is not OFTv2 or carries biases / modules_to_save /
            trainable tokens, a layer with this adapter merged into its weight (or any adapter, without
            ``base_weight``), or a Conv2d with groups, dilation or a padding mode other than zeros (which PEFT's
            LoRA Conv2d cannot apply unmerged).
    """
    from peft import LoraConfig

    _check_rank(rank)
    config = peft_model.peft_config[adapter_name]
    _check_exportable(config, adapter_name)
    layers = oftv2_layers(peft_model, adapter_name)
    if not layers:
        raise ValueError(f"the model has no OFTv2 layer holding adapter {adapter_name!r}")
    from transformers.pytorch_utils import Conv1D

    for path, layer in layers:  # every refusal before any SVD
        if adapter_name in layer.merged_adapters or (base_weight is None and layer.merged_adapters):
            # Another merged adapter counts too when ΔW is taken against the layer's own (then rotated) weight.
            raise ValueError(
                f"layer {path!r} has adapter(s) {layer.merged_adapters} merged into its weight; unmerge first "
                "(unmerge_adapter)"
            )
        _check_conv_representable(path, layer)
    tensors, ranks, full_ranks, dropped = {}, {}, {}, {}
    for path, layer in layers:
        with torch.no_grad():
            weight = base_weight(path, layer) if base_weight is not None else layer._get_base_weight()
            b, a, error = low_rank_factors(delta_weight(layer, adapter_name, weight), rank)
        b, a = _shape_factors(layer, b, a)
        key_b, key_a = _lora_keys(path, layer)
        tensors[key_a], tensors[key_b] = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        ranks[path], full_ranks[path], dropped[path] = a.shape[0], min(weight.shape), error
    r = max(ranks.values())
    # Layers below the config's r: their own rank and alpha (scaling alpha / r = 1 in PEFT; vLLM uses 1 for all).
    pattern = {path: k for path, k in ranks.items() if k != r}
    # PEFT's one fan_in_fan_out flag concerns its Linear and Conv1D layers only (its Embedding and Conv2d ignore it):
    # counting an embedding as "not Conv1D" set it False for GPT-2's c_attn + wte, and PEFT warned at every load.
    conv1d = [isinstance(layer.get_base_layer(), Conv1D) for _, layer in layers
              if isinstance(layer.get_base_layer(), (nn.Linear, Conv1D))]
    lora_config = LoraConfig(
        r=r, lora_alpha=r, target_modules=sorted(ranks), rank_pattern=pattern, alpha_pattern=dict(pattern),
        lora_dropout=0.0, bias="none", use_dora=False, use_rslora=False, modules_to_save=None,
        fan_in_fan_out=bool(conv1d) and all(conv1d), task_type=config.task_type,
        base_model_name_or_path=config.base_model_name_or_path, revision=config.revision,
    )
    return LoraExport(lora_config, tensors, ranks, full_ranks, dropped)


def _config_json(export: LoraExport) -> str:
    import peft

    raw = export.config.to_dict()
    raw = {k: (sorted(v) if isinstance(v, set) else v) for k, v in raw.items()}
    raw["peft_type"] = "LORA"
    raw["task_type"] = getattr(raw.get("task_type"), "value", raw.get("task_type"))
    raw["peft_version"] = peft.__version__
    return json.dumps(raw, indent=2, sort_keys=True)


def save_lora_export(export: LoraExport, out_dir: str | os.PathLike) -> Path:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` atomically into a new folder.

    Args:
        export: From :func:`lora_from_oftv2`.
        out_dir: Output folder; it must not exist or be empty.

    Raises:
        FileExistsError: If ``out_dir`` already holds files (nothing is overwritten).
    """
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise FileExistsError(f"out_dir {out} already exists and is not an empty folder; choose a new one")
        out.rmdir()  # an empty folder is replaced by the complete one
    text = _config_json(export)
    with atomic_directory(out) as staging:
        save_file(export.tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(text, encoding="utf-8")
    return out


def export_lora(
    peft_model: nn.Module,
    out_dir: str | os.PathLike,
    rank: int | str,
    adapter_name: str = "default",
    base_weight: BaseWeight | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoraExport:
    """Writes an OFTv2 adapter as a standard PEFT LoRA adapter folder (loads with plain ``peft``; servable by vLLM).

    Args:
        peft_model: A ``PeftModel`` holding the OFTv2 adapter.
        out_dir: New output folder (must not hold files).
        rank: LoRA rank (clipped per layer) or ``"full"``.
        adapter_name: Which adapter.
        base_weight: Full-precision base weights, see :func:`lora_from_oftv2`.
        dtype: dtype of the saved tensors.

    Returns:
        The :class:`LoraExport` that was written.
    """
    export = lora_from_oftv2(peft_model, rank, adapter_name=adapter_name, base_weight=base_weight, dtype=dtype)
    save_lora_export(export, out_dir)
    return export


def load_oft_family_adapter(base_model: nn.Module, adapter_dir: str | os.PathLike):
    """A saved OFTv2 (``peft_type`` OFTV2) or PEFT OFT (``OFT``, converted by ``oftv2.interop``) adapter on
    ``base_model``, frozen.

    Args:
        base_model: The base model the adapter was trained on.
        adapter_dir: The adapter folder.

    Raises:
        ValueError: For another ``peft_type``.
    """
    from peft import PeftModel

    from .interop import load_peft_oft_adapter

    config_path = Path(adapter_dir) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a PEFT adapter folder")
    peft_type = json.loads(config_path.read_text()).get("peft_type")
    if peft_type == "OFTV2":
        return PeftModel.from_pretrained(base_model, adapter_dir).eval()
    if peft_type == "OFT":
        return load_peft_oft_adapter(base_model, adapter_dir).eval()
    raise ValueError(f"{config_path} has peft_type {peft_type!r}; expected 'OFTV2' or 'OFT'")

