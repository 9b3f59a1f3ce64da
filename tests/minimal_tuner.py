"""A minimal but real PEFT tuner, used to test peftplug.registry: a learned per-output-feature scale.

``y = base(x) * s`` for every targeted ``nn.Linear``, with ``s`` one vector per adapter name (initialised to
ones, or randomly around one with ``init_std > 0`` so tests see a non-trivial adapter). It follows PEFT's
config / layer / model split, supports several adapters, ``disable_adapter`` and merging (scale the weight rows
and the bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, check_adapters_to_merge

from peftplug.registry import register_method

NAME = "minscale"


@dataclass
class MinScaleConfig(PeftConfig):
    """Config of the per-feature scale adapter.

    Args:
        target_modules: Names (or a regex) of the ``nn.Linear`` modules to adapt.
        init_std: Standard deviation of the initial scale around 1 (0 gives the identity).
        modules_to_save: Modules trained in full and saved with the adapter.
    """

    target_modules: list[str] | str | None = field(default=None)
    init_std: float = field(default=0.0)
    modules_to_save: list[str] | None = field(default=None)

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = NAME.upper()
        if self.init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {self.init_std}")
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)


class MinScaleLayer(BaseTunerLayer):
    """Adapter state of one wrapped linear layer: a ParameterDict keyed by adapter name."""

    adapter_layer_names = ("minscale_s",)

    def __init__(self, base_layer: torch.nn.Module) -> None:
        self.base_layer = base_layer
        self.minscale_s = torch.nn.ParameterDict({})
        self._disable_adapters = False
        self.merged_adapters = []
        self.out_features = base_layer.out_features
        self.in_features = base_layer.in_features

    def update_layer(self, adapter_name: str, init_std: float, inference_mode: bool = False) -> None:
        """Creates the scale vector of ``adapter_name``.

        Args:
            adapter_name: Adapter name.
            init_std: Standard deviation of the initial scale around 1.
            inference_mode: Freeze the adapter.
        """
        scale = torch.ones(self.out_features)
        if init_std > 0:
            scale = scale + init_std * torch.randn(self.out_features)
        weight = self.get_base_layer().weight
        self.minscale_s[adapter_name] = torch.nn.Parameter(scale.to(weight.device, torch.float32))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)


class MinScaleLinear(torch.nn.Module, MinScaleLayer):
    """``nn.Linear`` with per-output-feature scales.

    Args:
        base_layer: The wrapped ``nn.Linear``.
        adapter_name: Name of the first adapter.
        init_std: Standard deviation of the initial scale around 1.
    """

    def __init__(self, base_layer: torch.nn.Module, adapter_name: str, init_std: float) -> None:
        super().__init__()
        MinScaleLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, init_std)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Base output times the product of the active adapters' scales.

        Args:
            x: Input.
            *args: Passed to the base layer.
            **kwargs: Passed to the base layer.
        """
        out = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return out
        for name in self.active_adapters:
            if name in self.minscale_s:
                out = out * self.minscale_s[name].to(out.dtype)
        return out

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Scales the base weight rows (and bias) by the adapter scales.

        Args:
            safe_merge: Check the result for non-finite values before writing it.
            adapter_names: Adapters to merge (default: the active ones).
        """
        base = self.get_base_layer()
        for name in check_adapters_to_merge(self, adapter_names):
            s = self.minscale_s[name].detach()
            weight = base.weight.data * s[:, None].to(base.weight.dtype)
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"merging adapter {name} gives non-finite weights")
            base.weight.data = weight
            if base.bias is not None:
                base.bias.data = base.bias.data * s.to(base.bias.dtype)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Divides the merged scales out again."""
        base = self.get_base_layer()
        while self.merged_adapters:
            s = self.minscale_s[self.merged_adapters.pop()].detach()
            base.weight.data = base.weight.data / s[:, None].to(base.weight.dtype)
            if base.bias is not None:
                base.bias.data = base.bias.data / s.to(base.bias.dtype)


class MinScaleModel(BaseTuner):
    """Injects :class:`MinScaleLinear` into the targeted linear layers.

    Args:
        model: The model to adapt.
        config: A :class:`MinScaleConfig`.
        adapter_name: Adapter name.
        low_cpu_mem_usage: Unused (kept for PEFT's signature).
        state_dict: Unused (kept for PEFT's signature).
    """

    prefix: str = "minscale_"
    tuner_layer_cls = MinScaleLayer
    target_module_mapping: dict = {}  # noqa: RUF012 (PEFT reads this class attribute)

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key,
                            parameter_name=None):
        if isinstance(target, MinScaleLayer):
            target.update_layer(adapter_name, peft_config.init_std, inference_mode=peft_config.inference_mode)
            return
        if not isinstance(target, torch.nn.Linear):
            raise TypeError(f"minscale adapts nn.Linear only, {current_key} is {type(target).__name__}")
        new = MinScaleLinear(target, adapter_name, peft_config.init_std)
        if adapter_name not in self.active_adapters:
            new.requires_grad_(False)
        self._replace_module(parent, target_name, new, target)


def register():
    """Registers the tuner with PEFT (idempotent) and returns its PeftType member."""
    return register_method(NAME, MinScaleConfig, MinScaleModel, prefix=MinScaleModel.prefix)


register()
