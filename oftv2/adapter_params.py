"""An adapter-name-keyed parameter container whose parameters are named ``<attr>.<adapter>.weight``.

PEFT's own tuners store each adapter's tensors in child modules (``lora_A.default.weight``,
``oft_R.default.weight``), and tools built on PEFT rely on that naming: TRL's ``DPOTrainer`` (and its GRPO, KTO and
RLOO trainers) copy a pretrained ``default`` adapter into a frozen ``ref`` adapter by replacing ``.default.`` with
``.ref.`` in ``named_parameters()`` names. A ``nn.ParameterDict`` names its entries ``<attr>.<adapter>``, with no
dot after the adapter name, so that copy silently skipped every OFTv2 parameter and the "reference" was a fresh
identity adapter. :class:`AdapterParameterDict` keeps the ``ParameterDict`` interface (``layer.oftv2_Q[name]`` is
the tensor) while laying the parameters out as PEFT's module-based tuners do.

Saved adapters: the state dict key is ``<layer>.oftv2_Q.weight`` (PEFT's OFT: ``<layer>.oft_R.weight``). Adapters
saved before this layout (``<layer>.oftv2_Q``) still load: :func:`upgrade_legacy_keys` renames the old keys before
PEFT >= 0.21 maps checkpoint keys onto the model (``OFTv2Model._remap_adapter_state_dict_for_load``), and a load
hook renames ``<layer>.oftv2_Q.<adapter>`` for older PEFT releases, which insert the adapter name themselves.
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
