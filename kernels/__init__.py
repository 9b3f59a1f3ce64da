"""Fused ops for orthogonal finetuning, each with a pure-torch reference.

One sub-package per op: ``reference.py`` (pure torch: the CPU path and the test oracle), ``triton.py`` (the
fused kernel) and ``function.py`` (autograd). This package is a leaf: it imports nothing else of peftplug.

The top-level name ``kernels`` is also the import name of Hugging Face's ``kernels`` distribution. Two
distributions that both install a top-level ``kernels`` folder overwrite each other's files, so we check for
that case (see :func:`check_name_collision`) and say so clearly instead of failing obscurely later.
"""

from __future__ import annotations

import functools
import importlib.metadata

OWN_DISTRIBUTION = "peftplug"


class KernelsNameCollision(ImportError):
    """Another installed distribution also provides the top-level ``kernels`` package."""


@functools.lru_cache(maxsize=1)
def other_kernels_distributions() -> tuple[str, ...]:
    """Names of installed distributions other than peftplug that provide a top-level ``kernels`` package."""
    providers = importlib.metadata.packages_distributions().get("kernels", [])
    return tuple(sorted({name for name in providers if name.lower() != OWN_DISTRIBUTION}))


def check_name_collision() -> None:
    """Raises a clear error when another distribution installs a ``kernels`` package next to ours.

    Raises:
        KernelsNameCollision: naming the other distribution(s) and how to resolve it.
    """
    others = other_kernels_distributions()
    if others:
        raise KernelsNameCollision(
            f"the top-level package 'kernels' is installed by peftplug and by {', '.join(others)}; "
            "their files overwrite each other. Install peftplug and Hugging Face's `kernels` in separate "
            "environments (or `pip uninstall kernels`), then reinstall peftplug."
        )


# Public names of Hugging Face's `kernels` that other libraries import from it (bitsandbytes 0.50 tries
# `from kernels import get_kernel` at import and otherwise prints "cannot import name 'get_kernel'").
_HF_KERNELS_NAMES = frozenset({
    "get_kernel", "get_local_kernel", "has_kernel", "load_kernel", "install_kernel", "kernelize",
    "use_kernel_forward_from_hub", "use_kernel_mapping", "register_kernel_mapping",
    "replace_kernel_forward_from_hub", "LayerRepository", "LocalLayerRepository", "Mode", "Device",
})


def __getattr__(name: str):
    """Says clearly that this ``kernels`` is peftplug's when code asks it for Hugging Face ``kernels`` names.

    An ``ImportError`` (not ``AttributeError``) so that ``from kernels import get_kernel`` shows this message.

    Args:
        name: The attribute looked up.
    """
    if name in _HF_KERNELS_NAMES:
        others = other_kernels_distributions()
        installed = (f"{', '.join(others)} is installed too and its files are overwritten by ours"
                     if others else "Hugging Face's `kernels` is not installed")
        raise KernelsNameCollision(
            f"cannot import {name!r}: the top-level package 'kernels' here is peftplug's fused OFT ops ({__file__}), "
            f"not Hugging Face's `kernels` ({installed}). Code needing Hugging Face's kernels falls back or must run "
            "in an environment without peftplug."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
