"""The one place that imports Triton: a cached availability check and the interpreter-mode flag.

Every other module asks :func:`triton_available` before importing a ``peftplug_kernels/*/triton.py`` module. Triton is
optional (the ``triton`` extra); without it every op runs its pure-torch reference.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

_AVAILABLE: list[bool] = []  # the one cached answer (a list, so the function needs no ``global``)


def triton_available() -> bool:
    """Whether ``import triton`` succeeds (cached: the import is slow and its outcome cannot change)."""
    if not _AVAILABLE:
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
            _AVAILABLE.append(True)
        except Exception:  # noqa: BLE001  (ImportError, or a broken install raising something else at import)
            _AVAILABLE.append(False)
    return _AVAILABLE[0]


# A constant to torch.compile: dynamo calls it at trace time instead of tracing it (an lru_cache here broke the
# graph), and the outcome of an import cannot change within a process. This is what
# ``torch.compiler.assume_constant_result`` sets, without its import of torch._dynamo (which imports Triton, and
# ``import peftplug_kernels.ops`` must not).
triton_available._dynamo_marked_constant = True


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set now (Triton reads it when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# Kernel modules already imported, by op: every forward and backward of a Triton op asks for its module, and a dict
# read costs ~0.05 µs where importlib's sys.modules path costs ~1 µs.
_LOADED: dict[str, ModuleType] = {}


def load_kernel_module(name: str) -> ModuleType:
    """Imports ``peftplug_kernels.<name>.triton`` (lazily, so ``TRITON_INTERPRET`` can be set before decoration).

    Args:
        name: Op sub-package, e.g. ``"block_rotate"``.

    Raises:
        RuntimeError: If Triton is not installed.
    """
    module = _LOADED.get(name)
    if module is None:
        if not triton_available():
            raise RuntimeError("impl='triton' needs the optional dependency triton (pip install 'peftplug[triton]')")
        module = _LOADED[name] = importlib.import_module(f"peftplug_kernels.{name}.triton")
    return module


def triton_usable(name: str, *tensors: torch.Tensor) -> tuple[bool, str]:
    """Whether the Triton kernel of op ``name`` can run on ``tensors``, and why not when it cannot.

    On CUDA the compiled kernel runs. On CPU it runs only if the kernel module was decorated in interpreter mode
    (``TRITON_INTERPRET=1`` set before the module's first import).

    Args:
        name: Op sub-package.
        *tensors: The op's tensor inputs.
    """
    if not triton_available():
        return False, "triton is not installed (pip install 'peftplug[triton]')"
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices <= {"cuda"}:
        return True, ""
    if devices != {"cpu"}:
        return False, f"tensors on devices {sorted(devices)}; the Triton kernels need all on CUDA (or CPU + interpreter)"
    if not interpret_requested():
        return False, "tensors are on CPU; Triton runs on CPU only with TRITON_INTERPRET=1 set before the kernels load"
    module = load_kernel_module(name)
    if not getattr(module, "INTERPRETED", False):
        return False, (
            f"peftplug_kernels.{name}.triton was imported before TRITON_INTERPRET=1 was set, so its kernels are compiled "
            "for GPU; set the variable before the first import"
        )
    return True, ""
