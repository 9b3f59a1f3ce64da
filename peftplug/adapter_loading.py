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
import warnings
from typing import Any

from peftplug.adapter_export import BASE_RECORD, read_base_record
from peftplug.errors import ConfigError


def _base_settings(path: str | os.PathLike, quantization: str | None, dtype: str | None) -> tuple[str, str]:
    """The ``quantization`` and ``dtype`` to load a model name with: the given ones, else the folder's record,
    else ``none``/``float32``; warns when a given one differs from the record."""
    record = read_base_record(path)
    if record is None:
        return quantization or "none", dtype or "float32"
    given = {"quantization": quantization, "dtype": dtype}
    differing = [field for field, value in given.items() if value is not None and value != record[field]]
    if differing:
        # Loading onto another base may be meant (a float32 copy of an nf4-trained adapter), so a warning, not an error.
        asked = ", ".join(f"{field}={given[field]!r}" for field in differing)
        recorded = ", ".join(f"{field}={record[field]!r}" for field in differing)
        warnings.warn(f"adapter {str(path)!r} was trained on {record['model']!r} with {recorded} (its {BASE_RECORD}); "
                      f"loading it with {asked} as asked, which is another model than the trained one (leave them "
                      "out to load the recorded base)", UserWarning, stacklevel=3)
    return quantization or record["quantization"], dtype or record["dtype"]


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
            ``HuggingFaceTB/SmolLM2-135M-Instruct`` that adapters of it record), loaded for the adapter's task.
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
        peftplug.registry.UnregisteredAdapterError: If neither PEFT nor peftplug provides the adapter's type (one
            line naming the types peftplug provides).
        ConfigError: If ``model`` is neither a module nor a name, the adapter's task has no peftplug task, or
            ``quantization`` / ``dtype`` is not an accepted value, or other than ``none`` / ``float32`` with a built
            ``model``.

    Warns:
        UserWarning: If a given ``quantization`` or ``dtype`` differs from the folder's record (naming both).
    """
    import torch
    from peft import PeftModel
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from peftplug.loading import DTYPES, PEFT_TASK_TYPES, QUANTIZATIONS, check_choice, load_model
    from peftplug.methods import import_plugin_for
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
    import_plugin_for(peft_type)
    if peft_type not in {getattr(key, "value", key) for key in PEFT_TYPE_TO_CONFIG_MAPPING}:
        raise UnregisteredAdapterError(f"adapter {str(path)!r}: {unknown_type_message(peft_type)}")
    if isinstance(model, (str, os.PathLike)):
        # Reversed, so that CAUSAL_LM maps to causal_lm rather than prompt_cls (both wrap a causal LM).
        tasks = {peft_task: task for task, peft_task in reversed(PEFT_TASK_TYPES.items())}
        task_type = config.get("task_type") or "CAUSAL_LM"
        if task_type not in tasks:
            raise ConfigError(f"adapter {str(path)!r} has task_type {task_type!r}; a model name loads for "
                              f"{', '.join(sorted(tasks))} only (load the base model yourself and pass it)")
        quantization, dtype = _base_settings(path, quantization, dtype)
        model = load_model(str(model), tasks[task_type], quantization, dtype, num_labels=num_labels)
    elif not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or a model name; got {type(model).__name__}")
    return PeftModel.from_pretrained(model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, **kwargs)


__all__ = ["adapter_peft_type", "load_adapter"]
