"""peftplug: OFTv2, HELENE, PCT and steering vectors as PEFT methods, trainable with Lightning.

This module stays light: it imports neither Lightning nor any method package. Importing it installs the
load hint (``peftplug.registry.install_load_hint``) so that loading an adapter whose plugin package was not
imported says which package to import.
"""

__version__ = "0.1.0"

from peftplug.registry import install_load_hint as _install_load_hint

_install_load_hint()
