"""Runs a callback once PEFT is imported, without importing it: how ``import peftplug`` stays torch-light.

``import peftplug`` installs the load hint (:func:`peftplug.registry.install_load_hint`), which patches PEFT's
config classes. Importing PEFT for that would pull transformers and accelerate into every process that imports any
``peftplug`` module, including the leaves that torch-only packages use (``import helene`` promises torch only and
imports :mod:`peftplug.validation`). So when PEFT is not imported yet, a finder on ``sys.meta_path`` waits for it and
runs the callback right after PEFT's own ``__init__`` has run, before the importing code sees the module.

A leaf module: standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

_PACKAGE = "peft"


# Callbacks waiting for PEFT's import, in registration order (run and emptied by the finder's loader).
_waiting: list[Callable[[], None]] = []
# Set while the finder asks the others for PEFT's spec (per thread: imports in other threads are unaffected).
_searching = threading.local()


def _run_waiting() -> None:
    """Runs the waiting callbacks; a failure there must not make ``import peft`` itself fail, so it warns."""
    callbacks = list(_waiting)
    _waiting.clear()
    for callback in callbacks:
        try:
            callback()
        except Exception as err:  # noqa: BLE001 - the import the user asked for must still succeed
            warnings.warn(f"peftplug could not install its PEFT load hint: {type(err).__name__}: {err}",
                          stacklevel=3)


class _AfterPeftImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``peft`` it asks the other finders and wraps the loader they return.

    It stays on ``sys.meta_path`` until PEFT has actually been executed: ``importlib.util.find_spec("peft")`` without
    an import (transformers' ``is_peft_available()``, which ``from_pretrained`` calls) also asks the finders, and a
    finder that left at that probe lost the callbacks (the spec it wrapped is thrown away).
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        """The spec the other finders give ``fullname``, its loader wrapped when it is PEFT.

        Args:
            fullname: The module being imported.
            path: The parent package's ``__path__`` (``None`` for a top-level module).
            target: The module object when reloading.
        """
        if fullname != _PACKAGE or not _waiting or getattr(_searching, "active", False):
            return None
        spec = None
        # Asks the other finders directly (as the import system does): importlib.util.find_spec would come back here
        # while this finder is still on sys.meta_path (and the flag keeps a finder that asks it from doing so).
        _searching.active = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            if self in sys.meta_path:  # once PEFT has run: later imports of it are cached in sys.modules
                sys.meta_path.remove(self)
            _run_waiting()

        loader.exec_module = exec_module  # this spec's own loader object (one per module)
        return spec


def after_peft_import(callback: Callable[[], None]) -> None:
    """Runs ``callback`` now if PEFT is imported already, else right after it first is.

    Args:
        callback: A function of no arguments (it may import PEFT's submodules).
    """
    if _PACKAGE in sys.modules:
        callback()
        return
    _waiting.append(callback)
    if not any(isinstance(f, _AfterPeftImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeftImport())
