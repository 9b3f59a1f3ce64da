"""An adapter-name-keyed parameter container whose parameters are named ``<attr>.<adapter>.weight``.

PEFT's own tuners store each adapter's tensors in child modules (``lora_A.default.weight``,
``oft_R.default.weight``), and tools built on PEFT rely on that naming: TRL's ``DPOTrainer`` (and its GRPO, KTO and
RLOO trainers) copy a pretrained ``default`` adapter into a frozen ``ref`` adapter by replacing ``.default.`` with
``.ref.`` in ``named_parameters()`` names. A ``nn.ParameterDict`` names its entries ``<attr>.<adapter>``, with no
dot after the adapter name, so that copy silently skipped such parameters and the "reference" was a fresh adapter
(an identity rotation for OFTv2, a zero vector for steering). :class:`AdapterParameterDict` keeps the
``ParameterDict`` interface (``layer.oftv2_Q[name]``, ``layer.steer_vector[name]`` is the tensor) while laying the
parameters out as PEFT's module-based tuners do. OFTv2 (``oftv2_Q``) and steering (``steer_vector``) use it.

Saved adapters: the state dict key is ``<layer>.<attr>.weight`` (PEFT's OFT: ``<layer>.oft_R.weight``). Adapters
saved before this layout (``<layer>.<attr>``) still load: :func:`upgrade_legacy_keys` renames the old keys before
PEFT >= 0.21 maps checkpoint keys onto the model (:class:`UpgradesLegacyKeys`, a tuner mixin), and a load
hook renames ``<layer>.<attr>.<adapter>`` for older PEFT releases, which insert the adapter name themselves (and
for full ``state_dict()`` checkpoints, such as Lightning's, which carry it).

A leaf module (DESIGN.md §2): it imports torch only, so every method package may use it.
"""

from __future__ import annotations

import torch
from torch import nn

PARAM_NAME = "weight"


class _Holder(nn.Module):
    """One adapter's tensor, registered as :data:`PARAM_NAME` (a module of its own, so the name gets a dot)."""

    def __init__(self, value: nn.Parameter) -> None:
        super().__init__()
        self.weight = value

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}, dtype={self.weight.dtype}"


def _as_parameter(value: torch.Tensor, requires_grad: bool | None) -> nn.Parameter:
    if isinstance(value, nn.Parameter):
        return value
    # `.to()` of a Parameter returns a plain tensor: wrap it again, keeping the trainable flag it had.
    grad = value.requires_grad if requires_grad is None else requires_grad
    return nn.Parameter(value.detach(), requires_grad=grad)


def upgrade_legacy_keys(state_dict: dict[str, torch.Tensor], attrs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A checkpoint state dict (adapter name removed) with the old keys ``<layer>.<attr>`` as ``<layer>.<attr>.weight``.

    Args:
        state_dict: As read from ``adapter_model.safetensors``.
        attrs: The container attribute names (e.g. ``("oftv2_Q",)``).
    """
    suffixes = tuple(f".{a}" for a in attrs)
    return {(f"{k}.{PARAM_NAME}" if k.endswith(suffixes) else k): v for k, v in state_dict.items()}


class UpgradesLegacyKeys:
    """Mixin for a PEFT ``BaseTuner`` (listed before it) whose ``tuner_layer_cls`` keeps every tensor of its
    ``adapter_layer_names`` in an :class:`AdapterParameterDict`: checkpoints saved before that layout load.

    PEFT (>= 0.21) maps checkpoint keys onto the model's in ``_remap_adapter_state_dict_for_load``; the old keys
    ``<layer>.<attr>`` are renamed to ``<layer>.<attr>.weight`` first (:func:`upgrade_legacy_keys`).
    """

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        """PEFT's key mapping, after the legacy keys were renamed.

        Args:
            model: The PEFT model.
            config: The adapter's config.
            adapter_name: Name the adapter is loaded under.
            state_dict: The checkpoint's tensors (adapter name removed).
        """
        state_dict = upgrade_legacy_keys(state_dict, cls.tuner_layer_cls.adapter_layer_names)
        return super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)


def _rename_legacy_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Load pre-hook: the pre-container key ``<prefix><adapter>`` becomes ``<prefix><adapter>.weight``."""
    for key in [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]]:
        new_key = f"{key}.{PARAM_NAME}"
        if new_key not in state_dict:
            state_dict[new_key] = state_dict.pop(key)


class AdapterParameterDict(nn.ModuleDict):
    """``adapter name -> nn.Parameter``, stored as child modules so that names read ``<attr>.<adapter>.weight``.

    Indexing returns and assigns the parameter itself (as in ``nn.ParameterDict``); ``items()`` and ``values()``
    yield the holder modules (as in ``nn.ModuleDict``), which is what PEFT's layer utilities iterate over.

    Args:
        parameters: Optional initial ``{adapter name: tensor}``.
    """

    def __init__(self, parameters: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)
        for name, value in (parameters or {}).items():
            self[name] = value

    def __getitem__(self, key: str) -> nn.Parameter:
        return self._modules[key].weight

    def get(self, key: str, default: nn.Parameter | None = None) -> nn.Parameter | None:
        """The parameter of adapter ``key``, or ``default`` when it has none (one lookup where ``in`` and indexing
        make two: every forward of every layer asks).

        Args:
            key: Adapter name.
            default: Returned for an adapter without a parameter here.
        """
        holder = self._modules.get(key)
        return default if holder is None else holder.weight

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        old = self._modules.get(key)
        keep = None if old is None or isinstance(value, nn.Parameter) else old.weight.requires_grad
        if old is not None:
            old.weight = _as_parameter(value, keep)
        else:
            self.add_module(key, _Holder(_as_parameter(value, keep)))

    def parameter_items(self):
        """``(adapter name, parameter)`` pairs, like ``nn.ParameterDict.items()``."""
        return [(name, holder.weight) for name, holder in self._modules.items()]
