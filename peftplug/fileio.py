"""Atomic file writes: write to a temporary file beside the target, then rename it over the target.

A leaf module (it imports nothing else of peftplug), so every method package may use it. A crash or an
exception mid-write leaves the previous file intact and no partial file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def usual_mode(path: str | os.PathLike, directory: bool = True) -> None:
    """Gives a file or folder the mode a new one gets under the process umask (``mkstemp``/``mkdtemp`` make them
    private, 0600/0700: an adapter, checkpoint or cached model meant for other users or a server would be unreadable).

    Args:
        path: The file or folder.
        directory: Whether it is a folder (0777 before the umask) or a file (0666).
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def usual_modes(root: str | os.PathLike) -> None:
    """:func:`usual_mode` for a folder and everything in it (``safetensors`` writes its files 0600, like ``mkstemp``).

    Args:
        root: The folder.
    """
    for path in [Path(root), *Path(root).rglob("*")]:
        usual_mode(path, directory=path.is_dir())


def nearest_existing(path: str | os.PathLike) -> Path:
    """The absolute ``path`` itself if it exists, else its nearest existing ancestor: where creating ``path`` starts,
    so what must be a writable folder for a command to write there.

    Args:
        path: A file or folder path (``~`` expanded).
    """
    existing = Path(os.path.abspath(Path(path).expanduser()))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Calls ``write(tmp_path)`` on a temporary file in ``path``'s directory, then renames it onto ``path``.

    Args:
        path: Destination file; its directory must exist.
        write: Function that writes the whole content to the path it is given (e.g.
            ``lambda p: safetensors.torch.save_file(tensors, p)``).

    Returns:
        ``path`` as a ``Path``.

    The file gets the mode of the file it replaces, or for a new file the mode a new file gets under the umask
    (``mkstemp``'s own 0600 would make an adapter or config unreadable to another user or a server).
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:  # no previous file (or none we can see): the umask decides, as for open(path, "w")
        mode = None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if mode is None:
            usual_mode(tmp, directory=False)
        else:
            os.chmod(tmp, mode)
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


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yields a staging directory beside ``path``; on success it is renamed onto ``path``, on error removed.

    Readers never see a half-written directory: either the old one (or none) or the complete new one. The folder
    and its contents get the umask's usual modes (:func:`usual_modes`) before the rename.

    Args:
        path: The directory to create.
        overwrite: Replace an existing ``path`` (otherwise an existing one raises ``FileExistsError``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        usual_modes(staging)  # an export or cached model is meant for other users and servers too
        if target.exists() and not overwrite:
            # Another process made it while this one wrote (a DDP rank, a second conversion): theirs stays, and may
            # already be in use; replacing it would leave a moment without the folder and delete files handed out.
            raise FileExistsError(f"{target} exists")
        if target.exists():
            # Renaming a directory onto a non-empty one fails on POSIX: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            try:
                os.replace(target, old / "dir")
                try:
                    os.replace(staging, target)
                except BaseException:
                    os.replace(old / "dir", target)  # the new one could not go in: put the previous one back
                    raise
            finally:
                if target.exists():  # the new or the previous directory is in place: the set-aside copy can go
                    shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(staging, target)
            except OSError:
                if target.exists() and not overwrite:  # made in the moment since the check: as above
                    raise FileExistsError(f"{target} exists") from None
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why a ``.safetensors`` file is unreadable or truncated, or ``None`` if its header and size are consistent.

    Reads only the header (no tensor data): a file cut short by an interrupted copy or download has a valid
    header but fewer bytes than the header's last data offset, which loading would only notice much later.

    Args:
        path: The file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                return "shorter than a safetensors header"
            header_len = int.from_bytes(raw, "little")
            if header_len <= 0 or 8 + header_len > size:
                return "its header length does not fit the file (not a safetensors file, or truncated)"
            header = json.loads(handle.read(header_len))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON (not a safetensors file)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (not a safetensors file)"
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError):
        return "its header does not describe tensors (not a safetensors file)"
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"truncated: the header promises {expected} bytes, the file has {size}"
    return None
