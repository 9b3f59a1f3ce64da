"""Where the decoder blocks of a model family live, and how to find them in an arbitrary model.

Adding a family is one call::

    from steering.families import register_family
    register_family("my_model_type", blocks_attr="layers", bias_proj="mlp.down_proj")

``blocks_attr`` is the attribute name of the ``nn.ModuleList`` of decoder blocks (searched anywhere in the
model, so the same entry serves ``XForCausalLM``, ``XModel`` and ``XForSequenceClassification``);
``bias_proj`` is the last projection inside a block whose output is added to the residual stream (the place
where an ``"add"`` vector on all positions can be folded in as a bias by ``merge_and_unload``).

Folding ``m v`` into that bias is exact only when the bias reaches the residual stream unchanged. Families where
it does not pass a ``merge_rule`` (see :func:`merge_target`): it either names another bias and a scale that make
the fold exact (Granite scales the MLP output by ``residual_multiplier``; post-norm OPT ends its block with a
LayerNorm whose bias is the block output's last additive term) or refuses (Gemma-2 and OLMo-2 normalise the MLP
output with a bias-free RMSNorm before the residual add, so no bias can reproduce a constant shift).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Family:
    """How to find the decoder blocks of one ``model_type``.

    Args:
        blocks_attr: Attribute name of the ``nn.ModuleList`` holding the decoder blocks.
        bias_proj: Dotted path, inside a block, of the last residual-writing projection (or ``None``).
        merge_rule: ``rule(config, bias_proj) -> (path, scale)``: where (inside a block) and with which factor a
            constant shift of the block output becomes a bias, for configurations where ``bias_proj`` with factor
            1 is not exact; raises ``ValueError`` (with the reason) when no bias is exact. ``None``: ``bias_proj``.
        bias_flag: Config attribute that gives the MLP's projections biases (Llama's ``mlp_bias``): set by
            ``merge_and_unload`` when it had to create a bias, so that ``from_pretrained`` keeps it.
    """

    blocks_attr: str
    bias_proj: str | None = None
    merge_rule: Callable[[Any, str | None], tuple[str | None, float]] | None = None
    bias_flag: str | None = None


FAMILIES: dict[str, Family] = {}


def register_family(
    model_type: str,
    blocks_attr: str,
    bias_proj: str | None = None,
    merge_rule: Callable[[Any, str | None], tuple[str | None, float]] | None = None,
    bias_flag: str | None = None,
) -> None:
    """Registers (or replaces) how to find the decoder blocks of ``model_type``.

    Args:
        model_type: ``config.model_type`` of the family (e.g. ``"llama"``).
        blocks_attr: Attribute name of the block ``nn.ModuleList``.
        bias_proj: Last residual-writing projection inside a block, for merging (optional).
        merge_rule: See :class:`Family` (optional).
        bias_flag: See :class:`Family` (optional).
    """
    FAMILIES[model_type] = Family(blocks_attr, bias_proj, merge_rule, bias_flag)


def _refuse_post_mlp_norm(model_type: str) -> Callable[[Any, str | None], tuple[str | None, float]]:
    """A merge rule for blocks that normalise the MLP output before the residual add (Gemma-2, OLMo-2)."""

    def rule(config, bias_proj):
        raise ValueError(
            f"cannot merge a steering vector into this {model_type} model: its blocks normalise the MLP output "
            "(post_feedforward_layernorm, which has no bias) before the residual add, so no bias reproduces a "
            "constant shift; keep the adapter unmerged"
        )

    return rule


def _granite_rule(config, bias_proj: str | None) -> tuple[str | None, float]:
    """Granite adds ``mlp(x) * residual_multiplier`` to the residual: the bias must be ``m v / residual_multiplier``."""
    factor = float(getattr(config, "residual_multiplier", 1.0) or 0.0)
    if factor == 0.0 or not math.isfinite(factor):
        raise ValueError(
            f"cannot merge a steering vector into a granite model with residual_multiplier={factor}: the MLP "
            "output is scaled by it, so no MLP bias reproduces the shift; keep the adapter unmerged"
        )
    return bias_proj, 1.0 / factor


def _opt_rule(config, bias_proj: str | None) -> tuple[str | None, float]:
    """Post-norm OPT (``do_layer_norm_before=False``, e.g. opt-350m) ends each block with ``final_layer_norm``:
    the block output is ``LN(x) = g * norm(x) + b``, so the shift belongs in that LayerNorm's bias, not in fc2's."""
    if getattr(config, "do_layer_norm_before", True):
        return bias_proj, 1.0
    if not getattr(config, "layer_norm_elementwise_affine", True):
        raise ValueError(
            "cannot merge a steering vector into a post-norm OPT model (do_layer_norm_before=False) whose "
            "final_layer_norm has no bias (layer_norm_elementwise_affine=False); keep the adapter unmerged"
        )
    return "final_layer_norm", 1.0


for _name in ("qwen2", "qwen3", "mistral", "gemma", "phi3", "olmo"):
    register_family(_name, "layers", "mlp.down_proj")
register_family("llama", "layers", "mlp.down_proj", bias_flag="mlp_bias")
register_family("granite", "layers", "mlp.down_proj", merge_rule=_granite_rule, bias_flag="mlp_bias")
register_family("gemma2", "layers", "mlp.down_proj", merge_rule=_refuse_post_mlp_norm("gemma2"))
register_family("olmo2", "layers", "mlp.down_proj", merge_rule=_refuse_post_mlp_norm("olmo2"))
register_family("gpt2", "h", "mlp.c_proj")
register_family("gpt_neox", "layers", "mlp.dense_4h_to_h")
register_family("opt", "layers", "fc2", merge_rule=_opt_rule)
register_family("gptj", "h", None)


def merge_target(model_type: str | None, config) -> tuple[str | None, float, str | None]:
    """Where ``merge_and_unload`` folds a block-output shift for a model of ``model_type`` with ``config``.

    Args:
        model_type: ``config.model_type``.
        config: The model's config (read by the family's merge rule).

    Returns:
        ``(path, scale, refusal)``: the bias to add ``scale * m * v`` to (a path inside a block, ``None`` when
        unknown), and ``None`` -- or, when no bias is exact, ``(None, 1.0, reason)``.
    """
    family = FAMILIES.get(model_type)
    if family is None:
        return None, 1.0, None
    if family.merge_rule is None:
        return family.bias_proj, 1.0, None
    try:
        path, scale = family.merge_rule(config, family.bias_proj)
    except ValueError as err:
        return None, 1.0, str(err)
    return path, scale, None


def num_layers(model: nn.Module) -> int | None:
    """``num_hidden_layers`` (or ``n_layer``) of a transformers model, ``None`` when it has no config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def find_blocks(model: nn.Module, blocks_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """Finds the ``nn.ModuleList`` of decoder blocks.

    Args:
        model: A transformers model (any head), possibly wrapped by PEFT.
        blocks_path: Explicit dotted path of the list (overrides the registry).

    Returns:
        ``(path, module_list)`` with ``path`` relative to ``model``.

    Raises:
        ValueError: If no list can be found; the message lists the candidate ``nn.ModuleList`` names.
    """
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)]
    if blocks_path is not None:
        for name, mod in lists:
            if name == blocks_path or name.endswith("." + blocks_path):
                return name, mod
        raise ValueError(
            f"blocks_path {blocks_path!r} is not an nn.ModuleList of the model; ModuleLists: {[n for n, _ in lists]}"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    n = num_layers(model)
    family = FAMILIES.get(model_type)
    candidates = [(name, mod) for name, mod in lists if n is None or len(mod) == n]
    if family is not None:
        named = [(nm, m) for nm, m in candidates if nm.split(".")[-1] == family.blocks_attr]
        if named:
            return min(named, key=lambda item: item[0].count("."))
    if candidates:
        # Unknown family: the shallowest ModuleList with num_hidden_layers entries is the block stack.
        return min(candidates, key=lambda item: item[0].count("."))
    raise ValueError(
        f"cannot find the decoder blocks of this {type(model).__name__} (model_type {model_type!r}); "
        f"set SteeringConfig.blocks_path to one of the ModuleLists {[nm for nm, _ in lists]} or call "
        "steering.families.register_family"
    )


def hidden_size_of(model: nn.Module) -> int | None:
    """The residual-stream width of a transformers model (``hidden_size``/``n_embd``/``d_model``)."""
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None
