"""Loading a saved adapter of any type, peftplug's or PEFT's own: :func:`load_adapter` (``peftplug.load_adapter``).

``PeftModel.from_pretrained`` finds an adapter's config class by its ``peft_type`` in a dict that only holds the
types registered so far. PEFT 0.21 has no hook through which a plugin could register itself on demand (no entry
points, and its ``auto_mapping`` imports only the base model's class, from an allowlist), so in a fresh process an
OFTv2 adapter fails there with a bare ``KeyError: 'OFTV2'`` unless ``oftv2`` was imported first. This function
reads the type from ``adapter_config.json``, imports the package that provides it, and then lets PEFT load it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from peftplug.errors import ConfigError


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
    quantization: str = "none",
    num_labels: int | None = None,
    dtype: str = "float32",
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
        quantization: With a model name: ``none``, ``nf4``, ``fp4`` or ``int8`` (the base the adapter was trained on).
        num_labels: With a model name and a ``SEQ_CLS`` adapter: the number of classes.
        dtype: With a model name: ``float32`` (default), ``bfloat16`` or ``float16``, as
            :func:`peftplug.loading.load_model` takes it -- the ``dtype`` the adapter was trained with (a recipe's
            ``model.dtype``). With ``nf4``/``fp4`` it is the 4-bit layers' compute dtype, so it changes the outputs:
            give the training one to get the trained model's logits. The adapter folder does not record it (PEFT
            writes no dtype, and the adapter's own weights are float32 either way), hence no other default.
        **kwargs: Passed to ``PeftModel.from_pretrained``.

    Returns:
        The ``PeftModel``.

    Raises:
        MissingFileError, CheckpointError: If ``path`` is not a complete adapter folder.
        peftplug.registry.UnregisteredAdapterError: If neither PEFT nor peftplug provides the adapter's type (one
            line naming the types peftplug provides).
        ConfigError: If ``model`` is neither a module nor a name, the adapter's task has no peftplug task, or
            ``quantization`` / ``dtype`` is not an accepted value, or not the default with a built ``model``.
    """
    import torch
    from peft import PeftModel
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from peftplug.loading import DTYPES, PEFT_TASK_TYPES, QUANTIZATIONS, check_choice, load_model
    from peftplug.methods import import_plugin_for
    from peftplug.registry import UnregisteredAdapterError, unknown_type_message

    # Checked before anything loads, and refused with a built model, which is used as it is (not cast or quantized).
    check_choice("quantization", quantization, QUANTIZATIONS)
    check_choice("dtype", dtype, tuple(DTYPES))
    if isinstance(model, torch.nn.Module) and (quantization, dtype) != ("none", "float32"):
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
        model = load_model(str(model), tasks[task_type], quantization, dtype, num_labels=num_labels)
    elif not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or a model name; got {type(model).__name__}")
    return PeftModel.from_pretrained(model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, **kwargs)


__all__ = ["adapter_peft_type", "load_adapter"]
