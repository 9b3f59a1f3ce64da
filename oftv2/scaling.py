"""The LoRA-scale calls diffusers makes on every PEFT tuner layer, answered for rotations.

diffusers calls ``scale_layer`` / ``unscale_layer`` on every ``BaseTunerLayer`` when a pipeline passes
``cross_attention_kwargs={"scale": s}`` or ``fuse_lora(lora_scale=s)``, and ``set_scale`` from
``set_adapters(names, weights)``: an OFTv2 layer without them raised ``AttributeError``. A rotation has no scale, so
like PEFT's own OFT the layer keeps it at 1 and warns when another one is asked for.
"""

from __future__ import annotations

import warnings
from typing import Any


class RotationScale:
    """Mixin for :class:`oftv2.layer.OFTv2Layer`: the scale methods of LoRA layers, which leave a rotation as it is."""

    def set_scale(self, adapter: str, scale: Any) -> None:
        """Warns unless ``scale`` is 1 for an adapter of this layer (the rotation stays unscaled).

        Args:
            adapter: The adapter's name.
            scale: The scale asked for.
        """
        if adapter in self.oftv2_Q and scale != 1:
            warnings.warn(f"OFTv2 adapters have no scale (a rotation is not scaled): ignoring scale={scale} for "
                          f"adapter {adapter!r}", stacklevel=2)

    def scale_layer(self, scale: Any) -> None:
        """Warns unless ``scale`` is 1 while an adapter of this layer is active (the rotation stays unscaled).

        Args:
            scale: The scale asked for.
        """
        if scale != 1 and any(name in self.oftv2_Q for name in self.active_adapters):
            warnings.warn(f"OFTv2 adapters have no scale (a rotation is not scaled): ignoring scale={scale}",
                          stacklevel=2)

    def unscale_layer(self, scale: Any = None) -> None:
        """Nothing to undo: :meth:`scale_layer` changes nothing.

        Args:
            scale: The scale to undo (unused).
        """
