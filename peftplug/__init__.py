"""peftplug: OFTv2, HELENE, PCT and steering vectors as PEFT methods, trainable with Lightning.

This module stays light: it imports neither PEFT, Lightning nor any method package. Importing it installs the
load hint (``peftplug.registry.install_load_hint``), at once if PEFT is imported already and else as soon as it
is (``peftplug.peft_import_hook``), so that loading an adapter whose plugin package was not imported says which
package to import. ``peftplug.load_adapter`` (:func:`peftplug.adapter_loading.load_adapter`)
imports that package itself; it is imported on first use, so ``import peftplug`` stays light.
"""

__version__ = "0.1.0"

# Before the registry imports PEFT, which imports bitsandbytes (see peftplug.quantized_layout: the messages are
# about a CPU kernel that only runs on repacked 4-bit weights, which peftplug never creates).
from peftplug.quantized_layout import hide_unused_kernel_warning as _hide_unused_kernel_warning

_hide_unused_kernel_warning()

from peftplug.peft_import_hook import after_peft_import as _after_peft_import


def _install_load_hint() -> None:
    import sys

    # The registry installs the hint when its import ends. It may be what is importing PEFT right now (then it is
    # only partly initialised, and importing a name from it here would fail): leave the hint to it then.
    if "peftplug.registry" not in sys.modules:
        import peftplug.registry  # noqa: F401


# Not by importing PEFT here: the leaves under peftplug (fileio, validation, ...) serve torch-only packages too.
_after_peft_import(_install_load_hint)


def __getattr__(name: str):
    # PEP 562: the public loader is imported on first use (it pulls in torch and PEFT's model classes).
    if name == "load_adapter":
        from peftplug.adapter_loading import load_adapter

        return load_adapter
    raise AttributeError(f"module 'peftplug' has no attribute {name!r}")
