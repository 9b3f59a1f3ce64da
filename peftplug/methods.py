"""Imports peftplug's method packages so that their PEFT types exist before a recipe or checkpoint names them.

The list itself is :data:`peftplug.registry.METHOD_PACKAGES` (a leaf, so that the registry's load hint can name
the package to import). This module is what the CLI, the checkpoint loader and the PEFT-config builder call; it
imports the method packages by name only (``importlib``), so no method package depends on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

from peftplug.registry import METHOD_PACKAGES, PLUGIN_PACKAGES


def import_method_packages() -> list[str]:
    """Imports the installed method packages (registering their PEFT types).

    A package whose optional dependency is missing is skipped with a warning, so that the others still work.

    Returns:
        The names of the packages imported, in :data:`~peftplug.registry.METHOD_PACKAGES` order.
    """
    imported = []
    for name in METHOD_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError as err:
            warnings.warn(f"peftplug: method package {name!r} could not be imported ({err})", stacklevel=2)
    return imported


def import_plugin_for(peft_type: str) -> None:
    """Imports the method package that provides ``peft_type`` (e.g. ``OFTV2`` -> ``oftv2``), if there is one.

    Args:
        peft_type: A PEFT type name (any case).
    """
    package = PLUGIN_PACKAGES.get(str(peft_type).upper())
    if package is not None and importlib.util.find_spec(package) is not None:
        importlib.import_module(package)


def peft_config_classes(peft_type: str) -> dict[str, type]:
    """PEFT's config class of every registered type by name (``{"LORA": LoraConfig, ...}``), after importing the
    method package that provides ``peft_type`` (a plugin type is in PEFT's mapping only once its package is).

    Args:
        peft_type: The type about to be looked up (any case).
    """
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    import_plugin_for(peft_type)
    return {str(getattr(key, "value", key)): cls for key, cls in PEFT_TYPE_TO_CONFIG_MAPPING.items()}


__all__ = ["METHOD_PACKAGES", "import_method_packages", "import_plugin_for", "peft_config_classes"]
