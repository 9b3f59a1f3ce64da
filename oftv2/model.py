"""The OFTv2 tuner: finds the target layers and wraps them (``peft.get_peft_model`` drives it)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from contextlib import contextmanager

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING
from torch import nn

from peftplug.adapter_params import UpgradesLegacyKeys
from peftplug.quantized_layout import keep_exact_4bit_layout

from .config import OFTv2Config
from .conv import dispatch_conv2d
from .embedding import dispatch_embedding
from .experts import check_expert_targets
from .layer import OFTv2Layer, dispatch_default
from .stacking import stack_rotations

Dispatcher = Callable[..., nn.Module | None]
# Plain torch layer types the default dispatchers adapt (transformers' Conv1D too; bnb layers via oftv2.bnb).
ADAPTABLE_TYPES = (nn.Linear, nn.Conv2d, nn.Embedding)
SUPPORTED_LAYERS = "nn.Linear / Conv1D / nn.Conv2d / nn.Embedding"
# PEFT's "no module matched" messages (PEFT < 0.18 raises them as a plain ValueError, later as the subclass
# NoMatchingPeftModuleError); only these get the list of adaptable modules appended.
_NO_MATCH_MESSAGES = ("not found in the base model", "No modules were targeted", "All modules were excluded")


def dispatchers() -> list[Dispatcher]:
    """Layer factories tried in order; the first that returns a module wins.

    Quantized-base dispatchers from ``oftv2.bnb`` (when that module exists) come first: either its
    ``DISPATCHERS`` list, or its ``dispatch_bnb_8bit`` / ``dispatch_bnb_4bit`` functions. Each has the signature
    ``(target, adapter_name, config, **kwargs) -> nn.Module | None``. The defaults (``nn.Linear``, ``Conv1D``;
    ``nn.Conv2d``; ``nn.Embedding``) come last.
    """
    found: list[Dispatcher] = []
    # find_spec, not a bare import: the module is optional, and an ImportError *inside* it must not be swallowed.
    if importlib.util.find_spec("oftv2.bnb") is not None:
        bnb = importlib.import_module("oftv2.bnb")
        listed = getattr(bnb, "DISPATCHERS", None)
        if listed is not None:
            found.extend(listed)
        else:
            found.extend(
                f for f in (getattr(bnb, n, None) for n in ("dispatch_bnb_8bit", "dispatch_bnb_4bit")) if f
            )
    found.extend((dispatch_default, dispatch_conv2d, dispatch_embedding))
    return found


def adaptable_modules_hint(model: nn.Module, limit: int = 40) -> str:
    """A sentence naming the modules of ``model`` that OFTv2 can adapt, by their last name component.

    Args:
        model: The model that was searched.
        limit: Most names to list.
    """
    from transformers.pytorch_utils import Conv1D

    names: dict[str, None] = {}  # ordered set
    for full_name, module in model.named_modules():
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        # A wrapped layer is listed under its wrapper's name, not as "<name>.base_layer".
        inner = full_name.endswith(("base_layer", "original_module")) or ".modules_to_save." in full_name
        if isinstance(base, ADAPTABLE_TYPES + (Conv1D,)) and full_name and not inner:
            names.setdefault(full_name.rsplit(".", 1)[-1], None)
    if not names:
        return f"The model has no {SUPPORTED_LAYERS} module OFTv2 could adapt."
    listed = ", ".join(list(names)[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
    return f"Adaptable modules ({SUPPORTED_LAYERS}, by name) in this model: {listed}."


class OFTv2Model(UpgradesLegacyKeys, BaseTuner):
    """Injects OFTv2 layers into a model. Use through ``peft.get_peft_model(model, OFTv2Config(...))``.

    Saved adapters hold ``<layer>.oftv2_Q.weight`` tensors; those saved before that layout (``<layer>.oftv2_Q``)
    still load (:class:`peftplug.adapter_params.UpgradesLegacyKeys`).

    Args:
        model: The model to adapt.
        config: An ``OFTv2Config`` (or a dict of them keyed by adapter name).
        adapter_name: Name of the adapter.
        low_cpu_mem_usage: Create the adapter weights on the meta device (PEFT's loading fast path).
        state_dict: Optional state dict PEFT passes through on load.
    """

    prefix: str = "oftv2_"
    tuner_layer_cls = OFTv2Layer
    target_module_mapping = TRANSFORMERS_MODELS_TO_OFT_TARGET_MODULES_MAPPING

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        """PEFT's injection; when no module matched, the error also lists the adaptable modules that exist.

        Targets naming fused MoE expert weights (3-D parameters, not layers) are refused or warned about first
        (``oftv2.experts``).

        Args:
            model: The model to adapt.
            adapter_name: Name of the adapter.
            *args: Passed to ``BaseTuner.inject_adapter``.
            **kwargs: Passed to ``BaseTuner.inject_adapter``.
        """
        # Before anything is replaced: a refusal must leave the model as it was.
        check_expert_targets(model, self.peft_config[adapter_name])
        # Every 4-bit layer, not only those adapted below: bitsandbytes' in-place CPU repacking (at the first eval
        # forward on AVX512-BF16 CPUs) gives a matmul without autograd, so an unadapted 4-bit layer after an adapted
        # one would stop its gradient (q_proj's rotation, reached only through o_proj, trained no more after an
        # evaluation of a base TRL loaded via model_init_kwargs). A model already repacked is refused in one line.
        keep_exact_4bit_layout(model)
        try:
            super().inject_adapter(model, adapter_name, *args, **kwargs)
        except ValueError as err:
            if not any(m in str(err) for m in _NO_MATCH_MESSAGES):
                raise
            raise type(err)(f"{err} {adaptable_modules_hint(model)}") from err
        self._sync_stacking()

    def delete_adapter(self, adapter_name: str) -> None:
        """PEFT's deletion; the stacked-rotation hooks then follow the adapters that remain.

        Args:
            adapter_name: The adapter to delete.
        """
        super().delete_adapter(adapter_name)
        self._sync_stacking()

    def _unload_and_optionally_merge(self, *args, **kwargs):
        """PEFT's unload (``merge_and_unload`` / ``unload``), after removing the stacked-rotation hooks: the model
        handed back holds no OFTv2 layer for them to serve.

        Args:
            *args: Passed to ``BaseTuner._unload_and_optionally_merge``.
            **kwargs: Passed to ``BaseTuner._unload_and_optionally_merge``.
        """
        self._remove_stacking()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    def _remove_stacking(self) -> None:
        """Removes the stacked-rotation hooks the config installed, if any."""
        current = self.__dict__.pop("_oftv2_stacking", None)
        if current is not None:
            current.remove()

    def _sync_stacking(self) -> None:
        """(Re)installs ``oftv2.stack_rotations`` on the wrapped model when any adapter's config sets
        ``stack_rotations`` (over the layers that exist now), and removes it when none does."""
        self._remove_stacking()
        if any(getattr(config, "stack_rotations", False) for config in self.peft_config.values()):
            self.__dict__["_oftv2_stacking"] = stack_rotations(self.model)

    def _create_and_replace(
        self, config, adapter_name, target, target_name, parent, current_key, **optional_kwargs
    ):
        if current_key is None:
            raise ValueError("current_key must not be None")
        if isinstance(target, OFTv2Layer):
            target.update_layer(adapter_name, config, layer_name=current_key)
            return
        new_module = self._create_new_module(config, adapter_name, target, layer_name=current_key)
        if adapter_name not in self.active_adapters:
            # An added (not active) adapter starts frozen, as in PEFT's own tuners.
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        """Puts ``new_module`` in place of ``child`` and moves its adapter weights to the base weight's device.

        As ``LoraModel._replace_module`` does, and unlike ``BaseTuner``'s: that one assigns ``child.weight`` to a
        ``new_module`` without ``base_layer``, which on unload is PEFT's ``TrainableTokensWrapper`` handing back its
        original embedding (``trainable_token_indices``), whose ``weight`` is a plain tensor (the merged tokens), so
        ``merge_and_unload`` / ``unload`` failed. The assignment is never needed here: an OFTv2 layer keeps the
        original module as its ``base_layer``, and an unloaded module already holds its own weights.

        Args:
            parent: The module holding ``child``.
            child_name: Attribute name of ``child`` in ``parent``.
            new_module: The OFTv2 layer wrapping ``child``, or the module that unloading hands back.
            child: The module being replaced.
        """
        setattr(parent, child_name, new_module)
        # (requires_grad is set by _mark_only_adapters_as_trainable, as in PEFT's own tuners.)
        if hasattr(child, "base_layer"):
            child = child.base_layer
        meta = torch.device("meta")
        for name, module in new_module.named_modules():
            if self.prefix not in name:
                continue
            if hasattr(child, "weight"):
                weight = child.weight
            else:
                weight = next(child.parameters())
            # Weights created on the meta device (low_cpu_mem_usage) stay there until the checkpoint fills them.
            if not any(p.device == meta for p in module.parameters()):
                module.to(weight.device)

    @staticmethod
    def _create_new_module(config: OFTv2Config, adapter_name: str, target: nn.Module, **kwargs) -> nn.Module:
        for dispatch in dispatchers():
            new_module = dispatch(target, adapter_name, config, **kwargs)
            if new_module is not None:
                return new_module
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        raise TypeError(
            f"OFTv2 cannot adapt {kwargs.get('layer_name', 'this module')!r} of type {type(base).__name__}: supported "
            "are torch.nn.Linear, transformers' Conv1D, torch.nn.Conv2d, torch.nn.Embedding and (with oftv2.bnb) "
            "bitsandbytes Linear4bit/Linear8bitLt"
        )

    @contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        """Refuses ``adapter_names=`` (one adapter per sample, LoRA's mixed-batch inference): PEFT drops that
        argument from the forward of a tuner without this method, so every sample silently got the active adapter.

        Args:
            *args: The forward's / ``generate``'s positional arguments (unused).
            **kwargs: Its keyword arguments; only ``adapter_names`` is read.
        """
        if kwargs.get("adapter_names") is not None:
            raise ValueError(
                "OFTv2 does not support mixed-batch inference (`adapter_names=` in forward/generate): activate one "
                "adapter with set_adapter() and run each group of samples separately"
            )
        yield

    def add_weighted_adapter(self, *args, **kwargs) -> None:
        """Refused in one line: without this method the call fell through to the base model and failed with
        ``AttributeError: 'LlamaForCausalLM' object has no attribute 'add_weighted_adapter'``.

        Args:
            *args: LoRA's ``(adapters, weights, adapter_name, ...)`` (unused).
            **kwargs: Unused.

        Raises:
            ValueError: Always.
        """
        raise ValueError(
            "OFTv2 has no add_weighted_adapter (LoRA's linear combination of low-rank updates): OFTv2 adapters are "
            "rotations. To apply several in sequence, activate them together with model.base_model.set_adapter([...]) "
            "(y = base(x R1 R2 ...)), then merge_and_unload() if one merged model is wanted"
        )

    def _check_merge_allowed(self):
        super()._check_merge_allowed()
        if getattr(self.model, "quantization_method", None) == "gptq":
            raise ValueError("Cannot merge OFTv2 layers into a GPTQ-quantized model")
        # Tied layers (embed_tokens and lm_head) both adapted rotate one tensor: merging composes the two rotations on
        # it (each layer then computes the wrong function) and unmerging, in module order, does not restore it.
        owners: dict[int, str] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, OFTv2Layer) and module.oftv2_Q:
                weight = getattr(module.get_base_layer(), "weight", None)
                if weight is None:
                    continue
                if id(weight) in owners:
                    raise ValueError(
                        f"cannot merge OFTv2 adapters: {owners[id(weight)]!r} and {name!r} share one weight (tied "
                        "embeddings), so their rotations would compose on it and unmerging would not restore it; keep "
                        "the model unmerged or adapt only one of them")
                owners[id(weight)] = name
