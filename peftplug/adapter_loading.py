"""Loading a saved adapter of any type, peftplug's or PEFT's own: :func:`load_adapter` (``peftplug.load_adapter``).

``PeftModel.from_pretrained`` finds an adapter's config class by its ``peft_type`` in a dict that only holds the
types registered so far. PEFT 0.21 has no hook through which a plugin could register itself on demand (no entry
points, and its ``auto_mapping`` imports only the base model's class, from an allowlist), so in a fresh process an
OFTv2 adapter fails there with a bare ``KeyError: 'OFTV2'`` unless ``oftv2`` was imported first. This function
reads the type from ``adapter_config.json``, imports the package that provides it, and then lets PEFT load it.

PEFT's folder does not say how the base was loaded either: ``adapter_config.json`` names the base model but not
its quantization or dtype, and with ``nf4``/``fp4`` the dtype is the compute dtype, part of the trained model.
So ``peftplug export`` adds peftplug's record of the base, ``peftplug_base.json``
(:mod:`peftplug.adapter_export`), which :func:`load_adapter` reads for its defaults.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from peftplug.adapter_export import BASE_RECORD, read_base_record
from peftplug.errors import CheckpointError, ConfigError, PeftplugError
from peftplug.quantized_layout import keep_exact_4bit_layout


def _base_settings(path: str | os.PathLike, quantization: str | None, dtype: str | None) -> tuple[str, str]:
    """The ``quantization`` and ``dtype`` to load a model name with: the given ones, else the folder's record,
    else ``none``/``float32``; warns when a given one differs from the record."""
    record = read_base_record(path)
    if record is None:
        return quantization or "none", dtype or "float32"
    given = {"quantization": quantization, "dtype": dtype}
    # Loading onto another base may be meant (a float32 copy of an nf4-trained adapter), so a warning, not an error.
    _warn_other_base(path, record, given, "loading it with {} as asked, which is", "leave them out to load the "
                     "recorded base")
    return quantization or record["quantization"], dtype or record["dtype"]


def _warn_other_base(path: str | os.PathLike, record: dict, have: dict[str, str | None], says: str,
                     remedy: str) -> None:
    """Warns, naming both sides, where ``have`` differs from the folder's base record (``None``: not known).

    Args:
        path: The adapter folder.
        record: Its ``peftplug_base.json``.
        have: ``quantization`` / ``dtype`` of the base being loaded.
        says: What the differing values are, with ``{}`` where they go.
        remedy: How to get the recorded base.
    """
    differing = [f for f in ("quantization", "dtype") if have.get(f) is not None and have[f] != record[f]]
    if differing:
        recorded = ", ".join(f"{field}={record[field]!r}" for field in differing)
        found = ", ".join(f"{field}={have[field]!r}" for field in differing)
        warnings.warn(f"adapter {str(path)!r} was trained on {record['model']!r} with {recorded} (its {BASE_RECORD}); "
                      f"{says.format(found)} another model than the trained one ({remedy})", UserWarning, stacklevel=4)


def _built_settings(model: Any) -> dict[str, str | None]:
    """The ``quantization`` and ``dtype`` a built model has, in :func:`peftplug.loading.load_model`'s terms (a value
    that cannot be told is ``None``): the 4-bit layers' type and compute dtype, else the weights' dtype."""
    import sys

    import torch

    from peftplug.loading import DTYPES
    from peftplug.quantized_layout import four_bit_layers

    names = {dtype: name for name, dtype in DTYPES.items()}
    for _, layer in four_bit_layers(model):
        quant_type = getattr(layer.weight, "quant_type", None)
        return {"quantization": quant_type if quant_type in ("nf4", "fp4") else None,
                "dtype": names.get(getattr(layer, "compute_dtype", None))}
    bnb = sys.modules.get("bitsandbytes.nn")
    if bnb is not None and any(isinstance(m, bnb.Linear8bitLt) for m in model.modules()):
        return {"quantization": "int8", "dtype": None}  # its other weights are cast to float32 whatever was asked
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return {"quantization": "none", "dtype": names.get(dtype) if isinstance(dtype, torch.dtype) else None}


def _check_built_base(path: str | os.PathLike, model: Any) -> None:
    """Warns when a built model is quantized or typed otherwise than the folder's record says the adapter was
    trained on, as :func:`_base_settings` does for a model name loaded with other settings."""
    try:
        record = read_base_record(path)
    except CheckpointError:
        return  # not needed to load onto a built model; a model name reports it
    if record is None:
        return
    have = _built_settings(model.get_base_model() if hasattr(model, "get_base_model") else model)
    _warn_other_base(path, record, have, "the model given has {},", "pass the model name to load the recorded base")


#: How ``PeftModel.from_pretrained`` words its warning about adapter tensors the file did not hold.
_MISSING_WARNING = "Found missing adapter keys while loading the checkpoint: "
#: torch's ``load_state_dict`` line for one tensor of another shape than the model's.
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                            r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def _size_mismatch_error(err: RuntimeError, path: str | os.PathLike, config: dict) -> CheckpointError | None:
    """The one-line error for torch's multi-line size-mismatch report, or ``None`` for another ``RuntimeError``.

    Args:
        err: What ``load_state_dict`` raised.
        path: The adapter folder.
        config: Its ``adapter_config.json``.
    """
    mismatches = _SIZE_MISMATCH.findall(str(err))
    if not mismatches:
        return None
    key, saved, here = mismatches[0]
    more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    base = config.get("base_model_name_or_path")
    origin = f"it was saved from base model {base!r}" if base else "it was saved from another base model"
    return CheckpointError(f"adapter {str(path)!r} does not fit this model: {key} is {saved} in the adapter but "
                           f"{here} here{more}; {origin}, load it onto that one")


def _adapter_keys(peft_model: Any, peft_type: str, adapter_name: str) -> set[str]:
    """The model's state-dict keys of adapter ``adapter_name`` that PEFT expects in the file (its own filter: the
    tuner's parameter prefix, e.g. ``lora_``), or an empty set for a type PEFT names no prefix for."""
    from peft.peft_model import PEFT_TYPE_TO_PREFIX_MAPPING

    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(peft_type)
    if not prefix:
        return set()
    named = (f".{adapter_name}.", f".{adapter_name}")
    return {k for k in peft_model.state_dict() if prefix in k and (named[0] in k or k.endswith(named[1]))}


def _file_keys(path: str | os.PathLike) -> list[str] | None:
    """The tensor names in an adapter folder's ``adapter_model.safetensors`` (its header only), or ``None`` for a
    folder with pickled ``adapter_model.bin`` weights instead."""
    from safetensors import safe_open

    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        return None
    with safe_open(weights, "pt") as file:
        return sorted(file.keys())


def _refuse_nothing_loaded(peft_model: Any, peft_type: str, adapter_name: str, path: str | os.PathLike,
                           missing: list[str] | None = None, key_mapping: Any = None) -> None:
    """Raises when not one of the adapter's tensors can have come from its file: the model would carry a freshly
    initialised adapter (an identity rotation, a zero vector, a random LoRA) where PEFT only warns.

    Either PEFT's own list of missing keys says so, or the file holds no tensor named with the tuner's prefix at all
    (``oftv2_``, ``lora_``: PEFT maps a file's keys onto the model by module path and keeps the parameter names,
    so such a file has nothing this adapter could load: the weights of another adapter type, or an empty file).

    Args:
        peft_model: The ``PeftModel`` the adapter was loaded into.
        peft_type: The adapter's type.
        adapter_name: Its name there.
        path: The adapter folder.
        missing: The adapter keys PEFT reported missing, where known.
        key_mapping: ``from_pretrained``'s ``key_mapping``; with one, the file's names are the caller's business.
    """
    from peft.peft_model import PEFT_TYPE_TO_PREFIX_MAPPING

    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(peft_type)
    expected = _adapter_keys(peft_model, peft_type, adapter_name)
    if not prefix or not expected:
        return
    keys = _file_keys(path)
    no_prefix = key_mapping is None and keys is not None and not any(prefix in key for key in keys)
    if not no_prefix and (missing is None or not expected <= set(missing)):
        return
    held = "" if keys is None else f" (it holds {len(keys)} tensor(s){', e.g. ' + keys[0] if keys else ''})"
    raise CheckpointError(f"adapter {str(path)!r}: none of the {len(expected)} {peft_type} tensors this model expects "
                          f"(e.g. {min(expected)}) is in its weights file{held}; the weights are of another "
                          "adapter type or model, or the file is damaged")


def adapter_peft_type(path: str | os.PathLike) -> tuple[str, dict]:
    """The ``peft_type`` and the whole config of a saved adapter folder, after checking the folder.

    Args:
        path: A folder written by ``save_pretrained`` or ``peftplug export``.

    Raises:
        MissingFileError: If the folder does not exist.
        CheckpointError: If it is not a complete adapter folder (see :func:`peftplug.checkpoints.check_adapter_dir`).
    """
    from peftplug.checkpoints import ADAPTER_CONFIG, check_adapter_dir

    folder = check_adapter_dir(path)
    config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return str(config["peft_type"]).upper(), config


def _check_config_types(path: str | os.PathLike, cls: type, config: dict) -> None:
    """Refuses an ``adapter_config.json`` value of the wrong type (a hand-edited ``"r": "8"``) in one line naming
    the file and the field: PEFT does not check, and the value surfaced as a ``TypeError`` inside the layers.

    Args:
        path: The adapter folder.
        cls: The config class of its ``peft_type``.
        config: Its ``adapter_config.json``.
    """
    from peftplug.checkpoints import ADAPTER_CONFIG
    from peftplug.config_names import SAVED_BOOKKEEPING, check_init_types

    try:
        check_init_types(cls, {k: v for k, v in config.items() if k not in SAVED_BOOKKEEPING}, ADAPTER_CONFIG)
    except ConfigError as err:
        raise CheckpointError(f"adapter {str(path)!r}: {err} (edited by hand? re-save the adapter with "
                              "save_pretrained or peftplug export)") from None


def load_adapter(
    model: Any,
    path: str | os.PathLike,
    adapter_name: str = "default",
    is_trainable: bool = False,
    quantization: str | None = None,
    num_labels: int | None = None,
    dtype: str | None = None,
    **kwargs: Any,
):
    """Loads a saved adapter onto a base model, first importing the peftplug package its ``peft_type`` needs.

    Works for every type PEFT knows and for peftplug's (``OFTV2`` -> ``oftv2``, ``PCT`` -> ``prompt_transfer``,
    ``STEERING`` -> ``steering``), in a process that imported none of them.

    Args:
        model: The base model (a ``torch.nn.Module``), or a model name resolved like a recipe's
            (:func:`peftplug.loading.load_model`; e.g. ``"smollm2-135m-instruct"``, the packaged copy of the
            ``HuggingFaceTB/SmolLM2-135M-Instruct`` that adapters of it record), loaded for the adapter's task; or
            a ``PeftModel``, to which the adapter is added under ``adapter_name`` (PEFT's ``load_adapter``: it
            stays inactive until ``set_adapter``), and which is returned. A built model's 4-bit layers are kept in
            their exact layout (:func:`peftplug.quantized_layout.keep_exact_4bit_layout`).
        path: The adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        adapter_name: Name the adapter gets in the ``PeftModel``.
        is_trainable: Load it for further training (default: inference mode, as PEFT).
        quantization: With a model name: ``none``, ``nf4``, ``fp4`` or ``int8``. ``None`` (default): the one the
            adapter was trained on, from the folder's ``peftplug_base.json`` (written by ``peftplug export``), or
            ``none`` for a folder without one. A value that differs from the record loads that base, with a warning.
        num_labels: With a model name and a ``SEQ_CLS`` adapter: the number of classes.
        dtype: With a model name: ``float32``, ``bfloat16`` or ``float16``, as :func:`peftplug.loading.load_model`
            takes it (a recipe's ``model.dtype``). With ``nf4``/``fp4`` it is the 4-bit layers' compute dtype, so it
            changes the outputs. ``None`` (default): the recorded one, as for ``quantization``, or ``float32``
            without a record (PEFT itself writes no dtype: a ``save_pretrained`` folder needs it given).
        **kwargs: Passed to ``PeftModel.from_pretrained``.

    Returns:
        The ``PeftModel``.

    Raises:
        MissingFileError, CheckpointError: If ``path`` is not a complete adapter folder, or (with a model name) its
            ``peftplug_base.json`` is damaged or foreign (see :func:`peftplug.adapter_export.read_base_record`).
        CheckpointError: If a tensor of the adapter has another shape than the model's (another base: one line
            naming the first tensor, both shapes and the recorded base), or the weights file holds none of the
            adapter's tensors (another adapter type's weights, an empty file); some missing only warn, as in PEFT.
        peftplug.quantized_layout.RepackedWeightError: If a built model's 4-bit weights were already repacked by
            an eval forward on an AVX512-BF16 CPU (their exact values are lost).
        peftplug.registry.UnregisteredAdapterError: If neither PEFT nor peftplug provides the adapter's type (one
            line naming the types peftplug provides).
        ConfigError: If ``model`` is neither a module nor a name, the adapter's task has no peftplug task, or
            ``quantization`` / ``dtype`` is not an accepted value, or other than ``none`` / ``float32`` with a built
            ``model``, or a ``PeftModel`` already has an adapter named ``adapter_name``.

    Warns:
        UserWarning: If a given ``quantization`` or ``dtype``, or a built model's, differs from the folder's record
            (naming both).
    """
    import torch
    from peft import PeftModel

    from peftplug.loading import DTYPES, PEFT_TASK_TYPES, QUANTIZATIONS, check_choice, load_model
    from peftplug.methods import peft_config_classes
    from peftplug.registry import UnregisteredAdapterError, unknown_type_message

    # Checked before anything loads, and refused with a built model, which is used as it is (not cast or quantized).
    if quantization is not None:
        check_choice("quantization", quantization, QUANTIZATIONS)
    if dtype is not None:
        check_choice("dtype", dtype, tuple(DTYPES))
    if isinstance(model, torch.nn.Module) and (quantization or "none", dtype or "float32") != ("none", "float32"):
        raise ConfigError("quantization and dtype apply to a model name only; a built model is used as it is (load "
                          f"it quantized or cast yourself); got quantization={quantization!r}, dtype={dtype!r}")
    peft_type, config = adapter_peft_type(path)
    if peft_type not in peft_config_classes(peft_type):
        raise UnregisteredAdapterError(f"adapter {str(path)!r}: {unknown_type_message(peft_type)}")
    _check_config_types(path, peft_config_classes(peft_type)[peft_type], config)
    if isinstance(model, (str, os.PathLike)):
        # Reversed, so that CAUSAL_LM maps to causal_lm rather than prompt_cls (both wrap a causal LM).
        tasks = {peft_task: task for task, peft_task in reversed(PEFT_TASK_TYPES.items())}
        task_type = config.get("task_type") or "CAUSAL_LM"
        if task_type not in tasks:
            raise ConfigError(f"adapter {str(path)!r} has task_type {task_type!r}; a model name loads for "
                              f"{', '.join(sorted(tasks))} only (load the base model yourself and pass it)")
        quantization, dtype = _base_settings(path, quantization, dtype)
        pad_token_id = None
        if tasks[task_type] == "seq_cls" and num_labels is None:
            raise ConfigError(f"adapter {str(path)!r} is a SEQ_CLS adapter: pass num_labels= (its number of "
                              "classes), with which the model's classification head is built")
        if tasks[task_type] == "seq_cls":
            # As PeftModule trained it: the config's pad id is its tokenizer's (EOS where the tokenizer had no pad),
            # which a decoder-only classifier pools by. The export holds that tokenizer; else the model's own.
            from peftplug.loading import load_tokenizer

            source = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else model
            try:
                pad_token_id = load_tokenizer(str(source)).pad_token_id
            except (PeftplugError, OSError, ValueError):  # no tokenizer to read it from: the model config's own
                pad_token_id = None
        model = load_model(str(model), tasks[task_type], quantization, dtype, num_labels=num_labels,
                           pad_token_id=pad_token_id)
    elif not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or a model name; got {type(model).__name__}")
    else:
        # A model built by the caller: bitsandbytes would repack its 4-bit weights at the first eval forward on
        # AVX512-BF16 CPUs (scales rounded to bf16: logits ~3e-3 off the trained model), and one an earlier forward
        # repacked has lost its exact weights; load_model protects the models it loads the same way.
        keep_exact_4bit_layout(model)
        _check_built_base(path, model)
    if isinstance(model, PeftModel):
        return _into_peft_model(model, path, peft_type, config, adapter_name, is_trainable, kwargs)
    try:
        peft_model = PeftModel.from_pretrained(model, str(path), adapter_name=adapter_name, is_trainable=is_trainable,
                                               **kwargs)
    except RuntimeError as err:
        mismatch = _size_mismatch_error(err, path, config)
        if mismatch is None:
            raise
        raise mismatch from None
    _refuse_nothing_loaded(peft_model, peft_type, adapter_name, path, key_mapping=kwargs.get("key_mapping"))
    return peft_model


def _into_peft_model(model: Any, path: str | os.PathLike, peft_type: str, config: dict, adapter_name: str,
                     is_trainable: bool, kwargs: dict) -> Any:
    """Adds a saved adapter to a ``PeftModel`` as PEFT does (``model.load_adapter``); returns the same model.

    ``PeftModel.from_pretrained`` on a ``PeftModel`` nests it in a second one, whose keys no file holds: the
    adapter came back freshly initialised, with only a warning.

    Args:
        model: The ``PeftModel``.
        path: The adapter folder.
        peft_type: Its type.
        config: Its ``adapter_config.json``.
        adapter_name: The name the new adapter gets.
        is_trainable: Load it for further training (else frozen, as PEFT).
        kwargs: Passed to ``PeftModel.load_adapter``.
    """
    if adapter_name in model.peft_config:
        raise ConfigError(f"model already has an adapter named {adapter_name!r} (it has "
                          f"{', '.join(map(repr, model.peft_config))}); pass another adapter_name to add "
                          f"{str(path)!r} beside it")
    try:
        result = model.load_adapter(str(path), adapter_name=adapter_name, is_trainable=is_trainable, **kwargs)
    except RuntimeError as err:
        mismatch = _size_mismatch_error(err, path, config)
        if mismatch is None:
            raise
        raise mismatch from None
    # PEFT filters the missing keys by `adapter_name in key`, which a short name ("b") matches in every key.
    own = _adapter_keys(model, peft_type, adapter_name)
    missing = [key for key in result.missing_keys if key in own]
    _refuse_nothing_loaded(model, peft_type, adapter_name, path, missing, kwargs.get("key_mapping"))
    if missing:  # from_pretrained warns about these; load_adapter only returns them, and this function the model
        warnings.warn(f"{_MISSING_WARNING}{missing}.", UserWarning, stacklevel=3)
    return model


__all__ = ["adapter_peft_type", "load_adapter"]
