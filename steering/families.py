"""Where the decoder blocks of a model family live, and how to find them in an arbitrary model.

Adding a family is one call::

    from steering.families import register_family
    register_family("my_model_type", blocks_attr="layers", bias_proj="mlp.down_proj")

``blocks_attr`` is the attribute name of the ``nn.ModuleList`` of decoder blocks (searched anywhere in the
model, so the same entry serves ``XForCausalLM``, ``XModel`` and ``XForSequenceClassification``);
``bias_proj`` is the last projection inside a block whose output is added to the residual stream (the place
where an ``"add"`` vector on all positions can be folded in as a bias by ``merge_and_unload``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Family:
    """How to find the decoder blocks of one ``model_type``.

    Args:
        blocks_attr: Attribute name of the ``nn.ModuleList`` holding the decoder blocks.
        bias_proj: Dotted path, inside a block, of the last residual-writing projection (or ``None``).
    """

    blocks_attr: str
    bias_proj: str | None = None


FAMILIES: dict[str, Family] = {}


def register_family(model_type: str, blocks_attr: str, bias_proj: str | None = None) -> None:
    """Registers (or replaces) how to find the decoder blocks of ``model_type``.

    Args:
        model_type: ``config.model_type`` of the family (e.g. ``"llama"``).
        blocks_attr: Attribute name of the block ``nn.ModuleList``.
        bias_proj: Last residual-writing projection inside a block, for merging (optional).
    """
    FAMILIES[model_type] = Family(blocks_attr, bias_proj)


for _name in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite"):
    register_family(_name, "layers", "mlp.down_proj")
register_family("gpt2", "h", "mlp.c_proj")
register_family("gpt_neox", "layers", "mlp.dense_4h_to_h")
register_family("opt", "layers", "fc2")
register_family("gptj", "h", None)


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
