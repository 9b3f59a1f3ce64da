"""Layer-wise parameter groups for HELENE's per-layer clipping floor λ (and weight decay off for biases/norms).

Only ``requires_grad`` parameters enter the groups, so the same call serves full finetuning and any adapter
(LoRA, OFTv2, prompt tuning, steering): the frozen base is simply absent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from helene.zo import check_real

GRANULARITIES = ("tensor", "block", "model")

# A transformer block is the prefix up to "<layers|layer|h|blocks|block>.<index>" (Llama/Qwen/OPT "layers",
# BERT "layer", GPT-2 "h", T5 "block"); parameters outside blocks (embeddings, heads) form their own groups.
_BLOCK_RE = re.compile(r"^(.*?\b(?:layers|layer|h|blocks|block)\.\d+)\.")
_NO_DECAY_RE = re.compile(r"(^|\.)(bias|[^.]*norm[^.]*|ln_[^.]*|layernorm[^.]*)(\.|$)", re.IGNORECASE)


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay should be off for a parameter: biases, normalisation weights, 1-d tensors.

    Args:
        name: Qualified parameter name.
        param: The parameter.
    """
    return param.ndim <= 1 or bool(_NO_DECAY_RE.search(name))


def layer_key(name: str, granularity: str) -> str:
    """The group a parameter belongs to.

    Args:
        name: Qualified parameter name.
        granularity: ``"tensor"`` (one group per tensor), ``"block"`` (per transformer block; parameters outside
            blocks grouped by their module) or ``"model"`` (a single group).
    """
    if granularity == "tensor":
        return name
    if granularity == "model":
        return "model"
    match = _BLOCK_RE.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def layerwise_param_groups(
    model,
    granularity: str = "tensor",
    lam: float | Mapping[str, float] | Callable[[str], float] = 1.0,
    weight_decay: float = 0.0,
    **group_options,
) -> list[dict]:
    """Builds one param group per layer, each with its clipping floor ``lam`` and weight decay.

    Args:
        model: The model (a PEFT model works: frozen parameters are skipped), or an iterable of
            ``(name, parameter)`` pairs such as ``model.named_parameters()``.
        granularity: One of :data:`GRANULARITIES`.
        lam: The floor λ: one float for all groups, a mapping from a regular expression (searched in the group
            key) to λ — the first match wins, unmatched groups get the key ``"default"`` or 1.0 — or a function
            of the group key.
        weight_decay: Weight decay of decayed parameters; biases, norms and 1-d tensors get 0.
        **group_options: Further per-group options copied into every group (e.g. ``lr``).

    Returns:
        Param groups with keys ``params``, ``names``, ``layer``, ``lam``, ``weight_decay``; a layer with both
        decayed and non-decayed parameters becomes two groups with the same ``layer`` and ``lam``.

    Raises:
        ValueError: On an unknown granularity or when the model has no trainable parameter.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    check_real("weight_decay", weight_decay)
    groups: dict[tuple[str, bool], dict] = {}
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    for name, param in named:
        if not param.requires_grad:
            continue
        key = layer_key(name, granularity)
        no_decay = is_no_decay(name, param)
        group = groups.get((key, no_decay))
        if group is None:
            group = groups[(key, no_decay)] = {
                "params": [], "names": [], "layer": key, "lam": _resolve_lam(lam, key),
                "weight_decay": 0.0 if no_decay else weight_decay, **group_options,
            }
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to optimize")
    return list(groups.values())


def _resolve_lam(lam, key: str) -> float:
    if callable(lam):
        value = lam(key)
    elif isinstance(lam, Mapping):
        value = next((v for pattern, v in lam.items() if pattern != "default" and re.search(pattern, key)),
                     lam.get("default", 1.0))
    else:
        value = lam
    return check_real(f"lam (clipping floor λ) of layer {key!r}", value)
