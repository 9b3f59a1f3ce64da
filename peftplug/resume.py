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

:func:`restore_loader_position` applies the training loader's saved position when Lightning created the loader
before restoring the checkpoint (runs sized by ``max_epochs`` whose ``configure_optimizers`` asks for
``trainer.estimated_stepping_batches``).
"""

from __future__ import annotations

import os
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


__all__ = ["RNG_KEY", "find_last_checkpoint", "restore_loader_position", "restore_rng", "rng_state"]
