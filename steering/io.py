"""Building adapters from raw vectors, and converters to/from EasyEdit2 folders and repeng/llama.cpp GGUF.

Layer convention everywhere: layer ``L`` is the output of decoder block ``L`` (0-based), i.e. transformers'
``hidden_states[L + 1]``. EasyEdit2's ``layer_{L}.pt`` files and repeng's ``direction.{L}`` GGUF tensors use the
same index (both hook ``model.layers[L]``'s output).

EasyEdit2's layout, as its generators write it (``zjunlp/EasyEdit`` ``steer/vector_generators``)::

    <dir>/<dataset>/caa_vector/layer_{L}.pt                   CAA
    <dir>/<dataset>/caa_vector_multiple_choice/layer_{L}.pt   CAA with multiple_choice (read at position -2)
    <dir>/<dataset>/vector_prompt_vector/layer_{L}.pt         vector prompt
    <dir>/<dataset>/merge_vector/layer_{L}_merged_vector.pt   MergeIt (linear / TIES / DARE)
    <dir>/<dataset>/reps_vector/layer_{L}.pt                  RePS, intervention_method "vector"
    <dir>/<dataset>/sae_feature_vector/layer_{L}.pt           SAE-feature vectors
    <dir>/<dataset>/sta_vector/layer_{L}_{mode}_trim{t}.pt    STA (import only; e.g. layer_24_act_and_freq_trim0.65.pt)

Each file holds a bare 1-D ``[hidden]`` tensor (``torch.save``), on the CPU, in the model's dtype; there is no
metadata file. EasyEdit2's applier points at the *method* folder; :func:`import_easyedit` also accepts the
dataset folder above it. ``lm_steer_vector/lm_steer_vector.pt`` is a pickled Python list that steers the output
embedding, not the residual stream; it is refused (reading it would need ``weights_only=False``).

PEFT's own format (``save_pretrained`` / ``PeftModel.from_pretrained``) is the primary one; these converters
exist for interchange.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path

import torch

from peftplug.errors import CheckpointError, ConfigError, MissingFileError
from peftplug.fileio import atomic_directory, atomic_write, nearest_existing

# EasyEdit2 method name -> (folder under <dir>/<dataset>, file name pattern of one layer).
EASYEDIT_FOLDERS: dict[str, tuple[str, str]] = {
    "caa": ("caa_vector", "layer_{layer}.pt"),
    "caa_multiple_choice": ("caa_vector_multiple_choice", "layer_{layer}.pt"),
    "vector_prompt": ("vector_prompt_vector", "layer_{layer}.pt"),
    "merge_vector": ("merge_vector", "layer_{layer}_merged_vector.pt"),
    "reps": ("reps_vector", "layer_{layer}.pt"),
    "sae_feature": ("sae_feature_vector", "layer_{layer}.pt"),
}
# STA (Steering Target Atoms) saves ``layer_{L}_{mode}_trim{trim}.pt``: a [hidden] vector its applier adds as
# ``h + m v``, like CAA's. Its ``feature_score/layer_{L}_feature_act.pt`` cache ([d_sae] statistics) never matches.
_STA_SUFFIX = r"_(?:act_and_freq|only_act|only_freq)_trim[0-9.eE+-]+"
_LAYER_FILE = re.compile(rf"^layer_(\d+)(?:_merged_vector|{_STA_SUFFIX})?\.pt$")
# Any per-layer file of an EasyEdit2 method, importable or not (STA: layer_{L}_{mode}_trim{t}.pt).
_ANY_LAYER_FILE = re.compile(r"^layer_\d+.*\.pt$")
_LM_STEER = "lm_steer_vector"


def _vectors_of(source, adapter_name: str, scaled: bool) -> tuple[dict[int, torch.Tensor], dict]:
    """``{layer: vector}`` and config provenance of a PeftModel/SteeringModel adapter, or a plain dict."""
    if isinstance(source, dict):
        return {int(k): torch.as_tensor(v).detach().cpu() for k, v in source.items()}, {}
    from steering.model import steering_model_of

    steer = steering_model_of(source)
    if adapter_name not in steer.peft_config:
        raise ConfigError(f"no steering adapter {adapter_name!r}; the model has {sorted(steer.peft_config)}")
    config = steer.peft_config[adapter_name]
    vectors = {}
    for layer, module in steer.steering_layers(adapter_name).items():
        v = module._effective_vector(adapter_name, torch.float32).detach().cpu()
        vectors[layer] = module.steer_multiplier[adapter_name] * v if scaled else v
    ref = next((p for n, p in steer.model.named_parameters() if steer.prefix not in n), None)
    meta = {"model_type": config.model_type, "method": config.method, "read_position": config.read_position,
            "dtype": ref.dtype if ref is not None else torch.float32, "operator": config.operator,
            "positions": config.positions, "adapter_name": adapter_name,
            "layer_factors": {k: v for k, v in (config.layer_multipliers or {}).items() if v != 1}}
    return vectors, meta


def _check_exportable(meta: dict, target: str, positions: tuple[str, ...], scaled: bool) -> None:
    """Refuses an adapter whose vectors mean something else in ``target``, and warns where a setting is lost.

    EasyEdit2 and llama.cpp only ever add a vector (``h + m v``): the vector of an ``ablate`` adapter, written as
    it is, would push the hidden state along the direction the adapter removes.

    Args:
        meta: Provenance from :func:`_vectors_of` (empty for a plain ``{layer: vector}`` dict).
        target: ``"EasyEdit2"`` or ``"llama.cpp"`` (for the messages).
        positions: The ``positions`` policies the target can express.
        scaled: Whether the multipliers are folded into the written vectors.
    """
    if not meta:
        return
    name = meta["adapter_name"]
    if meta["operator"] != "add":
        raise ConfigError(
            f"steering adapter {name!r} uses operator={meta['operator']!r}, but {target} only adds vectors "
            "(h + m*v): written as they are, they would steer differently; only operator='add' adapters can be exported"
        )
    if meta["positions"] not in positions:
        warnings.warn(f"steering adapter {name!r} steers positions={meta['positions']!r}, which {target} cannot "
                      f"express (it steers {' or '.join(positions)}): the exported vectors act on other tokens",
                      stacklevel=3)
    if meta["layer_factors"] and not scaled:
        warnings.warn(f"steering adapter {name!r} has layer_multipliers {meta['layer_factors']}, which the raw "
                      f"vectors do not carry: give {target} those per-layer factors, or export with scaled=True",
                      stacklevel=3)


def _check_output_folder(folder: Path) -> None:
    """Refuses a vector folder to write that is a file, sits under a file, or holds anything but layer files.

    The export replaces the whole folder (so no layer file of an earlier export stays behind and gets imported
    with the new ones); a folder with other content is refused rather than deleted.

    Args:
        folder: The absolute method folder the layer files go to.
    """
    above = nearest_existing(folder)
    if not above.is_dir():
        raise ConfigError(f"cannot write EasyEdit2 vectors to {folder}: {above} is a file, not a folder")
    if above != folder:
        return
    if os.path.ismount(folder):
        raise ConfigError(f"{folder} is a mount point; EasyEdit2 vectors are written beside their folder and "
                          "renamed onto it, so give a folder inside it")
    others = sorted(p.name for p in folder.iterdir() if not (p.is_file() and _ANY_LAYER_FILE.match(p.name)))
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ConfigError(
            f"{folder} holds other files than EasyEdit2 layer files ({shown}); the export replaces the whole "
            "folder, so give a new or empty folder, or one an earlier export wrote (nothing was touched)"
        )


def steering_adapter(model, vectors: dict[int, torch.Tensor], adapter_name: str = "default", **config_kwargs):
    """Wraps ``model`` as a PEFT steering adapter holding the given vectors.

    Args:
        model: A transformers model, or a ``PeftModel`` with steering adapters (the adapter is added and becomes
            the active one, as :func:`~steering.generators.train_steering_vector` does; combine several with
            ``model.base_model.set_adapter([...])``).
        vectors: ``{layer: [hidden] tensor}``; the layers become ``SteeringConfig.layers``.
        adapter_name: Adapter name.
        **config_kwargs: Further ``SteeringConfig`` fields (``multiplier``, ``positions``, ...).

    Returns:
        The ``PeftModel``, with ``adapter_name`` active.
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
        # PEFT's add_adapter leaves the previous adapter active; callers here expect the vectors they pass to steer.
        peft_model.base_model.set_adapter(adapter_name)
    else:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name)
    peft_model.base_model.set_vectors({int(k): v for k, v in vectors.items()}, adapter_name)
    return peft_model


def easyedit_method_of(method: str | None, read_position: str | None = None) -> str:
    """The EasyEdit2 method folder an adapter's vectors belong in.

    ``caa`` (``caa_multiple_choice`` when read at position -2), ``vector_prompt`` and ``merge:*`` map to their
    EasyEdit2 folders; vectors of methods EasyEdit2 lacks (PCA, trained) go to ``caa_vector``, whose applier
    adds any ``layer_{L}.pt`` vector as ``h + m v`` -- exactly what they mean.

    Args:
        method: ``SteeringConfig.method`` (provenance).
        read_position: ``SteeringConfig.read_position``.
    """
    if method == "caa" and read_position == "second_to_last":
        return "caa_multiple_choice"
    if method in EASYEDIT_FOLDERS:
        return method
    if method and method.startswith("merge"):
        return "merge_vector"
    return "caa"


def export_easyedit(
    source,
    folder: str | os.PathLike,
    adapter_name: str = "default",
    scaled: bool = False,
    dataset: str | None = None,
    method: str | None = None,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Writes vectors as EasyEdit2 does: one ``torch.save``'d bare 1-D tensor per layer, in the model's dtype.

    With ``dataset`` the files go to ``folder/<dataset>/<method folder>/`` (the tree EasyEdit2's generators
    write, e.g. ``out/sst2/caa_vector/layer_12.pt``); without it ``folder`` is the method folder itself (what
    EasyEdit2's ``steer_vector_load_dir`` points at). The method folder is written whole and renamed into place,
    replacing an earlier export there (a folder holding other files is refused).

    Args:
        source: A ``PeftModel``/``SteeringModel`` with the adapter, or a ``{layer: vector}`` dict.
        folder: Output folder (created).
        adapter_name: Adapter to export.
        scaled: Fold the multiplier into the vectors (EasyEdit2 applies its own multiplier at load time, so
            the default exports the raw vectors).
        dataset: EasyEdit2 dataset name (a sub-folder), or ``None`` to write into ``folder`` directly.
        method: One of :data:`EASYEDIT_FOLDERS` (default: from the adapter's provenance, see
            :func:`easyedit_method_of`). Decides the folder name and, for ``merge_vector``, the file names.
        dtype: dtype of the saved tensors (default: the model's parameter dtype; a dict's own dtype).

    Returns:
        The written paths.

    Raises:
        ConfigError: For an adapter whose operator is not ``add`` (EasyEdit2 only adds vectors), or an output
            folder that is a file or holds other files than layer files.
    """
    vectors, meta = _vectors_of(source, adapter_name, scaled)
    if not vectors:
        raise ValueError("nothing to export: no steering vectors")
    _check_exportable(meta, "EasyEdit2", ("all", "from_last_prompt"), scaled)
    method = method or easyedit_method_of(meta.get("method"), meta.get("read_position"))
    if method not in EASYEDIT_FOLDERS:
        raise ConfigError(f"EasyEdit2 method must be one of {', '.join(EASYEDIT_FOLDERS)}; got {method!r}")
    subdir, pattern = EASYEDIT_FOLDERS[method]
    folder = Path(folder)
    if dataset is not None:
        if not dataset or "/" in dataset or dataset in (".", ".."):
            raise ConfigError(f"dataset must be a plain folder name (EasyEdit2's dataset name); got {dataset!r}")
        folder = folder / dataset / subdir
    folder = Path(os.path.abspath(folder.expanduser()))
    _check_output_folder(folder)
    dtype = dtype or meta.get("dtype")
    names = {layer: pattern.format(layer=layer) for layer in vectors}
    # The whole folder is written beside its place and renamed onto it: a failure midway leaves the earlier folder
    # (or none), and layer files of an earlier export with other layers do not stay behind to be imported with these.
    with atomic_directory(folder, overwrite=True) as staging:
        for layer, v in sorted(vectors.items()):
            # A bare, contiguous 1-D CPU tensor: what EasyEdit2 saves (no dict, no metadata). Saved under its final
            # name, so torch names the zip archive's root folder `layer_{L}/` as in EasyEdit2's files.
            tensor = v.reshape(-1).to(dtype or v.dtype).contiguous().clone()
            torch.save(tensor, staging / names[layer])
    return [folder / names[layer] for layer in sorted(vectors)]


def _is_method_folder(path: Path) -> bool:
    """Whether ``path`` looks like a folder an EasyEdit2 method wrote: per-layer ``layer_{L}...pt`` files (also
    other methods' names, e.g. STA's ``layer_{L}_{mode}_trim{t}.pt``) or an LM-Steer checkpoint."""
    if not path.is_dir():
        return False
    return path.name == _LM_STEER or any(
        q.is_file() and (_ANY_LAYER_FILE.match(q.name) or q.name == f"{_LM_STEER}.pt") for q in path.iterdir()
    )


def _method_folder(folder: Path) -> Path:
    """The folder holding the layer files: ``folder`` itself, or its one EasyEdit2 method sub-folder.

    A dataset folder where several methods ran (EasyEdit2 writes each into its own sub-folder, and STA also
    writes a ``caa_vector`` side output next to its ``sta_vector``) is ambiguous: the error names the folders
    rather than importing whichever one happens to have the expected file names.
    """
    if folder.name == _LM_STEER or (folder / f"{_LM_STEER}.pt").exists():
        raise CheckpointError(
            f"{folder}: an EasyEdit2 LM-Steer checkpoint (lm_steer_vector.pt, a pickled list that adapts the output "
            "embedding) is not a residual-stream steering vector and cannot be imported; expected layer_{L}.pt files"
        )
    if any(_LAYER_FILE.match(p.name) and p.is_file() for p in folder.iterdir()):
        return folder
    subs = [p for p in sorted(folder.iterdir()) if _is_method_folder(p)]
    if len(subs) == 1:
        return _method_folder(subs[0])
    if len(subs) > 1:
        raise ConfigError(
            f"{folder} holds several EasyEdit2 vector folders ({', '.join(p.name for p in subs)}); pass the one to "
            "import (method folders with layer_{L}.pt, layer_{L}_merged_vector.pt or STA's "
            "layer_{L}_{mode}_trim{t}.pt files can be)"
        )
    raise MissingFileError(
        f"no layer_{{L}}.pt files in {folder} (expected an EasyEdit2 method folder such as caa_vector/, or the "
        "dataset folder above one)"
    )


def _load_vector(path: Path) -> torch.Tensor:
    """One EasyEdit2 layer file: a 1-D tensor, loaded with ``weights_only=True`` only."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path} is not a plain tensor file (expected a torch.save'd 1-D tensor; pickled Python objects are never "
            f"loaded): {first}"
        ) from None
    if not torch.is_tensor(obj):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, expected a tensor (one EasyEdit2 vector)")
    if obj.dim() == 2 and 1 in obj.shape:  # some EasyEdit2 generators save [1, hidden]
        obj = obj.reshape(-1)
    if obj.dim() != 1:
        raise CheckpointError(
            f"{path} holds a tensor of shape {tuple(obj.shape)}, expected one vector [hidden] (multi-concept files "
            "are not supported)"
        )
    if not obj.is_floating_point() or not torch.isfinite(obj).all():
        raise CheckpointError(f"{path} must hold finite floating-point values")
    return obj


def import_easyedit(
    folder: str | os.PathLike, hidden_size: int | None = None, keep_dtype: bool = False
) -> dict[int, torch.Tensor]:
    """Reads an EasyEdit2 vector folder (``layer_{L}.pt``, ``layer_{L}_merged_vector.pt`` or STA's
    ``layer_{L}_{mode}_trim{t}.pt`` files, one per layer).

    Args:
        folder: The method folder (``.../caa_vector``) or the dataset folder above it (which must then hold
            exactly one method folder).
        hidden_size: If given, every vector must have this many entries.
        keep_dtype: Return the tensors in their stored dtype (default: fp32).

    Returns:
        ``{layer: vector}``.

    Raises:
        MissingFileError: If the path is missing or holds no layer file.
        CheckpointError: If a file is not a single finite vector, is an LM-Steer checkpoint, or two files hold the
            same layer.
        ConfigError: If the vectors do not have ``hidden_size`` entries, or the dataset folder is ambiguous.
    """
    folder = Path(folder)
    if folder.is_file():
        raise ConfigError(f"{folder} is a file; pass its folder (EasyEdit2 keeps one layer_{{L}}.pt per layer)")
    if not folder.is_dir():
        raise MissingFileError(f"EasyEdit2 vector folder {folder} does not exist")
    folder = _method_folder(folder)
    out, names = {}, {}
    for path in sorted(folder.iterdir()):
        match = _LAYER_FILE.match(path.name)
        if not match or not path.is_file():  # a folder named like a layer file is not one (torch.load would fail)
            continue
        layer = int(match.group(1))
        if layer in out:
            # E.g. STA run with several trims or modes: which one is meant is the user's choice, not the sort order.
            raise CheckpointError(f"{folder} has two files for layer {layer} ({names[layer]}, {path.name}); keep "
                                  "one per layer in the folder to import")
        names[layer] = path.name
        obj = _load_vector(path)
        if hidden_size is not None and obj.numel() != hidden_size:
            raise ConfigError(f"{path} has {obj.numel()} entries, expected the model's hidden size {hidden_size}")
        out[layer] = obj if keep_dtype else obj.float()
    sizes = {v.numel() for v in out.values()}
    if len(sizes) != 1:
        raise CheckpointError(f"{folder}: vectors of different sizes {sorted(sizes)}")
    return dict(sorted(out.items()))


def load_easyedit(
    model, folder: str | os.PathLike, multiplier: float = 1.0, steer_from_end_position: bool = False,
    adapter_name: str = "default", **config_kwargs,
):
    """An EasyEdit2 vector folder as an active steering adapter on ``model``, with EasyEdit2's apply semantics.

    EasyEdit2 adds ``multiplier * v`` at every token (prompt and generated), or, with its top-level
    ``steer_from_end_position: true``, from the last prompt token on: that is ``positions="from_last_prompt"``.

    Args:
        model: A transformers model (or a ``PeftModel`` with steering adapters).
        folder: Method folder or dataset folder (see :func:`import_easyedit`).
        multiplier: EasyEdit2's ``multipliers`` entry (one for all layers).
        steer_from_end_position: EasyEdit2's option of the same name.
        adapter_name: Name of the new adapter.
        **config_kwargs: Further ``SteeringConfig`` fields.
    """
    from steering.families import hidden_size_of

    vectors = import_easyedit(folder, hidden_size=hidden_size_of(model))
    config_kwargs.setdefault("method", "easyedit2")
    positions = "from_last_prompt" if steer_from_end_position else "all"
    return steering_adapter(model, vectors, adapter_name, multiplier=multiplier, positions=positions, **config_kwargs)


def export_gguf(source, path: str | os.PathLike, adapter_name: str = "default", model_hint: str | None = None) -> Path:
    """Writes a repeng/llama.cpp control-vector GGUF (needs the optional ``gguf`` package).

    Tensors are ``direction.{L}`` (1-D F32, the output of block ``L``, where llama.cpp adds ``direction.{L}``)
    with the multiplier folded in (llama.cpp's ``--control-vector-scaled`` scales them again). llama.cpp refuses
    the whole file when it holds ``direction.0`` (it never steers block 0's output; repeng never writes it): a
    warning says so here, and ``peftplug steering export-gguf`` refuses such an adapter.

    Args:
        source: A ``PeftModel``/``SteeringModel`` with the adapter, or a ``{layer: vector}`` dict.
        path: Output ``.gguf`` path (its folder is created).
        adapter_name: Adapter to export.
        model_hint: ``controlvector.model_hint`` (default: the adapter's model_type).

    Raises:
        ConfigError: For an adapter whose operator is not ``add`` (llama.cpp only adds control vectors), or a
            ``path`` that is a folder or lies under a file.
    """
    try:
        import gguf
    except ImportError as err:  # optional dependency
        raise ImportError("GGUF export needs the optional `gguf` package: pip install gguf") from err
    vectors, meta = _vectors_of(source, adapter_name, scaled=True)
    if not vectors:
        raise ValueError("nothing to export: no steering vectors")
    _check_exportable(meta, "llama.cpp", ("all",), scaled=True)
    if 0 in vectors:
        warnings.warn("layer 0 is written as direction.0, which llama.cpp refuses (with the whole file): it never "
                      "steers block 0's output; drop layer 0 for llama.cpp", stacklevel=2)
    path = Path(path).expanduser()
    above = nearest_existing(path.parent)
    if path.is_dir() or not above.is_dir():
        raise ConfigError(f"cannot write the GGUF file {path}: {path if path.is_dir() else above} is a "
                          f"{'folder' if path.is_dir() else 'file'}; give a file path such as cv.gguf")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, "controlvector")
        writer.add_string("controlvector.model_hint", model_hint or meta.get("model_type") or "unknown")
        writer.add_uint32("controlvector.layer_count", len(vectors))
        for layer, v in sorted(vectors.items()):
            writer.add_tensor(f"direction.{layer}", v.float().numpy().astype("float32"))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write(path, write)


def import_gguf(path: str | os.PathLike) -> dict[int, torch.Tensor]:
    """Reads the ``direction.{L}`` tensors of a control-vector GGUF (needs ``gguf``).

    Args:
        path: The ``.gguf`` file.

    Raises:
        MissingFileError: If ``path`` is not a file.
        CheckpointError: If it is not a GGUF file.
    """
    try:
        import gguf
    except ImportError as err:
        raise ImportError("GGUF import needs the optional `gguf` package: pip install gguf") from err
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"control-vector GGUF {path} does not exist or is not a file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable GGUF file: {str(err).strip() or type(err).__name__}") from None
    out = {}
    for tensor in reader.tensors:
        match = re.match(r"^direction\.(\d+)$", tensor.name)
        if match:
            out[int(match.group(1))] = torch.tensor(tensor.data.copy(), dtype=torch.float32).reshape(-1)
    if not out:
        raise ValueError(f"{path} has no direction.{{L}} tensors: not a control-vector GGUF")
    return out
