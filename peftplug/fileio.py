"""Atomic file writes: write to a temporary file beside the target, then rename it over the target.

A leaf module (it imports nothing else of peftplug), so every method package may use it. A crash or an
exception mid-write leaves the previous file intact and no partial file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Calls ``write(tmp_path)`` on a temporary file in ``path``'s directory, then renames it onto ``path``.

    Args:
        path: Destination file; its directory must exist.
        write: Function that writes the whole content to the path it is given (e.g.
            ``lambda p: safetensors.torch.save_file(tensors, p)``).

    Returns:
        ``path`` as a ``Path``.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes ``text`` (UTF-8) to ``path`` atomically.

    Args:
        path: Destination file.
        text: Content.
    """
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
