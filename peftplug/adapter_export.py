"""Writing an exported adapter folder: :func:`export_module` (``PeftModule.export``) and peftplug's record of the base.

PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``) names the base model but not how it was
loaded: its quantization and dtype are missing, and with ``nf4``/``fp4`` the dtype is the 4-bit layers' compute
dtype, part of the trained model. So an export from a :class:`peftplug.lightning.PeftModule` adds
:data:`BASE_RECORD` (:func:`write_base_record`), which :func:`peftplug.load_adapter` reads for its defaults
(:func:`read_base_record`). PEFT ignores files it does not know, so ``PeftModel.from_pretrained`` loads the folder
as before.

The record, a JSON object::

    {"format": "peftplug-base/1", "model": "tiny:llama", "quantization": "nf4", "dtype": "bfloat16"}

``model`` is the name as the recipe gave it (``model.model``; for the packaged SmolLM2 ``smollm2-135m-instruct``,
where ``adapter_config.json`` records the Hub id of the original), ``quantization`` and ``dtype`` the recipe's
``model.quantization`` and ``model.dtype``. Readers ignore keys they do not know; another ``format`` is refused.

Not a leaf, but it imports only leaves at module level (and :mod:`peftplug.loading` and PEFT inside functions), so
the trainer, the export command and :mod:`peftplug.adapter_loading` may all import it without an import circle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peftplug.errors import CheckpointError, ConfigError, MissingFileError, PeftplugError, one_line
from peftplug.fileio import atomic_directory, atomic_write, usual_mode

BASE_RECORD = "peftplug_base.json"
BASE_RECORD_FORMAT = "peftplug-base/1"
_EXPECTED_RECORD = f"expected peftplug's record of the adapter's base model (format {BASE_RECORD_FORMAT!r})"


def write_base_record(folder: str | os.PathLike, model: str, quantization: str, dtype: str) -> Path:
    """Writes :data:`BASE_RECORD` into an adapter folder: the base model as it was loaded for training.

    Written atomically, with the mode a new file gets under the umask like the rest of an export (the temporary
    file of ``mkstemp`` alone would leave it private, 0600).

    Args:
        folder: The adapter folder (or an export's staging folder).
        model: The model name as :func:`peftplug.loading.load_model` was given it (a recipe's ``model.model``).
        quantization: ``none``, ``nf4``, ``fp4`` or ``int8``.
        dtype: ``float32``, ``bfloat16`` or ``float16`` (with ``nf4``/``fp4`` the compute dtype).

    Returns:
        The written file.
    """
    record = {"format": BASE_RECORD_FORMAT, "model": str(model), "quantization": quantization, "dtype": dtype}
    text = json.dumps(record, indent=2) + "\n"

    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")
        usual_mode(tmp, directory=False)

    return atomic_write(Path(folder) / BASE_RECORD, write)


def write_module_base_record(folder: str | os.PathLike, module: Any) -> Path | None:
    """Writes the :data:`BASE_RECORD` of a ``PeftModule``'s adapter into ``folder``, when there is one to write.

    Nothing is written for a module built around a model object (Python use): how that model was loaded (quantized
    or cast by the user) is unknown, and a record of ``none``/``float32`` could be wrong.

    Args:
        folder: The folder the adapter was saved into.
        module: A :class:`peftplug.lightning.PeftModule` (its ``hparams`` hold ``model``, ``quantization``, ``dtype``).

    Returns:
        The written file, or ``None``.
    """
    hparams = module.hparams
    if not isinstance(hparams.get("model"), str):
        return None
    return write_base_record(folder, hparams["model"], hparams.get("quantization", "none"),
                             hparams.get("dtype", "float32"))


def read_base_record(folder: str | os.PathLike) -> dict | None:
    """The checked :data:`BASE_RECORD` of an adapter folder, or ``None`` if it has none (a folder written by
    ``save_pretrained``, or by a peftplug from before the record).

    Args:
        folder: The adapter folder.

    Returns:
        ``{"format", "model", "quantization", "dtype"}`` (keys beyond these are dropped), or ``None``.

    Raises:
        CheckpointError: If the file is unreadable, not valid JSON, not an object, of another format, or holds a
            ``model``, ``quantization`` or ``dtype`` peftplug cannot load (one line naming the file and the field).
    """
    from peftplug.loading import DTYPES, QUANTIZATIONS

    path = Path(folder).expanduser() / BASE_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"{str(path)!r} cannot be read ({err.strerror or err}); {_EXPECTED_RECORD}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({one_line(err, 120)}); {_EXPECTED_RECORD}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(record).__name__}, not an object; {_EXPECTED_RECORD}")
    if record.get("format") != BASE_RECORD_FORMAT:
        found = f"format {record['format']!r}" if "format" in record else "no 'format'"
        raise CheckpointError(f"{str(path)!r} has {found}; this peftplug reads {BASE_RECORD_FORMAT!r} (written by "
                              "another program or peftplug version? remove the file, or pass quantization= and "
                              "dtype=)")
    if not isinstance(record.get("model"), str) or not record["model"]:
        raise CheckpointError(f"{str(path)!r}: 'model' must be a non-empty model name; got {record.get('model')!r}")
    for field, accepted in (("quantization", QUANTIZATIONS), ("dtype", tuple(DTYPES))):
        if record.get(field) not in accepted:
            raise CheckpointError(f"{str(path)!r}: {field!r} must be one of {', '.join(accepted)}; got "
                                  f"{record.get(field)!r}")
    return {key: record[key] for key in ("format", "model", "quantization", "dtype")}


def _untie_adapted_weights(peft_model: Any) -> list[str]:
    """Gives every module that shares its weight with an adapted layer (``tie_word_embeddings``: the output head
    and the input embedding hold one tensor) its own copy, so that merging changes the adapted layer only.

    Unmerged, an adapter on a tied ``embed_tokens`` (or ``lm_head``) changes that layer alone: the other one still
    computes with the base weight. ``merge_and_unload`` writes the update into the shared tensor, so the merged model
    changed the head too and computed something else than the trained adapter (logits off by 0.3 to 30 on a tiny
    GPT-2), silently. Untied first, each layer merges into its own weight and the saved model (now with
    ``tie_word_embeddings=False``, one more matrix) equals the adapter. Trainable tokens are left tied: PEFT adapts
    both tied layers alike there, so the shared tensor merged is right.

    Args:
        peft_model: The ``PeftModel`` about to be merged.

    Returns:
        The paths of the modules that got their own copy.
    """
    import torch
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = peft_model.get_base_model()
    holders: dict[int, list[tuple[str, Any, str]]] = {}
    seen = set()
    for path, owner in base.named_modules(remove_duplicate=False):
        for name, param in owner.named_parameters(recurse=False):
            if (id(owner), name) not in seen:  # a module reused under two paths holds its weight once
                seen.add((id(owner), name))
                holders.setdefault(id(param), []).append((path, owner, name))
    adapted = []
    for layer in base.modules():
        if isinstance(layer, BaseTunerLayer) and not isinstance(layer, TrainableTokensLayer):
            weight = getattr(layer.get_base_layer(), "weight", None)
            if isinstance(weight, torch.nn.Parameter) and id(weight) not in adapted:
                adapted.append(id(weight))
    untied = []
    for key in adapted:
        for path, owner, name in holders.get(key, [])[1:]:  # the first keeps the tensor, the others get copies
            shared = getattr(owner, name)
            if type(shared) is not torch.nn.Parameter:  # a quantized tensor is never tied: nothing to copy
                continue
            setattr(owner, name, torch.nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad))
            untied.append(path)
    if untied:
        # Else from_pretrained would tie the saved head to the merged embedding again (and save_pretrained drop it).
        configs = [getattr(base, "config", None)]
        text = getattr(configs[0], "get_text_config", None)
        configs.append(text() if callable(text) else None)
        for config in configs:
            if config is not None and getattr(config, "tie_word_embeddings", False):
                config.tie_word_embeddings = False
    return untied


def export_module(module: Any, output: str | os.PathLike, merge: bool = False, overwrite: bool = False) -> Path:
    """What :meth:`peftplug.lightning.PeftModule.export` does: writes the adapter (PEFT ``save_pretrained`` layout
    plus :data:`BASE_RECORD`) or the merged full model, plus the tokenizer.

    The directory appears atomically: it is written next to ``output`` and renamed into place.

    Args:
        module: The ``PeftModule``.
        output: Target directory.
        merge: Merge the adapter into the base weights (``merge_and_unload``) and save a plain model (no record: it
            is a model folder, loaded as such). A layer that shares its weight with an adapted one (tied embeddings)
            gets its own copy first (:func:`_untie_adapted_weights`), so the merged model equals the adapter.
        overwrite: Replace an existing non-empty ``output``.

    Raises:
        MissingFileError: If ``output`` exists, is not empty, and ``overwrite`` is not set.
        ConfigError: If ``merge`` is asked for a module without an adapter, for a prompt-learning adapter (nothing
            to merge into the weights), or the adapter's tuner refuses the merge (its reason in one line); nothing
            is written then.
    """
    from peft import PeftModel

    target = Path(output).expanduser().resolve()
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise MissingFileError(f"export directory {str(target)!r} exists and is not empty (use --overwrite)")
    adapter = isinstance(module.model, PeftModel)
    if merge and not adapter:
        raise ConfigError("--merge needs a model with a PEFT adapter")
    config = module.model.peft_config.get(module.model.active_adapter) if adapter else None
    if merge and getattr(config, "is_prompt_learning", False):
        # Such an adapter (prompt tuning, prefix tuning, PCT) adds tokens or cached keys to every input, not a
        # weight update: PEFT has no merge_and_unload for it (an AttributeError deep inside PEFT, before).
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise ConfigError(f"--merge: a {kind} adapter is a learned prompt, not a change of the weights, so it cannot "
                          "be merged into the base model; export the adapter without --merge")
    # atomic_directory (as --as_lora uses): the folder gets the umask's mode, not mkdtemp's 0700, and an
    # overwritten export is moved aside before the new one is renamed in, so a crash leaves one of the two.
    with atomic_directory(target, overwrite=target.exists()) as staging:
        if merge:
            _untie_adapted_weights(module.model)
            try:
                merged = module.model.merge_and_unload()
            except ValueError as err:
                if isinstance(err, PeftplugError):
                    raise
                # The tuner's own refusal, checked before any weight changes (a steering vector that acts on some
                # positions only, a block without a bias that holds it exactly): one line, not a traceback.
                raise ConfigError(f"--merge: {one_line(err, 300)}; export the adapter without --merge") from err
            merged.save_pretrained(staging)
        else:
            module.model.save_pretrained(staging)
            if adapter:  # a module without an adapter saved a whole model: nothing for load_adapter to read
                write_module_base_record(staging, module)
        if module.tokenizer is not None:
            module.tokenizer.save_pretrained(staging)
    return target


__all__ = [
    "BASE_RECORD",
    "BASE_RECORD_FORMAT",
    "export_module",
    "read_base_record",
    "write_base_record",
    "write_module_base_record",
]
