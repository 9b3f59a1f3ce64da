"""The steering tuner: wraps decoder blocks with :class:`~steering.layer.SteeringLayer` (PEFT ``BaseTuner``)."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from typing import ClassVar

import torch
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from peftplug.adapter_params import UpgradesLegacyKeys
from peftplug.quantized_layout import (
    RepackedWeightError,
    keep_exact_4bit_layout_if_intact,
    repacked_layers,
    repacked_message,
)
from steering.config import SteeringConfig, check_trainable_positions
from steering.families import FAMILIES, find_blocks, hidden_size_of, merge_target
from steering.layer import SteeringLayer, bias_dtype, check_no_zero_ablation
from steering.merge import COMBINATIONS, merge_vectors
from steering.positions import SteeringContext


class SteeringModel(UpgradesLegacyKeys, BaseTuner):
    """PEFT tuner for steering vectors: ``peft.get_peft_model(model, SteeringConfig(layers=[...]))``.

    Beyond the usual PEFT API it offers :meth:`set_vectors`, :meth:`get_vectors`, :meth:`set_multiplier`,
    :meth:`add_weighted_adapter` (linear / TIES / DARE merge into a new adapter), ``set_adapter([...])`` with
    several names (their vectors add up), and a ``generate`` that tells the layers where the prompt ends.
    Saved adapters hold ``<block>.steer_vector.weight`` tensors; those saved before that layout
    (``<block>.steer_vector``) still load (:class:`peftplug.adapter_params.UpgradesLegacyKeys`).

    Args:
        model: The transformers model to steer.
        config: A :class:`SteeringConfig` (or dict of them).
        adapter_name: Name of the first adapter.
        low_cpu_mem_usage: Accepted for API compatibility (vectors are tiny).
        state_dict: Accepted for API compatibility.
    """

    prefix: str = "steer_"
    tuner_layer_cls = SteeringLayer
    target_module_mapping: ClassVar[dict] = {}

    def __init__(self, model, config, adapter_name="default", low_cpu_mem_usage: bool = False, state_dict=None):
        # The context must exist before BaseTuner.__init__ injects the first adapter.
        self.__dict__["steer_context"] = SteeringContext()
        super().__init__(model, config, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage, state_dict=state_dict)

    # ------------------------------------------------------------------------------------------ injection
    def _blocks(self, config: SteeringConfig) -> tuple[str, nn.ModuleList]:
        return find_blocks(self.model, config.blocks_path)

    def _prepare_adapter_config(self, peft_config: SteeringConfig, model_config: dict) -> SteeringConfig:
        peft_config.check_vectors_only()
        path, blocks = self._blocks(peft_config)
        bad = [i for i in peft_config.layers if i >= len(blocks)]
        if bad:
            raise ValueError(
                f"SteeringConfig.layers {bad} out of range: the model has {len(blocks)} decoder blocks "
                f"(valid indices 0..{len(blocks) - 1})"
            )
        if (model_config.get("is_encoder_decoder") and peft_config.positions in ("generated", "from_last_prompt")
                and not _decoder_of_encoder_decoder(self.model, path)):
            # The encoder never sees generated tokens: such a vector steered nothing, silently (T5: outputs equal
            # to the base model's at multiplier 50).
            raise ValueError(
                f"SteeringConfig.positions={peft_config.positions!r} steers generated tokens, but on this "
                f"encoder-decoder model the layers index the encoder's blocks ({path!r}), which never see them; use "
                "positions 'all' or 'prompt', or blocks_path to the decoder's blocks"
            )
        hidden = hidden_size_of(self.model)
        if peft_config.hidden_size is not None and hidden is not None and peft_config.hidden_size != hidden:
            raise ValueError(
                f"steering adapter was made for hidden size {peft_config.hidden_size} "
                f"(model_type {peft_config.model_type!r}), but this model's hidden size is {hidden} "
                f"(model_type {model_config.get('model_type')!r}); steering vectors cannot be applied across "
                "hidden sizes"
            )
        model_type = model_config.get("model_type")
        if peft_config.model_type is not None and model_type is not None and peft_config.model_type != model_type:
            warnings.warn(
                f"steering adapter was extracted from a {peft_config.model_type!r} model and is applied to a "
                f"{model_type!r} model of the same hidden size; the directions may not transfer"
            )
        peft_config.hidden_size = peft_config.hidden_size or hidden
        peft_config.model_type = peft_config.model_type or model_type
        # Exact names of the steered blocks, as a regex so that PEFT matches the full key only.
        names = "|".join(str(i) for i in peft_config.layers)
        peft_config.target_modules = rf"^{re.escape(path)}\.({names})$" if path else rf"^({names})$"
        return peft_config

    def _create_and_replace(
        self, peft_config, adapter_name, target, target_name, parent, current_key, parameter_name=None, **kwargs
    ):
        layer_index = int(current_key.rsplit(".", 1)[-1])
        if isinstance(target, SteeringLayer):
            target.update_layer(adapter_name, peft_config)
            return
        hidden = peft_config.hidden_size or hidden_size_of(self.model)
        # The model's own family decides where a merge goes (the adapter's model_type is only provenance: vectors
        # may come from another family of the same width).
        model_config = getattr(self.model, "config", None)
        model_type = getattr(model_config, "model_type", None) or peft_config.model_type
        bias_proj, bias_scale, refusal = merge_target(model_type, model_config)
        new = SteeringLayer(
            target, adapter_name, layer_index, self.steer_context, peft_config, hidden,
            bias_proj=bias_proj, bias_scale=bias_scale, merge_refusal=refusal,
        )
        if adapter_name not in self.active_adapters:
            new.requires_grad_(False)
        self._replace_module(parent, target_name, new, target)

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        setattr(parent, child_name, new_module)
        if not hasattr(new_module, "base_layer"):
            return
        # Keep the block's own parameters on their device; put the vectors there too. Under low_cpu_mem_usage
        # PEFT creates the vectors on the meta device and assigns the loaded ones afterwards: those stay (as LoRA
        # does), since meta tensors have no data to move.
        ref = next(child.parameters(), None)
        if ref is not None:
            meta = torch.device("meta")
            for name, module in new_module.named_modules():
                if self.prefix in name and not any(p.device == meta for p in module.parameters()):
                    module.to(ref.device)

    def _post_injection_hook(self, model: nn.Module, config: SteeringConfig, adapter_name: str) -> None:
        path, _ = self._blocks(config)
        owner = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        self.steer_context.install(owner)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        """PEFT's ``inject_adapter``, then the position bookkeeping is (re-)installed.

        PEFT calls ``_post_injection_hook`` only when the tuner is built, not on ``add_adapter``/``load_adapter``.
        After ``delete_adapter`` removed the last adapter (and with it the pre-hook), an adapter added later would
        otherwise steer without it: every token, whatever its ``positions`` policy.

        Args:
            model: The model being tuned.
            adapter_name: The adapter to inject.
            *args: Passed to PEFT.
            **kwargs: Passed to PEFT.
        """
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        self._post_injection_hook(model, self.peft_config[adapter_name], adapter_name)
        # bitsandbytes repacks a 4-bit layer in place at its first eval forward without gradients on AVX512-BF16
        # CPUs, and the repacked matmul has no autograd: after one evaluate() (or train_vectors' no-grad reference
        # forward) a vector's gradient lost every path through the later blocks, silently. A base repacked already
        # (a CAA pass before the adapter was attached) still steers at inference; training it is refused instead.
        keep_exact_4bit_layout_if_intact(model)

    def train(self, mode: bool = True) -> SteeringModel:
        """``nn.Module.train``, refusing first to train a vector whose ``positions`` no training forward can express.

        Trainers (HF ``Trainer``, TRL, Lightning) call ``model.train()`` before their steps. A training forward has
        no prompt length, so under ``positions="generated"`` (or ``"from_last_prompt"``) the vector got no gradient
        (or only the last token's, which no label reads) while the run logged normal losses. Likewise an
        ``operator="ablate"`` vector that is still zero (its initial value): ``h - m (h.u) u`` with ``u = v/|v|`` is
        quadratic in ``v`` at zero, so its gradient is exactly zero and it never moves.

        Args:
            mode: Training mode (``False`` is ``eval()``, never refused).
        """
        if mode:
            for layer in self.model.modules():
                if not isinstance(layer, SteeringLayer):
                    continue
                for name, param in layer.steer_vector.parameter_items():
                    if name in layer.active_adapters and param.requires_grad:
                        check_trainable_positions(layer.steer_positions[name], f"adapter {name!r} put in training mode")
            check_no_zero_ablation(self.model.modules(), trainable_only=True)
            refuse_training_on_repacked_4bit(self.model)
        return super().train(mode)

    def _check_steering_merge(self, adapter_names: list[str] | None) -> None:
        """Raises ``ValueError`` before any bias changes if some layer cannot merge ``adapter_names`` exactly."""
        names = list(adapter_names) if adapter_names is not None else list(self.active_adapters)
        for layer in self.steering_layers().values():
            layer.check_mergeable(names)

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """PEFT's ``merge_adapter``, refused as a whole (no block merged) when some block cannot merge exactly.

        Args:
            adapter_names: Adapters to merge (default: the active ones).
            safe_merge: Check for non-finite values first.
        """
        self._check_steering_merge(adapter_names)
        super().merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)

    def _unload_and_optionally_merge(
        self, merge: bool = True, progressbar: bool = False, safe_merge: bool = False, adapter_names=None
    ):
        layers = list(self.steering_layers().values())
        blocks = self._blocks(next(iter(self.peft_config.values())))[1] if self.peft_config else None
        if merge:
            self._check_steering_merge(adapter_names)
        model = super()._unload_and_optionally_merge(
            merge=merge, progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names
        )
        # The returned model is plain again: its forward must not keep paying for (or using) our bookkeeping.
        self.steer_context.uninstall()
        created = [layer for layer in layers if layer._created_bias]
        if created and blocks is not None:  # also unload() after merge_adapter(): the biases stay
            keep_created_biases(model, blocks, created[0].bias_proj)
        return model

    def delete_adapter(self, adapter_name: str) -> None:
        """Deletes an adapter; with the last one gone, the position bookkeeping is removed too.

        Args:
            adapter_name: Adapter to delete.
        """
        super().delete_adapter(adapter_name)
        if not self.peft_config:
            self.steer_context.uninstall()

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            if self.prefix not in name:
                param.requires_grad = False

    def _check_new_adapter_config(self, config: SteeringConfig) -> None:
        """Several steering adapters may coexist (they are meant to be combined)."""

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """Vectors stay in fp32 and are cast to the hidden-state dtype on the fly."""

    # ------------------------------------------------------------------------------------------ helpers
    def steering_layers(self, adapter_name: str | None = None) -> dict[int, SteeringLayer]:
        """The steering layers, by block index (only those holding ``adapter_name`` when given).

        Args:
            adapter_name: Restrict to the layers of this adapter.
        """
        out = {}
        for module in self.model.modules():
            if isinstance(module, SteeringLayer) and (adapter_name is None or adapter_name in module.steer_vector):
                out[module.layer_index] = module
        return dict(sorted(out.items()))

    def _require(self, adapter_name: str) -> SteeringConfig:
        if adapter_name not in self.peft_config:
            raise ValueError(f"no steering adapter {adapter_name!r}; have {sorted(self.peft_config)}")
        return self.peft_config[adapter_name]

    def set_vectors(self, vectors: dict[int, torch.Tensor], adapter_name: str = "default") -> None:
        """Sets the vectors of ``adapter_name`` from ``{layer: tensor}``.

        Args:
            vectors: One ``[hidden_size]`` tensor per steered layer (keys must be the adapter's layers).
            adapter_name: Adapter name.
        """
        config = self._require(adapter_name)
        layers = self.steering_layers(adapter_name)
        unknown = sorted({int(k) for k in vectors} - set(layers))
        if unknown:
            raise ValueError(f"adapter {adapter_name!r} steers layers {config.layers}, got vectors for {unknown}")
        for layer, vector in vectors.items():
            layers[int(layer)].set_vector(adapter_name, vector)

    def get_vectors(self, adapter_name: str = "default") -> dict[int, torch.Tensor]:
        """The raw (unscaled) vectors of ``adapter_name`` as ``{layer: tensor}`` (detached copies).

        Args:
            adapter_name: Adapter name.
        """
        self._require(adapter_name)
        return {i: m.steer_vector[adapter_name].detach().clone() for i, m in self.steering_layers(adapter_name).items()}

    def set_multiplier(
        self, multiplier: float, adapter_name: str | None = None, layer_multipliers: dict | None = None
    ) -> None:
        """Changes the steering strength (kept in the config, so ``save_pretrained`` records it).

        Args:
            multiplier: New global multiplier.
            adapter_name: Adapter to change (default: every active adapter).
            layer_multipliers: New per-layer factors (``None`` keeps the current ones).
        """
        names = [adapter_name] if adapter_name is not None else list(self.active_adapters)
        # Validate on copies first: a rejected value must leave every config (and what save_pretrained writes)
        # as it was.
        checked = {}
        for name in names:
            candidate = copy.deepcopy(self._require(name))
            candidate.multiplier = multiplier
            if layer_multipliers is not None:
                candidate.layer_multipliers = layer_multipliers
            candidate.__post_init__()
            checked[name] = candidate
        for name, candidate in checked.items():
            config = self.peft_config[name]
            config.multiplier, config.layer_multipliers = candidate.multiplier, candidate.layer_multipliers
            merged = False
            for layer in self.steering_layers(name).values():
                layer.steer_multiplier[name] = config.layer_multiplier(layer.layer_index)
                merged = merged or name in layer.merged_adapters
            if merged:
                warnings.warn(
                    f"adapter {name!r} is merged: the bias keeps the old multiplier until unmerge_adapter() "
                    "(which restores the unsteered bias exactly); the new one applies after that"
                )

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """Activates one adapter or several (several steering adapters add up).

        Args:
            adapter_name: Name or list of names.
            inference_mode: Freeze the activated vectors.
        """
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        for name in names:
            self._require(name)
        layers = [m for m in self.model.modules() if isinstance(m, SteeringLayer)]
        if any(layer.merged for layer in layers):
            # PEFT's convention (BaseTuner.set_adapter): a merged adapter would keep steering from the bias while
            # another is reported active, so the model is unmerged first.
            warnings.warn("Adapter cannot be set when the model is merged. Unmerging the model first.")
            for layer in layers:
                if layer.merged:
                    layer.unmerge()
        for layer in layers:
            layer.set_adapter(names, inference_mode=inference_mode)
        self.active_adapter = names[0] if len(names) == 1 else names

    @contextlib.contextmanager
    def prompt_length(self, length: int):
        """Declares the prompt length for plain forwards (e.g. to score a continuation as if generated).

        Args:
            length: Number of prompt tokens (padded width).
        """
        with self.steer_context.prompt_length(length):
            yield

    def generate(self, *args, **kwargs):
        """``model.generate`` with the prompt length made known to the position policies."""
        ref = kwargs.get("input_ids")
        if ref is None:
            # transformers' own name of the prompt (``generate(inputs=ids)``): without it the prompt length stayed
            # unknown, and under use_cache=False every step (a fresh full forward) counted as prompt, so
            # "generated" steered nothing and "prompt" every token.
            ref = kwargs.get("inputs")
        if ref is None and args and torch.is_tensor(args[0]):
            ref = args[0]
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None:
            return self.model.generate(*args, **kwargs)
        length = ref.shape[1]
        if any(_decoder_of_encoder_decoder(self.model, self._blocks(c)[0]) for c in self.peft_config.values()):
            # The steered blocks are the decoder's, whose prompt is its start token(s) (decoder_input_ids, with
            # the start token generate may prepend), not the encoder input: with the encoder's width, "generated"
            # left the first tokens unsteered and "prompt" steered them. The first decoder forward holds exactly it.
            length = None
        with self.steer_context.prompt_length(length, generating=True):
            return self.model.generate(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ merging
    def add_weighted_adapter(
        self,
        adapters: list[str],
        weights: list[float],
        adapter_name: str,
        combination_type: str = "linear",
        density: float = 1.0,
        majority_sign_method: str = "total",
        seed: int = 0,
    ) -> None:
        """Merges several steering adapters into a new one (EasyEdit2's vector merge, PEFT's API).

        Each adapter contributes its *effective* vectors (multiplier and normalisation folded in); the new
        adapter has multiplier 1 and steers the union of the layers (missing layers count as zero vectors).

        Args:
            adapters: Names of the adapters to merge (all with operator ``"add"`` and the same positions).
            weights: One weight per adapter.
            adapter_name: Name of the new adapter.
            combination_type: One of ``steering.merge.COMBINATIONS``.
            density: Fraction of entries kept by TIES/DARE pruning, in (0, 1].
            majority_sign_method: ``"total"`` or ``"frequency"`` (TIES sign election).
            seed: Seed of DARE's random drop.
        """
        if combination_type not in COMBINATIONS:
            raise ValueError(f"combination_type must be one of {COMBINATIONS}, got {combination_type!r}")
        if not adapters or len(adapters) != len(weights):
            raise ValueError(f"need one weight per adapter, got {len(adapters)} adapters and {len(weights)} weights")
        if adapter_name in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} already exists")
        configs = [self._require(a) for a in adapters]
        for a, c in zip(adapters, configs):
            if c.operator != "add":
                raise ValueError(f"only operator='add' adapters can be merged; {a!r} uses {c.operator!r}")
        if len({c.positions for c in configs}) != 1:
            raise ValueError(f"adapters to merge use different position policies: {[c.positions for c in configs]}")
        layers = sorted(set().union(*(c.layers for c in configs)))
        merged: dict[int, torch.Tensor] = {}
        for layer in layers:
            tensors = []
            for a, c in zip(adapters, configs):
                module = self.steering_layers(a).get(layer)
                if module is None:
                    tensors.append(torch.zeros(c.hidden_size))
                else:
                    v = module._effective_vector(a, torch.float32).detach().cpu()
                    tensors.append(module.steer_multiplier[a] * v)
            merged[layer] = merge_vectors(tensors, weights, combination_type, density, majority_sign_method, seed)
        new_config = copy.deepcopy(configs[0])
        new_config.layers = layers
        new_config.multiplier = 1.0
        new_config.layer_multipliers = None
        new_config.normalize = False
        new_config.method = f"merge:{combination_type}({','.join(adapters)})"
        new_config.target_modules = None
        new_config.__post_init__()
        self.peft_config[adapter_name] = new_config
        self.inject_adapter(self.model, adapter_name)
        self.set_vectors(merged, adapter_name)
        # inject_adapter may have flipped requires_grad; keep the active adapters as they were.
        self.set_adapter(self.active_adapters)


def _decoder_of_encoder_decoder(model: nn.Module, path: str) -> bool:
    """Whether ``path`` (of the steered blocks) is the decoder's of an encoder-decoder ``model``.

    Args:
        model: The transformers model.
        path: Dotted path of its steered ``nn.ModuleList``.
    """
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)) and path.startswith(
        ("decoder", "model.decoder"))


def keep_created_biases(model: nn.Module, blocks: nn.ModuleList, bias_proj: str) -> None:
    """Makes biases that ``merge_and_unload`` had to create survive ``save_pretrained`` -> ``from_pretrained``.

    transformers builds a model from its config, so a bias the config does not declare (Llama with
    ``mlp_bias=False``) is dropped on reload, and the merged steering with it. Where the family has a config flag
    for MLP biases it is set, and the projections it governs get zero biases (the same outputs, and a checkpoint
    without missing keys); elsewhere a warning says so.

    Args:
        model: The unloaded (plain) model.
        blocks: Its decoder blocks.
        bias_proj: Path, inside a block, of the projection that received the created bias.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    flag = family.bias_flag if family is not None else None
    if flag is None or not hasattr(config, flag):
        warnings.warn(
            f"merge_and_unload folded steering vectors into new {bias_proj} biases, which a {model_type!r} config "
            "cannot declare: this model steers, but save_pretrained -> from_pretrained drops them; save the adapter "
            "(PeftModel.save_pretrained) instead of the merged model"
        )
        return
    setattr(config, flag, True)
    owner = bias_proj.rsplit(".", 1)[0] if "." in bias_proj else ""
    for block in blocks:
        mlp = block.get_submodule(owner) if owner else block
        for module in mlp.modules():
            if isinstance(module, nn.Linear) and module.bias is None:
                module.bias = nn.Parameter(
                    torch.zeros(module.out_features, device=module.weight.device, dtype=bias_dtype(module, block)),
                    requires_grad=False,
                )


def steering_model_of(model) -> SteeringModel:
    """The :class:`SteeringModel` inside a ``PeftModel`` (or the argument itself).

    Args:
        model: A ``PeftModel`` wrapping a steering adapter, or a ``SteeringModel``.
    """
    if isinstance(model, SteeringModel):
        return model
    base = getattr(model, "base_model", None)
    if isinstance(base, SteeringModel):
        return base
    raise TypeError(f"expected a PeftModel with a steering adapter, got {type(model).__name__}")


def refuse_training_on_repacked_4bit(model: nn.Module) -> None:
    """Raises if a steering vector would train through 4-bit layers that bitsandbytes repacked for CPU inference.

    The repacked matmul has no autograd, so the vector's gradient would miss every path through those layers (no
    error, just a wrong gradient). Only a base repacked before the adapter was attached gets here: the injection
    switches the repacking off otherwise.

    Args:
        model: The steered model (or any module holding its steering layers).

    Raises:
        RepackedWeightError: If a trainable steering vector is active and a 4-bit layer is repacked.
    """
    trainable = any(param.requires_grad and name in layer.active_adapters
                    for layer in model.modules() if isinstance(layer, SteeringLayer)
                    for name, param in layer.steer_vector.parameter_items())
    names = repacked_layers(model) if trainable else []
    if names:
        raise RepackedWeightError(f"cannot train a steering vector: {repacked_message(names)}")
