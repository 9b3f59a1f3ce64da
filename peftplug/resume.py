"""What a resumed run needs beyond Lightning's own checkpoint content: the global RNG states, and where the run's
last checkpoint is.

Lightning's checkpoints hold the model, optimizer, LR scheduler, loop and callback states and (with
:mod:`peftplug.data.resumable`) the training loader's position, but not the random number generators. Dropout
draws from torch's global generator, so a resumed first-order run needs it back to equal the uninterrupted run;
:func:`rng_state` / :func:`restore_rng` carry torch (CPU and CUDA), Python and NumPy states in a form that
``torch.load(weights_only=True)`` reads (NumPy's key array as a tensor). Zeroth-order optimizers keep their own
generators in their ``state_dict`` already.

:func:`find_last_checkpoint` is what ``peftplug fit --ckpt_path last`` resolves to: the newest ``.ckpt`` under the
recipe's ``default_root_dir``. Lightning's own ``"last"`` looks only in the checkpoint folder of the *current*
logger version, which is a new, empty one in every run that has a logger.
(:func:`peftplug.checkpoints.find_best_checkpoint` does the same for ``"best"``.)

:func:`optimizer_settings` (before the restore) and :func:`replaced_optimizer_settings` /
:func:`note_replaced_optimizer_settings` (after it) name the optimizer settings of the config that the checkpoint's
optimizer state replaced (``Optimizer.load_state_dict`` restores the param groups: a resume with another ``lr`` kept
the checkpoint's without a word).

:func:`restore_loader_position` applies the training loader's saved position when Lightning created the loader
before restoring the checkpoint (runs sized by ``max_epochs`` whose ``configure_optimizers`` asks for
``trainer.estimated_stepping_batches``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from peftplug.errors import ConfigError

RNG_KEY = "peftplug_rng"
#: The file every ``torch.distributed.checkpoint`` folder holds (its index of the shards).
DISTRIBUTED_METADATA = ".metadata"


def rng_state() -> dict[str, Any]:
    """The global RNG states of torch (CPU, and CUDA when available), Python and NumPy, loadable weights-only."""
    import numpy as np
    from lightning.fabric.utilities.seed import _collect_rng_states

    states = _collect_rng_states(include_cuda=True)
    kind, keys, pos, has_gauss, cached = states["numpy"]
    import torch

    states["numpy"] = [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                       float(cached)]
    version, state, gauss = states["python"]
    states["python"] = [version, list(state), gauss]
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Sets the global RNG states saved by :func:`rng_state`.

    Args:
        states: From :func:`rng_state` (possibly through a checkpoint). A CUDA state is restored only where CUDA
            is available with as many devices.
    """
    import numpy as np
    import torch
    from lightning.fabric.utilities.seed import _set_rng_states

    states = dict(states)
    kind, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (kind, np.asarray(keys.numpy() if hasattr(keys, "numpy") else keys, dtype=np.uint32),
                       int(pos), int(has_gauss), float(cached))
    cuda = states.pop("torch.cuda", None)
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        states["torch.cuda"] = cuda
    _set_rng_states(states)


def restore_loader_position(trainer: Any) -> bool:
    """Applies the training loader's saved position when Lightning loaded the loader before the checkpoint.

    Lightning restores a stateful loader's position in ``FitLoop.setup_data``, and creates (and prefetches from)
    the epoch's iterator there. ``trainer.estimated_stepping_batches`` calls ``setup_data`` when the run is sized by
    epochs (``max_epochs``): from ``configure_optimizers`` (an LR schedule sized by the run, HELENE's annealing
    horizon) that happens before the checkpoint is restored, so the position was never applied and the resumed run
    trained the epoch's first batches again. Called when training starts (after the restore, before the first batch
    is fetched): it loads the saved position and recreates the iterator. Does nothing when Lightning applied it.

    Args:
        trainer: The ``lightning.pytorch.Trainer`` at ``on_train_start``.

    Returns:
        Whether the position was applied here.
    """
    fit_loop = trainer.fit_loop
    pending = getattr(fit_loop, "_combined_loader_states_to_load", None)
    if not fit_loop.restarting or not pending or fit_loop._combined_loader is None or fit_loop._data_fetcher is None:
        return False
    fit_loop._load_combined_loader_states()
    # The iterator made before the restore started at the epoch's first batch (and prefetched it); the new one
    # starts at the saved position. Any global RNG draw this makes is undone by PeftModule's RNG restore.
    iter(fit_loop._data_fetcher)
    return True


def _settings(optimizer: Any, plateau: bool) -> list[dict[str, Any]]:
    """Per param group, the optimizer's constructor settings (its ``defaults`` keys) as the group holds them, minus
    what an LR scheduler moves during a run: the learning rate is taken from ``initial_lr`` where a scheduler set one
    (and left out under ``ReduceLROnPlateau`` or a cyclic schedule, which move it without one), momentum/betas are
    left out under a cyclic schedule (``OneCycleLR``/``CyclicLR`` cycle them)."""
    groups = []
    for group in optimizer.param_groups:
        cyclic = "max_lr" in group or "max_momentum" in group
        settings = {}
        for key in optimizer.defaults:
            if key == "params" or key not in group or (key in ("betas", "momentum") and cyclic):
                continue
            if key == "lr":
                if "initial_lr" in group and not cyclic:
                    settings[key] = group["initial_lr"]
                elif not plateau and not cyclic:
                    settings[key] = group["lr"]
                continue
            settings[key] = group[key]
        groups.append(settings)
    return groups


def _plateau(trainer: Any) -> bool:
    import torch

    return any(isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
               for config in getattr(trainer, "lr_scheduler_configs", []) or [])


def optimizer_settings(trainer: Any) -> list[list[dict[str, Any]]] | None:
    """The settings of the optimizers as built from the config, before a resume restores their state; ``None``
    unless this fit resumes (``trainer.ckpt_path``). Call it at ``on_fit_start`` (optimizers built, not restored).

    Args:
        trainer: The ``lightning.pytorch.Trainer``.
    """
    if getattr(trainer, "ckpt_path", None) is None:
        return None
    plateau = _plateau(trainer)
    return [_settings(optimizer, plateau) for optimizer in trainer.optimizers]


def replaced_optimizer_settings(trainer: Any, configured: list[list[dict[str, Any]]] | None) -> list[str]:
    """Which optimizer settings of the config the resumed checkpoint replaced, as ``"lr: 0.5 -> 0.01"``; call it at
    ``on_train_start`` with what :func:`optimizer_settings` returned at ``on_fit_start``.

    ``Optimizer.load_state_dict`` restores the param groups with the checkpoint's values: a resume with another
    ``lr`` or ``weight_decay`` in the recipe kept the checkpoint's without a word (Lightning's convention, as for the
    model settings, which ``peftplug fit`` names on one line; these were not).

    Args:
        trainer: The ``lightning.pytorch.Trainer``, its optimizers restored.
        configured: From :func:`optimizer_settings` (``None``: not a resume, nothing to say).

    Returns:
        The replaced settings (first group that differs per setting), ``[]`` if none.
    """
    if configured is None:
        return []
    plateau = _plateau(trainer)
    changed: dict[str, str] = {}
    for before_groups, optimizer in zip(configured, trainer.optimizers):
        for before, after in zip(before_groups, _settings(optimizer, plateau)):
            for key, value in before.items():
                if key in after and key not in changed and _differs(value, after[key]):
                    changed[key] = f"{key}: {value!r} -> {after[key]!r}"
    return list(changed.values())


def _differs(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # (a tensor lr, for capturable optimizers)
        return not torch.equal(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # betas come back as a list or a tuple
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def note_replaced_optimizer_settings(trainer: Any, configured: list[list[dict[str, Any]]] | None) -> list[str]:
    """Prints, on rank zero, one line naming the optimizer settings a resume kept from the checkpoint
    (:func:`replaced_optimizer_settings`); returns them.

    Args:
        trainer: The ``lightning.pytorch.Trainer`` at ``on_train_start``.
        configured: From :func:`optimizer_settings` at ``on_fit_start``.
    """
    changed = replaced_optimizer_settings(trainer, configured)
    if changed and getattr(trainer, "is_global_zero", True):
        named = "; ".join(f"model.optimizer.init_args.{setting}" for setting in changed)
        print(f"peftplug: --ckpt_path: the checkpoint's optimizer state keeps its own settings, not the config's: {named} "
              "(to train with new settings, start a new run from the checkpoint's adapter)", file=sys.stderr, flush=True)
    return changed


def find_last_checkpoint(root: str | os.PathLike, asked: str = "last") -> Path:
    """The most recently written ``.ckpt`` file under ``root`` (any depth).

    Args:
        root: The run's ``trainer.default_root_dir``.
        asked: The ``--ckpt_path`` value being resolved (``last``, or ``best``, which reads the newest), for the
            messages.

    Raises:
        ConfigError: If there is none (the message says where it looked and how to get periodic checkpoints).
    """
    folder = Path(root).expanduser()
    # Partial writes are never named *.ckpt (they are hidden temporary files until renamed), so any match is whole.
    matches = list(folder.rglob("*.ckpt")) if folder.is_dir() else []
    found = [p for p in matches if p.is_file()]
    # ModelParallelStrategy's default (save_distributed_checkpoint: true) writes each checkpoint as a folder named
    # *.ckpt, which peftplug cannot read; saying "no checkpoint", or silently taking an older file, would hide that.
    folders = [p for p in matches if p.is_dir() and (p / DISTRIBUTED_METADATA).is_file()]
    newest_file = max((p.stat().st_mtime_ns for p in found), default=-1)
    newer = [p for p in folders if p.stat().st_mtime_ns > newest_file]
    if newer:
        newest = max(newer, key=lambda p: p.stat().st_mtime_ns)
        raise ConfigError(
            f"ckpt_path: {asked!r} is the distributed checkpoint folder {str(newest)!r}"
            " (FSDP2 with save_distributed_checkpoint: true, Lightning's default), which peftplug cannot resume or "
            "export; train with trainer.strategy.init_args.save_distributed_checkpoint: false (docs/cli.md)"
        )
    if not found:
        raise ConfigError(
            f"ckpt_path: {asked!r} found no checkpoint under trainer.default_root_dir {str(folder)!r}; give the path "
            "of a .ckpt file, or let runs write checkpoints (an interrupted `peftplug fit` does; periodic ones: "
            "ModelCheckpoint every_n_train_steps, see docs/cli.md)"
        )
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"))


__all__ = [
    "RNG_KEY",
    "find_last_checkpoint",
    "note_replaced_optimizer_settings",
    "optimizer_settings",
    "replaced_optimizer_settings",
    "restore_loader_position",
    "restore_rng",
    "rng_state",
]
