"""Checkpoint writes that a kill cannot corrupt: :class:`AtomicCheckpointIO`.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a temporary file made by
``tempfile.mkstemp()`` (in ``$TMPDIR``, usually ``/tmp``), which is then ``shutil.move``\\ d onto the target. That is
an atomic rename only when ``/tmp`` and the checkpoint folder are on one filesystem; otherwise ``shutil.move``
copies into the target (truncating the previous checkpoint first) and a kill during the copy leaves neither
the old nor the new one. Nothing is fsynced either. Here the temporary file lives beside the target (a hidden
name that never ends in ``.ckpt``), is fsynced, and is renamed onto the target; the folder is fsynced after the
rename. A kill at any moment leaves the previous file whole.

``peftplug fit`` installs it in place of Lightning's default; with a plain ``Trainer`` pass
``plugins=[AtomicCheckpointIO()]``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from peftplug.errors import PeftplugError
from peftplug.fileio import atomic_write, usual_mode


class CheckpointWriteError(PeftplugError, OSError):
    """A checkpoint could not be written (a full disk, a folder that cannot be written). An ``OSError`` still, for
    code that catches those; ``peftplug fit`` prints it as one line instead of a traceback from inside Lightning."""


def write_bytes_durably(path: str | os.PathLike, data: bytes) -> Path:
    """Writes ``data`` to ``path`` atomically and durably (fsync of the file, then of its folder).

    Args:
        path: The target file; its folder is created if needed.
        data: The whole content.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        usual_mode(tmp, directory=False)

    atomic_write(target, write)
    try:
        folder = os.open(target.parent, os.O_RDONLY)
    except OSError:  # some filesystems do not open folders; the rename is done either way
        return target
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)
    return target


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable (see the module docstring).

    Remote paths (``s3://``, ...) keep Lightning's own transaction.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Writes ``checkpoint`` to ``path``.

        Args:
            checkpoint: The checkpoint dict.
            path: The target file.
            storage_options: Not supported (as in ``TorchCheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                            f" is not supported for `{self.__class__.__name__}`.")
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path)
        path = str(path).removeprefix("file://")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        try:
            write_bytes_durably(path, buffer.getvalue())
        except OSError as err:
            # A disk that filled up during training was a traceback from deep inside Lightning. The write is atomic:
            # the temporary file is gone and a previous checkpoint of that name is whole, which the user should know.
            previous = "the previous checkpoint there is unchanged" if os.path.isfile(path) else "nothing was written"
            problem = CheckpointWriteError(f"cannot write checkpoint {path!r}: {err.strerror or err} ({previous}); "
                                           "free space, or set trainer.default_root_dir or the ModelCheckpoint "
                                           "dirpath to a writable folder")
            problem.errno = err.errno  # (given as an argument, it would put "[Errno 28]" before the message)
            raise problem from err


def install_atomic_checkpoint_io(trainer: Any) -> bool:
    """Replaces the strategy's default ``TorchCheckpointIO`` by :class:`AtomicCheckpointIO`.

    A checkpoint IO the user configured (or a strategy's own, e.g. for sharded checkpoints) is left alone.

    Args:
        trainer: A ``lightning.pytorch.Trainer``.

    Returns:
        Whether it was installed.
    """
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is not TorchCheckpointIO:
        return False
    strategy.checkpoint_io = AtomicCheckpointIO()
    return True


__all__ = ["AtomicCheckpointIO", "CheckpointWriteError", "install_atomic_checkpoint_io", "write_bytes_durably"]
