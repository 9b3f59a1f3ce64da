"""Reading peftplug checkpoints and PEFT adapter folders safely, with one-line errors that name the file.

A checkpoint is a user-supplied file, and ``torch.load`` of a pickle can run arbitrary code. So checkpoints are
only ever loaded with ``weights_only=True``, allowing exactly the Python objects our checkpoints contain beyond
tensors and plain containers (see :data:`SAFE_GLOBALS`). Before PEFT or Lightning sees a file, it is checked here
so that a wrong file gives a :class:`peftplug.errors.CheckpointError` saying which file and what was expected,
rather than an error from deep inside the unpickler (``invalid literal for int() with base 10``).

- :func:`read_checkpoint`: the checked checkpoint dict of a ``peftplug fit`` checkpoint.
- :func:`load_checkpoint_module`: the :class:`peftplug.lightning.PeftModule` of such a checkpoint.
- :func:`check_adapter_dir`: a PEFT adapter folder has ``adapter_config.json`` and a readable, complete
  ``adapter_model.safetensors``.

The module imports nothing heavy at import time (torch, PEFT and Lightning are imported by the functions).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from peftplug.errors import CheckpointError, ConfigError, MissingFileError, PeftplugError, one_line
from peftplug.fileio import safetensors_problem

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_EXPECTED_CKPT = "expected a .ckpt file written by `peftplug fit`"
# What torch.load of bytes that are not a (whole) checkpoint usually raises: UnpicklingError, RuntimeError from the
# zip reader, EOFError, ValueError from the legacy format's magic number, ... A damaged data.pkl can also make the
# weights-only unpickler fail with any other exception (KeyError on a memo index, TypeError on an unhashable key):
# every one of them means "this file is not a readable checkpoint", so the loaders catch Exception as a whole,
# except MemoryError (a real shortage, not the file's fault).
_TORCH_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, UnicodeDecodeError,
                      zipfile.BadZipFile)


def safe_globals() -> list[Any]:
    """The classes, beyond torch's defaults, that ``weights_only`` loading of a peftplug checkpoint may create.

    A checkpoint's ``hyper_parameters`` hold the ``PeftModule`` arguments. From ``peftplug fit`` these are plain
    values, but a module built in Python with ``peft={"peft_type": PeftType.LORA, "task_type": TaskType.CAUSAL_LM,
    ...}`` keeps PEFT's enums there (plain ``str`` enums, safe to rebuild by value). Nothing else is needed: the
    tests load real checkpoints from ``peftplug fit`` (first-order and zeroth-order optimizers, LR schedulers,
    data modules that save hyperparameters) with exactly this list.
    """
    from peft.utils.peft_types import PeftType, TaskType

    return [PeftType, TaskType]


def _not_a_checkpoint(path: Path, err: BaseException) -> CheckpointError:
    """Explains why ``torch.load`` could not read ``path``, from the file's own bytes where possible."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as os_err:
        return CheckpointError(f"checkpoint {str(path)!r} cannot be read: {os_err.strerror}")
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            return CheckpointError(
                f"checkpoint {str(path)!r} is truncated or damaged (its zip archive cannot be read); {_EXPECTED_CKPT}"
            )
        if not any(name.endswith("data.pkl") for name in names):
            return CheckpointError(f"checkpoint {str(path)!r} is a zip archive but not a PyTorch checkpoint "
                                   f"(no data.pkl); {_EXPECTED_CKPT}")
    elif not head.startswith(b"\x80"):  # neither torch's zip format nor a legacy pickle (protocol >= 2)
        return CheckpointError(f"checkpoint {str(path)!r} is not a PyTorch checkpoint; {_EXPECTED_CKPT}")
    if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):
        # torch names the global in "Unsupported global: GLOBAL module.Class was not an allowed global ..."
        detail = str(err).split("Unsupported global:", 1)[1].split(" was not", 1)[0].replace("GLOBAL", "").strip()
        return CheckpointError(
            f"checkpoint {str(path)!r} contains Python objects that peftplug does not unpickle ({detail}): it was "
            f"not written by `peftplug fit`, and loading it fully could run code from the file; {_EXPECTED_CKPT}"
        )
    if not isinstance(err, _TORCH_LOAD_ERRORS):  # a KeyError's text alone is just the key: name the type
        return CheckpointError(f"checkpoint {str(path)!r} is damaged (its pickled data cannot be read: "
                               f"{type(err).__name__} {one_line(err, 160)}); {_EXPECTED_CKPT}")
    return CheckpointError(f"checkpoint {str(path)!r} cannot be read ({one_line(err, 200)}); {_EXPECTED_CKPT}")


def read_checkpoint(ckpt_path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """Loads a ``peftplug fit`` checkpoint with ``weights_only=True`` and checks that it is one.

    Args:
        ckpt_path: The ``.ckpt`` file.
        map_location: Passed to ``torch.load``.
        mmap: Memory-map the tensors instead of reading them (for a quick look at the metadata).

    Returns:
        The checkpoint dict; ``checkpoint["peftplug"]`` holds the adapter-only format and task, and
        ``checkpoint["hyper_parameters"]`` the ``PeftModule`` arguments (``model`` is a name or path).

    Raises:
        MissingFileError: If the file does not exist.
        CheckpointError: If the file is not a PyTorch checkpoint (garbage, a foreign zip, truncated), contains
            objects outside :func:`safe_globals`, is not a Lightning checkpoint, or is a Lightning checkpoint of
            another module than peftplug's ``PeftModule``.
    """
    import torch

    from peftplug.lightning import CHECKPOINT_FORMAT, CHECKPOINT_KEY

    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        hint = " (it looks like an adapter folder)" if (path / ADAPTER_CONFIG).is_file() else ""
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory{hint}; {_EXPECTED_CKPT}")
    if not path.is_file():
        raise MissingFileError(f"checkpoint {str(path)!r} does not exist")
    with open(path, "rb") as f:
        zipped = f.read(2) == b"PK"  # torch only memory-maps its zip format, not legacy pickles
    try:
        with torch.serialization.safe_globals(safe_globals()):
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and zipped)
    except MemoryError:
        raise
    except Exception as err:  # all mean "this file is not a readable checkpoint" (see _TORCH_LOAD_ERRORS)
        raise _not_a_checkpoint(path, err) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {str(path)!r} is a PyTorch file but not a Lightning checkpoint "
                              f"(no 'state_dict'); {_EXPECTED_CKPT}")
    meta = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a Lightning checkpoint but not a peftplug adapter checkpoint "
            f"(no {CHECKPOINT_KEY!r} entry, so it was not written by peftplug's PeftModule); {_EXPECTED_CKPT}"
        )
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format')!r}; this peftplug reads "
                              f"{CHECKPOINT_FORMAT!r}")
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict) or not isinstance(hparams.get("model"), str):
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not record the model name (hyper_parameters.model): its module was "
            "built from a model object in Python, so the base model cannot be reloaded by name"
        )
    return checkpoint


def check_resumable(checkpoint: dict, ckpt_path: str | os.PathLike) -> None:
    """Refuses to resume ``fit`` from a checkpoint that holds the adapter but not the training state.

    ``ModelCheckpoint(save_weights_only=True)`` writes no optimizer, LR scheduler or callback states; Lightning's
    ``fit(ckpt_path=...)`` of such a file ended in a ``KeyError`` traceback after the model had loaded. Such a file
    is fine for ``validate``/``test``/``predict``/``export``/``generate``.

    Args:
        checkpoint: A dict from :func:`read_checkpoint`.
        ckpt_path: Its path, for the message.

    Raises:
        CheckpointError: If the checkpoint has no ``optimizer_states``.
    """
    if "optimizer_states" not in checkpoint:
        raise CheckpointError(
            f"--ckpt_path {str(ckpt_path)!r} cannot resume fit: it holds the adapter but no optimizer, LR scheduler "
            "or callback state (written by ModelCheckpoint with save_weights_only: true); use it with validate, test, "
            "predict, export or generate, or write resumable checkpoints (save_weights_only: false)"
        )


def find_best_checkpoint(root: str | os.PathLike) -> Path:
    """What ``--ckpt_path best`` resolves to in a new process: the best checkpoint that the run's newest checkpoint
    records (its first ``ModelCheckpoint``'s ``best_model_path``, as Lightning's own ``"best"`` uses the trainer's
    first one; with no ``monitor`` that is the newest checkpoint it saved).

    Lightning resolves ``"best"`` from the ``ModelCheckpoint`` of the trainer that has just run ``fit``: in a
    ``peftplug fit``/``validate``/``test`` of its own that trainer has trained nothing yet, so Lightning's ``"best"``
    always failed there with a traceback.

    Args:
        root: The run's ``trainer.default_root_dir``.

    Raises:
        ConfigError: If the run's newest checkpoint records no best checkpoint, or that file is gone.
        MissingFileError, CheckpointError: If the run has no checkpoint, or its newest cannot be read.
    """
    from peftplug.resume import find_last_checkpoint

    newest = find_last_checkpoint(root, asked="best")
    states = read_checkpoint(newest, mmap=True).get("callbacks") or {}
    recorded = next((state.get("best_model_path") for key, state in states.items()
                     if str(key).startswith("ModelCheckpoint") and isinstance(state, dict)), None)
    if not recorded:
        raise ConfigError(
            f"ckpt_path: 'best': the run's newest checkpoint {str(newest)!r} records no best checkpoint (no "
            "ModelCheckpoint had saved one); give the path of a .ckpt file, or add a ModelCheckpoint with a monitor "
            "(docs/cli.md)"
        )
    best = Path(recorded)
    if not best.is_file() and (newest.parent / best.name).is_file():
        best = newest.parent / best.name  # the run's folder was moved or copied since: the file is beside it
    if not best.is_file():
        raise ConfigError(f"ckpt_path: 'best' is {recorded!r} (recorded in {str(newest)!r}), which no longer exists")
    return best


def describe_checkpoint(checkpoint: dict) -> str:
    """A short description of what a checked checkpoint holds, e.g. ``model 'tiny:llama' with adapter LORA``.

    Args:
        checkpoint: A dict from :func:`read_checkpoint`.
    """
    hparams = checkpoint["hyper_parameters"]
    peft = hparams.get("peft")
    peft_type = getattr(peft, "peft_type", None) or (peft.get("peft_type") if isinstance(peft, dict) else None)
    if isinstance(peft, dict) and peft_type is None and "class_path" in peft:
        peft_type = str(peft["class_path"]).rsplit(".", 1)[-1]
    adapter = "no adapter" if peft is None else f"adapter {getattr(peft_type, 'value', peft_type)}"
    return f"model {hparams['model']!r} with {adapter}"


def load_checkpoint_module(ckpt_path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The :class:`peftplug.lightning.PeftModule` of a ``peftplug fit`` checkpoint, base model reloaded by name.

    The file is checked with :func:`read_checkpoint` first (memory-mapped, so tensors are not read twice), then
    loaded by Lightning's ``load_from_checkpoint`` with ``weights_only=True`` and the same allowlist.

    Args:
        ckpt_path: The ``.ckpt`` file.
        map_location: Device the adapter tensors are loaded to.

    Raises:
        MissingFileError: If the file does not exist.
        CheckpointError: If the file is not a peftplug checkpoint (see :func:`read_checkpoint`), or its recorded
            settings do not build the module, or its tensors do not fit the model and adapter it records (a
            checkpoint of another model or adapter type, e.g. with edited hyperparameters or a changed model
            folder). The message names the file.
    """
    import torch
    from jsonargparse import ArgumentError

    from peftplug.lightning import PeftModule
    from peftplug.methods import import_method_packages

    import_method_packages()  # registers the plugin PEFT types the checkpoint may name

    path = Path(ckpt_path).expanduser()
    described = describe_checkpoint(read_checkpoint(path, map_location="cpu", mmap=True))
    try:
        with torch.serialization.safe_globals(safe_globals()):
            module = PeftModule.load_from_checkpoint(str(path), map_location=map_location, weights_only=True)
    except MissingFileError as err:
        raise MissingFileError(f"checkpoint {str(path)!r} ({described}): {err}") from err
    except PeftplugError as err:
        raise CheckpointError(f"checkpoint {str(path)!r} ({described}): {err}") from err
    except (ArgumentError, ValueError, TypeError) as err:
        # Lightning rebuilds the module from the recorded hyperparameters through jsonargparse: a failure there
        # means the recorded settings are not PeftModule arguments (edited, or from another peftplug version).
        raise CheckpointError(
            f"checkpoint {str(path)!r} ({described}): its recorded settings do not build a PeftModule: "
            f"{one_line(err, 300)}"
        ) from err
    return module


def _check_safetensors(path: Path) -> None:
    """Raises CheckpointError unless ``path`` has a readable safetensors header and all the bytes it promises."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise CheckpointError(f"adapter weights {str(path)!r}: {problem}; expected a complete safetensors file "
                              "(as written by save_pretrained)")


def _check_pickled_weights(path: Path) -> None:
    """Raises CheckpointError unless ``path`` (an ``adapter_model.bin``) loads as PEFT loads it: ``torch.load`` with
    ``weights_only=True``, to a dict of tensors. Memory-mapped where torch can (its zip format), so a large file is
    not read twice; garbage or a truncated file gave torch's multi-line ``UnpicklingError`` from inside PEFT."""
    import torch

    expected = "expected the tensors PEFT's save_pretrained writes (or adapter_model.safetensors)"
    try:
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        weights = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 -- a damaged pickle raises more than _TORCH_LOAD_ERRORS (KeyError...)
        # torch's own text is a paragraph advising weights_only=False, which would run code from a foreign file.
        if isinstance(err, OSError) and err.strerror:
            why = f"cannot be read: {err.strerror}"
        elif "Unsupported global" in str(err):
            why = "holds Python objects beyond tensors (not unpickled: that could run code from the file)"
        elif zipped or not isinstance(err, _TORCH_LOAD_ERRORS):
            why = "is truncated or damaged"
        else:
            why = "is not a PyTorch file (or is damaged)"
        raise CheckpointError(f"adapter weights {str(path)!r} {why}; {expected}") from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        held = type(weights).__name__ if not isinstance(weights, dict) else "dict with values other than tensors"
        raise CheckpointError(f"adapter weights {str(path)!r} hold a {held}; {expected}")


def check_adapter_dir(path: str | os.PathLike) -> Path:
    """Checks a PEFT adapter folder before PEFT loads it; returns it as a ``Path``.

    Args:
        path: A folder written by ``save_pretrained`` / ``peftplug export``.

    Returns:
        The folder.

    Raises:
        MissingFileError: If the folder does not exist.
        CheckpointError: If it is not a folder, has no (or an unreadable) ``adapter_config.json`` with a
            ``peft_type``, has no adapter weights, or its ``adapter_model.safetensors`` (or ``adapter_model.bin``) is
            truncated or damaged.
    """
    folder = Path(path).expanduser()
    expected = "expected an adapter folder written by save_pretrained or `peftplug export`"
    if not folder.exists():
        raise MissingFileError(f"adapter folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        hint = " (a checkpoint? use `peftplug export` to turn it into a folder)" if folder.suffix == ".ckpt" else ""
        raise CheckpointError(f"adapter {str(folder)!r} is a file, not a folder{hint}; {expected}")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise CheckpointError(f"adapter folder {str(folder)!r} has no {ADAPTER_CONFIG}; {expected}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(config_path)!r} is not valid JSON ({one_line(err, 120)}); {expected}") from None
    if not isinstance(config, dict) or "peft_type" not in config:
        raise CheckpointError(f"{str(config_path)!r} has no 'peft_type'; {expected}")
    weights = [folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()]
    if not weights:
        raise CheckpointError(f"adapter folder {str(folder)!r} has no {ADAPTER_WEIGHTS[0]}; {expected}")
    if weights[0].suffix == ".safetensors":
        _check_safetensors(weights[0])
    else:
        _check_pickled_weights(weights[0])
    return folder


__all__ = [
    "ADAPTER_CONFIG",
    "check_adapter_dir",
    "check_resumable",
    "describe_checkpoint",
    "load_checkpoint_module",
    "read_checkpoint",
    "safe_globals",
]
