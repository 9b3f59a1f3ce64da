"""OFTv2 on ``nn.Conv2d``: a block-diagonal rotation of each output filter's flattened input.

A conv's weight ``W`` (out × in/groups × kh × kw) is a linear map from the flattened patch ``p`` (the
``in/groups · kh · kw`` values one filter sees, in ``(channel, kh, kw)`` order, as ``F.unfold`` and
``W.reshape(out, -1)`` lay them out) to the output pixel. OFTv2 rotates that patch: ``y = (p R) W_flatᵀ``, i.e.
the layer convolves with ``W' = W_flat Rᵀ`` (reshaped back to the kernel). This is the parameter layout and the
merged weight of PEFT's OFT ``Conv2d``, so adapters convert both ways (``oftv2.interop``).

PEFT 0.21.2's OFT ``Conv2d`` forward is not that function: it unfolds the *image* at stride 1 without padding,
rotates those patches and folds them back with ``F.fold``, which *sums* overlapping patches, then calls the conv.
At ``R = I`` that multiplies every pixel by the number of ``kh × kw`` windows covering it (up to ``kh·kw``), so
the adapter is not the identity at init and its merged weights do not reproduce its forward. It is right only for
1 × 1 kernels. Ours computes exactly ``conv(x, W_flat Rᵀ)``: identity at init, merge == forward, for any kernel
shape, stride, padding (any mode), dilation and groups.

``nn.Conv2d`` subclasses with a forward of their own (BiT / ViT-hybrid / DPT-hybrid's ``WeightStandardizedConv2d``,
which standardizes the kernel on every call, Perceiver's ``Conv2dSamePadding``, timm's ``StdConv2d`` /
``Conv2dSame``) run that forward with the rotated kernel in place of their weight: ``layer(x; W_flat Rᵀ)``, which is
the identity at init and what the merged layer (weight ``W_flat Rᵀ``) computes. Calling ``_conv_forward`` directly,
as for a plain conv, skipped their padding or standardization (a different model at init, or a shape error); the
input-centric evaluation cannot express such a forward, so these layers always evaluate ``"weight"``.

Two evaluations of the same function (``OFTv2Config.conv_evaluation``):
    ``"weight"``  rebuild ``W_flat Rᵀ`` each call and run the base conv with it: the rotation costs
                  O(out · in·k² · b), independent of the batch, and backward pays one conv weight-gradient.
    ``"input"``   unfold the input with the conv's own stride/padding/dilation, rotate the patches and multiply
                  by the frozen ``W_flat``: the rotation costs O(pixels · in·k² · b) (pixels = batch · H_out ·
                  W_out), no weight gradient, but ``k²`` times the input's memory and a plain matmul instead of
                  the tuned conv kernel.
    ``"auto"``    (default) per layer and call: ``"input"`` when ``pixels · groups < out_channels`` (the rotation
                  of the patches is then the smaller product), else ``"weight"``.
The crossover was measured on CPU (one thread, b = 32, batch 4, 3 × 3 convs; input / weight step time): 64 ch at
32 × 32 3.2, 128 ch at 8 × 8 1.2, 256 ch at 8 × 8 0.99, 320 ch at 8 × 8 0.89, 640 ch at 8 × 8 0.58, 640 ch at
4 × 4 0.28 — the ratio crosses 1 where pixels (256 at 8 × 8) ≈ out_channels. So high-resolution UNet layers run
weight-centric and the deep low-resolution ones input-centric (benchmarks/oftv2_conv.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .config import OFTv2Config
from .layer import OFTv2Layer, OFTv2Module, rotate_weight, type_dispatcher


class Conv2d(OFTv2Module):
    """OFTv2 around ``nn.Conv2d``: convolves with ``W_flat Rᵀ`` (rotation width ``in/groups · kh · kw``).

    Args:
        base_layer: The ``nn.Conv2d`` to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        **kwargs: ``layer_name`` for error messages.

    Raises:
        TypeError: If ``base_layer`` is another method's adapter layer (the conv must be called with a rotated
            weight or on rotated patches, which a wrapper in between would not pass on).
    """

    width_label = "filter width (in_channels / groups · kh · kw)"

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs) -> None:
        super().__init__()
        OFTv2Layer.__init__(self, base_layer, **kwargs)
        if isinstance(base_layer, BaseTunerLayer):
            raise TypeError(
                f"OFTv2 cannot adapt {kwargs.get('layer_name', 'this Conv2d')!r}: it already carries an adapter of "
                f"another method ({type(base_layer).__name__}); OFTv2 on Conv2d needs the plain nn.Conv2d"
            )
        # Whether the conv's class replaces nn.Conv2d's forward (see the module docstring): then it runs with the
        # rotated kernel substituted for its weight.
        self.custom_forward = has_own_forward(self.get_base_layer())
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, **kwargs)

    def rotation_width(self) -> int:
        """``in_channels / groups · kh · kw``: the flattened patch one output filter sees."""
        base = self.get_base_layer()
        return base.in_channels // base.groups * math.prod(base.kernel_size)

    # ----------------------------------------------------------------------------------- base weight access
    def _get_base_weight(self) -> torch.Tensor:
        """The kernel as ``out × (in/groups · kh · kw)`` (a view)."""
        weight = self.get_base_layer().weight.data
        return weight.reshape(weight.shape[0], -1)

    def _set_base_weight(self, weight: torch.Tensor) -> None:
        """Writes a flattened ``out × (in/groups · kh · kw)`` weight back into the kernel in place.

        Args:
            weight: New flattened weight.
        """
        target = self.get_base_layer().weight
        with torch.no_grad():
            target.data.copy_(weight.reshape(target.shape).to(target.dtype))

    # ------------------------------------------------------------------------------------------------ forward
    def _active_rotations(self) -> list[str]:
        return [name for name in self.active_adapters if name in self.oftv2_Q]

    def rotated_weight(self) -> torch.Tensor:
        """``W_flat Rₙᵀ … R₁ᵀ`` over the active adapters, as a kernel (differentiable in the adapters).

        The forward applies ``R₁`` to the patch first, so its transpose ends up rightmost: fold from the last.
        """
        base = self.get_base_layer()
        weight = base.weight.reshape(base.out_channels, -1)
        for name in reversed(self._active_rotations()):
            rotation = self.forward_rotation(name)
            weight = rotate_weight(weight, rotation, impl=self.kernel_plan(name).rotate)
        return weight.reshape(base.weight.shape)

    def _output_size(self, height: int, width: int, padding: tuple[int, int]) -> tuple[int, int]:
        base = self.get_base_layer()
        return tuple(
            (n + 2 * pad - base.dilation[i] * (base.kernel_size[i] - 1) - 1) // base.stride[i] + 1
            for i, (n, pad) in enumerate(((height, padding[0]), (width, padding[1])))
        )

    def output_pixels(self, x: torch.Tensor) -> int:
        """``batch · H_out · W_out`` of the base conv applied to ``x`` (``[B, C, H, W]`` or unbatched ``[C, H, W]``).

        Args:
            x: The conv's input.
        """
        base = self.get_base_layer()
        batch = x.shape[0] if x.dim() == 4 else 1
        if base.padding == "same":
            return batch * x.shape[-2] * x.shape[-1]
        padding = (0, 0) if base.padding == "valid" else base.padding
        return batch * math.prod(self._output_size(x.shape[-2], x.shape[-1], padding))

    def evaluation_for(self, x: torch.Tensor) -> str:
        """``"weight"`` or ``"input"``: how the forward evaluates ``x`` (the first active adapter's
        ``conv_evaluation``; ``"auto"`` picks the smaller rotation product, see the module docstring).

        Args:
            x: The conv's input.
        """
        choice = self.oftv2_settings[self._active_rotations()[0]].conv_evaluation
        if self.custom_forward:
            return "weight"  # the class's own forward can only be run with a substituted kernel
        if choice != "auto":
            return choice
        base = self.get_base_layer()
        return "input" if self.output_pixels(x) * base.groups < base.out_channels else "weight"

    def _input_centric(self, x: torch.Tensor) -> torch.Tensor:
        """``(unfold(x) R) W_flatᵀ + b``, folded into the conv's output shape (no weight gradient needed)."""
        base = self.get_base_layer()
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        padding = base.padding
        if isinstance(padding, str) or base.padding_mode != "zeros":
            # "same" may pad asymmetrically and non-zero modes pad by reflection etc.: pad as the conv does.
            mode = "constant" if base.padding_mode == "zeros" else base.padding_mode
            x = F.pad(x, base._reversed_padding_repeated_twice, mode=mode)
            padding = (0, 0)
        patches = F.unfold(x, base.kernel_size, dilation=base.dilation, padding=padding, stride=base.stride)
        batch, _, n_pixels = patches.shape
        groups, width = base.groups, self.rotation_width()
        # [B, L, groups, width]: every group's filters see their own channel slice through the same R.
        patches = self.rotate_input(patches.transpose(1, 2).reshape(batch, n_pixels, groups, width))
        weight = base.weight.reshape(groups, base.out_channels // groups, width).to(patches.dtype)
        out = torch.einsum("blgk,gok->bgol", patches, weight).reshape(batch, base.out_channels, n_pixels)
        if base.bias is not None:
            out = out + base.bias.to(out.dtype)[:, None]
        out = out.reshape(batch, base.out_channels, *self._output_size(x.shape[-2], x.shape[-1], padding))
        return out.squeeze(0) if unbatched else out

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.adapters_bypassed():
            return self.base_layer(x, *args, **kwargs)
        active = self._active_rotations()
        if not active:
            return self.base_layer(x, *args, **kwargs)
        if self.evaluation_for(x) == "input":
            return self._input_centric(x)
        base = self.get_base_layer()
        if self.custom_forward:
            # The class's own forward (padding, weight standardization, ...) with W_flat Rᵀ as its weight.
            return torch.func.functional_call(base, {"weight": self.rotated_weight()}, (x, *args), kwargs)
        return base._conv_forward(x, self.rotated_weight(), base.bias)

    def __repr__(self) -> str:
        return "oftv2." + super().__repr__()


def has_own_forward(conv: nn.Module) -> bool:
    """Whether ``conv`` (an ``nn.Conv2d``) is of a class that overrides ``forward`` or ``_conv_forward``.

    Args:
        conv: The base conv layer.
    """
    cls = type(conv)
    return cls.forward is not nn.Conv2d.forward or cls._conv_forward is not nn.Conv2d._conv_forward


dispatch_conv2d = type_dispatcher(nn.Conv2d, Conv2d)
