"""Building adapters from raw vectors, and converters to/from EasyEdit2 folders and repeng/llama.cpp GGUF.

Layer convention everywhere: layer ``L`` is the output of decoder block ``L`` (0-based). EasyEdit2's
``layer_{L}.pt`` files and repeng's ``direction.{L}`` GGUF tensors use the same index (both hook
``model.layers[L]``'s output).

PEFT's own format (``save_pretrained`` / ``PeftModel.from_pretrained``) is the primary one; these converters
exist for interchange.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

_LAYER_FILE = re.compile(r"^layer_(\d+)\.pt$")


def _atomic_torch_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _vectors_of(source, adapter_name: str, scaled: bool) -> tuple[dict[int, torch.Tensor], dict]:
    """``{layer: vector}`` and config provenance of a PeftModel/SteeringModel adapter, or a plain dict."""
    if isinstance(source, dict):
        return {int(k): torch.as_tensor(v).detach().float().cpu() for k, v in source.items()}, {}
    from steering.model import steering_model_of

    steer = steering_model_of(source)
    config = steer.peft_config[adapter_name]
    vectors = {}
    for layer, module in steer.steering_layers(adapter_name).items():
        v = module._effective_vector(adapter_name, torch.float32).detach().cpu()
        vectors[layer] = module.steer_multiplier[adapter_name] * v if scaled else v
    return vectors, {"model_type": config.model_type, "method": config.method}


def steering_adapter(model, vectors: dict[int, torch.Tensor], adapter_name: str = "default", **config_kwargs):
    """Wraps ``model`` as a PEFT steering adapter holding the given vectors.

    Args:
        model: A transformers model, or a ``PeftModel`` with steering adapters (the adapter is added).
        vectors: ``{layer: [hidden] tensor}``; the layers become ``SteeringConfig.layers``.
        adapter_name: Adapter name.
        **config_kwargs: Further ``SteeringConfig`` fields (``multiplier``, ``positions``, ...).

    Returns:
        The ``PeftModel``.
    """
    import peft

    from steering.config import SteeringConfig
    from steering.model import SteeringModel

    if not vectors:
        raise ValueError("vectors is empty: need at least one {layer: vector} entry")
    config_kwargs.setdefault("task_type", "CAUSAL_LM")
    config = SteeringConfig(layers=sorted(int(k) for k in vectors), **config_kwargs)
    if isinstance(getattr(model, "base_model", None), SteeringModel):
        model.add_adapter(adapter_name, config)
        peft_model = model
    else:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name)
    peft_model.base_model.set_vectors({int(k): v for k, v in vectors.items()}, adapter_name)
    return peft_model


def export_easyedit(source, folder: str | os.PathLike, adapter_name: str = "default", scaled: bool = False) -> list[Path]:
    """Writes EasyEdit2's vector folder: one ``layer_{L}.pt`` (a 1-D fp32 tensor) per steered layer.

    Args:
        source: A ``PeftModel``/``SteeringModel`` with the adapter, or a ``{layer: vector}`` dict.
        folder: Output folder (created).
        adapter_name: Adapter to export.
        scaled: Fold the multiplier into the vectors (EasyEdit2 applies its own multiplier at load time, so
            the default exports the raw vectors).

    Returns:
        The written paths.
    """
    vectors, _ = _vectors_of(source, adapter_name, scaled)
    if not vectors:
        raise ValueError("nothing to export: no steering vectors")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, v in sorted(vectors.items()):
        path = folder / f"layer_{layer}.pt"
        _atomic_torch_save(v.contiguous(), path)
        paths.append(path)
    return paths


def import_easyedit(folder: str | os.PathLike, hidden_size: int | None = None) -> dict[int, torch.Tensor]:
    """Reads an EasyEdit2 vector folder (``layer_{L}.pt`` files).

    Args:
        folder: The folder.
        hidden_size: If given, every vector must have this many entries.

    Returns:
        ``{layer: vector}`` (fp32).

    Raises:
        FileNotFoundError: If the folder has no ``layer_{L}.pt`` file.
        ValueError: If a file does not hold a single vector (or has the wrong size).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    out = {}
    for path in sorted(folder.iterdir()):
        match = _LAYER_FILE.match(path.name)
        if not match:
            continue
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not torch.is_tensor(obj):
            raise ValueError(f"{path} holds a {type(obj).__name__}, expected a tensor (EasyEdit2 vector)")
        if obj.dim() == 2 and 1 in obj.shape:  # some EasyEdit2 generators save [1, hidden]
            obj = obj.reshape(-1)
        if obj.dim() != 1:
            raise ValueError(f"{path} holds a tensor of shape {tuple(obj.shape)}, expected one vector [hidden]")
        if hidden_size is not None and obj.numel() != hidden_size:
            raise ValueError(f"{path} has {obj.numel()} entries, expected hidden size {hidden_size}")
        if not torch.isfinite(obj).all():
            raise ValueError(f"{path} contains non-finite values")
        out[int(match.group(1))] = obj.float()
    if not out:
        raise FileNotFoundError(f"no layer_{{L}}.pt files in {folder}")
    sizes = {v.numel() for v in out.values()}
    if len(sizes) != 1:
        raise ValueError(f"{folder}: vectors of different sizes {sorted(sizes)}")
    return out


def export_gguf(source, path: str | os.PathLike, adapter_name: str = "default", model_hint: str | None = None) -> Path:
    """Writes a repeng/llama.cpp control-vector GGUF (needs the optional ``gguf`` package).

    Tensors are ``direction.{L}`` with the multiplier folded in (llama.cpp's ``--control-vector-scaled``
    scales them again). llama.cpp rejects layer 0, as repeng never produces it.

    Args:
        source: A ``PeftModel``/``SteeringModel`` with the adapter, or a ``{layer: vector}`` dict.
        path: Output ``.gguf`` path.
        adapter_name: Adapter to export.
        model_hint: ``controlvector.model_hint`` (default: the adapter's model_type).
    """
    try:
        import gguf
    except ImportError as err:  # optional dependency
        raise ImportError("GGUF export needs the optional `gguf` package: pip install gguf") from err
    vectors, meta = _vectors_of(source, adapter_name, scaled=True)
    if not vectors:
        raise ValueError("nothing to export: no steering vectors")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "controlvector")
    writer.add_string("controlvector.model_hint", model_hint or meta.get("model_type") or "unknown")
    writer.add_uint32("controlvector.layer_count", len(vectors))
    for layer, v in sorted(vectors.items()):
        writer.add_tensor(f"direction.{layer}", v.numpy().astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def import_gguf(path: str | os.PathLike) -> dict[int, torch.Tensor]:
    """Reads the ``direction.{L}`` tensors of a control-vector GGUF (needs ``gguf``).

    Args:
        path: The ``.gguf`` file.
    """
    try:
        import gguf
    except ImportError as err:
        raise ImportError("GGUF import needs the optional `gguf` package: pip install gguf") from err
    reader = gguf.GGUFReader(str(path))
    out = {}
    for tensor in reader.tensors:
        match = re.match(r"^direction\.(\d+)$", tensor.name)
        if match:
            out[int(match.group(1))] = torch.tensor(tensor.data.copy(), dtype=torch.float32).reshape(-1)
    if not out:
        raise ValueError(f"{path} has no direction.{{L}} tensors: not a control-vector GGUF")
    return out
