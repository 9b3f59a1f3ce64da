"""MoE experts stored as fused 3-D parameters: OFTv2 cannot adapt them, and says so instead of skipping them silently.

In transformers 5 the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, ... are no longer ``nn.Linear`` modules but stacked
parameters of one experts module (``mlp.experts.gate_up_proj``: ``[n_experts, 2·intermediate, hidden]``,
``mlp.experts.down_proj``). OFTv2 adapts layers (``nn.Linear``, ``Conv1D``, ``nn.Conv2d``, ``nn.Embedding``), and PEFT
matches ``target_modules`` against module names only, so a config that named the experts (by their transformers 4
names ``w1``/``w2``/``w3`` or ``gate_proj``/``up_proj``/``down_proj``, or by the parameter names) adapted the
attention layers and left every expert frozen without a word, and so did ``"all-linear"``. PEFT's LoRA, given the
same config, converts those names into ``target_parameters`` and adapts the experts.

:func:`check_expert_targets` runs before the adapter is injected: a name in a ``target_modules`` list that matches
no module but names expert weights is refused in one ``ValueError`` (a warning when the adapter is loaded for
inference, so that saved adapters still load); ``"all-linear"``, a regex reaching the experts, or a name that also
matches real layers (Qwen2-MoE's shared expert has ``gate_proj`` modules) warn that the experts stay frozen.
"""

from __future__ import annotations

import re
import warnings

from torch import nn

# Names the experts' projections had as nn.Linear modules (transformers 4), which configs and recipes still use.
LEGACY_EXPERT_NAMES = frozenset({"w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"})
SUPPORTED = "nn.Linear / Conv1D / nn.Conv2d / nn.Embedding"


def expert_parameters(model: nn.Module) -> list[str]:
    """Full names of the fused expert weights of ``model``: 3-D parameters of a module whose name or class names
    experts (``mlp.experts``: ``MixtralExperts``, ``Qwen3MoeExperts``, ...).

    Args:
        model: The model being adapted.
    """
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            continue  # a Conv1d kernel is 3-D too, and is a layer
        if "expert" not in f"{module_name.rpartition('.')[2]} {type(module).__name__}".lower():
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                found.append(f"{module_name}.{name}" if module_name else name)
    return found


def _matches_module(target: str, module_names: list[str]) -> bool:
    return any(key == target or key.endswith("." + target) for key in module_names)


def _names_experts(target: str, experts: list[str]) -> bool:
    """Whether the list entry ``target`` names expert weights: a parameter's name or a legacy projection name."""
    return target in LEGACY_EXPERT_NAMES or any(p == target or p.endswith("." + target) for p in experts)


def _regex_reaches_experts(pattern: str, experts: list[str]) -> bool:
    """Whether a regex ``target_modules`` matches an expert parameter, or a legacy name inside an experts module."""
    containers = {p.rpartition(".")[0] for p in experts}
    keys = list(experts) + [f"{c}.{old}" for c in containers for old in LEGACY_EXPERT_NAMES]
    return any(re.fullmatch(pattern, key) for key in keys)


def check_expert_targets(model: nn.Module, config) -> None:
    """Refuses (or warns about) targets that ask OFTv2 for fused MoE expert weights; see the module docstring.

    Args:
        model: The model about to be adapted.
        config: The adapter's ``OFTv2Config`` (its ``target_modules`` as given, before PEFT resolves ``"all-linear"``).

    Raises:
        ValueError: When a ``target_modules`` list names expert weights and no module, and the adapter is not
            loaded for inference.
    """
    targets = config.target_modules
    if not targets:
        return
    experts = expert_parameters(model)
    if not experts:
        return
    shown = ", ".join(experts[:2]) + (f", ... ({len(experts)} in all)" if len(experts) > 2 else "")
    if isinstance(targets, str):
        if targets.lower() != "all-linear" and not _regex_reaches_experts(targets, experts):
            return
        unmatched, partly = [], [targets]
    else:
        module_names = [name for name, _ in model.named_modules()]
        named = sorted(t for t in targets if _names_experts(t, experts))
        unmatched = [t for t in named if not _matches_module(t, module_names)]
        partly = [t for t in named if t not in unmatched]
    if unmatched and not getattr(config, "inference_mode", False):
        raise ValueError(
            f"target_modules {unmatched} name the MoE expert weights of this model, which are fused 3-D parameters "
            f"({shown}), not layers: OFTv2 adapts only {SUPPORTED} modules and cannot adapt them; remove {unmatched} "
            "from target_modules (the experts then stay frozen)"
        )
    if unmatched or partly:
        warnings.warn(
            f"OFTv2 leaves the MoE experts of this model frozen (target_modules {unmatched + partly}): their weights "
            f"are fused 3-D parameters ({shown}), not {SUPPORTED} layers, so only the layers that match are adapted",
            stacklevel=6,  # the caller of peft.get_peft_model
        )
