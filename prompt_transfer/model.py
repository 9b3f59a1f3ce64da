"""The PCT prompt encoder: ``P_t = P_0 + sum_k softmax_k(q . key_k / (tau sqrt(d))) S_k + R``.

PEFT's prompt-learning path reads the prompt through ``prompt_encoder(indices)`` while training and through
``prompt_encoder.embedding.weight`` in inference mode, and asks ``prompt_encoder.embedding.weight.device``
for the device. So the fusion lives in :class:`PCTFusion`, held as ``embedding``, whose ``weight`` is the fused
prompt computed from the trainable parameters: every path sees the same differentiable prompt.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BasePromptEncoder

from peftplug.errors import MissingFileError
from prompt_transfer.decompose import info_nce, load_decomposition, model_id

logger = logging.getLogger(__name__)

# Keys of the adapter state written by save_pretrained (PEFT stores prompt-learning state without adapter names).
STATE_KEYS = ("pct_p0", "pct_specific", "pct_query", "pct_key_offsets", "pct_residual")

#: The live encoder built from each config object, by ``id(config)`` (an entry holds its config, so the id stays
#: unique while the entry lives; it goes with the encoder). See ``PCTPromptEncoder.__init__``.
_ENCODER_OF_CONFIG: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class PCTFusion(torch.nn.Module):
    """Holds ``P_0``, ``S_k`` (frozen buffers) and the trainable query, key offsets and residual.

    Args:
        num_virtual_tokens: Prompt length ``l``.
        token_dim: Embedding width ``d``.
        num_sources: ``K``.
        repeats: How many stacked copies ``weight`` returns (PEFT's ``num_transformer_submodules``).
        temperature: Attention temperature ``tau``.
        fusion: ``"attention"`` or ``"mean"``.
        trainable_residual: Whether ``R`` is a parameter (else a zero buffer).
    """

    def __init__(self, num_virtual_tokens: int, token_dim: int, num_sources: int, repeats: int = 1,
                 temperature: float = 0.1, fusion: str = "attention", trainable_residual: bool = True):
        super().__init__()
        self.repeats, self.temperature, self.fusion = repeats, temperature, fusion
        self.register_buffer("p0", torch.zeros(num_virtual_tokens, token_dim))
        self.register_buffer("specific", torch.zeros(num_sources, num_virtual_tokens, token_dim))
        # Zero query: uniform attention at init, so PCT starts at the mean source prompt (P_0 + mean S_k).
        # What does not train is a buffer, not a frozen parameter, so optimisers built from .parameters() and
        # trainable-parameter counts see exactly what trains.
        self._add("query", torch.zeros(token_dim), trainable=fusion == "attention")
        self._add("key_offsets", torch.zeros(num_sources, token_dim), trainable=fusion == "attention")
        self._add("residual", torch.zeros(num_virtual_tokens, token_dim), trainable=trainable_residual)
        self.loaded = False
        #: The decomposition folder the config named (for the message when nothing was loaded).
        self.decomposition_path: str | None = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """torch's ``load_state_dict`` (a Lightning checkpoint restored, ``PeftModule.load_from_checkpoint``,
        ``peftplug export --ckpt_path``) brings ``P_0`` and ``S_k`` in as PEFT's loader does: they are then loaded,
        whether or not the decomposition folder still exists."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "p0" in state_dict and prefix + "specific" in state_dict:
            self.loaded = True

    def _add(self, name: str, value: torch.Tensor, trainable: bool) -> None:
        if trainable:
            self.register_parameter(name, torch.nn.Parameter(value))
        else:
            self.register_buffer(name, value)

    def set_sources(self, p0: torch.Tensor, specific: torch.Tensor) -> None:
        """Copies ``P_0`` and ``S_k`` in (shapes must match)."""
        with torch.no_grad():
            self.p0.copy_(p0)
            self.specific.copy_(specific)
        self.loaded = True

    def keys(self) -> torch.Tensor:
        """``key_k``: the unit-normalised token-max-pool of ``S_k`` (as in ATTEMPT) plus a trainable offset."""
        pooled = self.specific.amax(dim=1)
        return F.normalize(pooled, dim=-1, eps=1e-12) + self.key_offsets

    def attention(self) -> torch.Tensor:
        """Attention weights over the ``K`` sources, ``[K]``, summing to one."""
        k = self.specific.shape[0]
        if self.fusion == "mean":
            return torch.full((k,), 1.0 / k, device=self.p0.device, dtype=self.p0.dtype)
        # Divide by sqrt(d) as well: Adam moves every coordinate of q by ~lr, so |q| grows like lr*sqrt(d); this
        # keeps "tau" meaning the same for any width.
        scale = self.temperature * self.query.shape[0] ** 0.5
        return torch.softmax(self.keys() @ self.query / scale, dim=0)

    def task_specific(self) -> torch.Tensor:
        """The target's task-specific part ``sum_k a_k S_k + R``, ``[l, d]``."""
        if not self.loaded:
            # Raised at first use, not when the adapter is built: load_pct_for_training and checkpoint restores
            # build it first and load P_0 and S_k afterwards.
            path = self.decomposition_path
            where = "is not set" if path is None else f"{path!r} does not exist"
            raise MissingFileError(
                f"PCTConfig.decomposition_path {where} and no saved PCT state was loaded: run the source stage "
                f"first (peftplug pct train-sources, or peftplug pct decompose --out {path or 'FOLDER'})"
            )
        return torch.einsum("k,kld->ld", self.attention(), self.specific) + self.residual

    def fused(self) -> torch.Tensor:
        """The target prompt ``P_t``, ``[l, d]``."""
        return self.p0 + self.task_specific()

    @property
    def weight(self) -> torch.Tensor:
        """``P_t`` stacked ``repeats`` times, ``[repeats * l, d]`` (PEFT's ``embedding.weight``)."""
        prompt = self.fused()
        return prompt.repeat(self.repeats, 1) if self.repeats > 1 else prompt


class PCTPromptEncoder(BasePromptEncoder):
    """PEFT prompt encoder of PCT (registered as the "tuner" of ``PeftType.PCT``).

    Args:
        config: A :class:`prompt_transfer.PCTConfig` (``token_dim``, ``num_transformer_submodules`` filled by PEFT).
        word_embeddings: The base model's input embeddings (unused: PCT's prompt comes from source prompts).
    """

    def __init__(self, config, word_embeddings=None):
        super().__init__()
        if getattr(config, "trainable_token_indices", None) is not None:
            # TRL's SFTTrainer sets it after the config was built, so __post_init__ cannot catch it.
            raise ValueError(
                f"PCTConfig.trainable_token_indices must be None, got {config.trainable_token_indices!r}: PCT trains a "
                "soft prompt, not token embeddings (TRL sets it when chat_template_path adds tokens: keep the "
                "tokenizer's own chat template, or set tokenizer.chat_template instead)"
            )
        self.config = config
        width = getattr(getattr(word_embeddings, "weight", None), "shape", (None, None))[-1]
        if width is not None and config.token_dim is not None and width != config.token_dim:
            # The prompt is concatenated with the input embeddings: a saved adapter of another model would only fail
            # at the first forward, inside torch.cat.
            raise ValueError(
                f"PCTConfig.token_dim={config.token_dim} (the width of this PCT prompt) does not match the model's "
                f"input embeddings (width {width}): a PCT adapter works only on the base model its prompts come from"
            )
        repeats = config.num_transformer_submodules or 1
        self.embedding = PCTFusion(
            config.num_virtual_tokens, config.token_dim, config.num_sources, repeats=repeats,
            temperature=config.attention_temperature, fusion=config.fusion,
            trainable_residual=config.trainable_residual,
        )
        path = config.decomposition_path
        self.embedding.decomposition_path = path
        sibling = _ENCODER_OF_CONFIG.get(id(config))
        if sibling is not None and sibling.config is config and sibling.embedding.loaded:
            # An adapter added with the very config of a live one is a copy of it: TRL's DPO/KTO reference
            # (`ref_model=None` on a PeftModel) is `add_adapter("ref", peft_config["default"])` plus a copy of the
            # *parameters*. P_0 and S_k are buffers, so they were read from the folder again: a decomposition saved
            # there since made the reference silently differ from the policy, and a folder gone (a resumed or loaded
            # adapter) failed at the reference's first forward. Take them from the adapter the config describes.
            self.embedding.set_sources(sibling.embedding.p0, sibling.embedding.specific)
        elif path is not None:
            import os

            # Not for a saved adapter being loaded (inference_mode): its own P_0 and S_k are loaded over the sources,
            # and the folder may since hold another decomposition (see PCTConfig.__post_init__).
            if os.path.isdir(path) and not config.inference_mode:
                dec = load_decomposition(path)
                source_model = dec.settings.get("base_model") or "an unrecorded model"
                target_model = config.base_model_name_or_path or "an unnamed model"
                if dec.p0.shape[1] != config.token_dim:
                    raise ValueError(
                        f"the source prompts in {path} come from {source_model} (token_dim {dec.p0.shape[1]}); the "
                        f"target model {target_model} has token_dim {config.token_dim}: source prompts must come "
                        "from the same base model"
                    )
                src_id, tgt_id = model_id(dec.settings.get("base_model")), model_id(config.base_model_name_or_path)
                if src_id is not None and tgt_id is not None and src_id != tgt_id:
                    raise ValueError(
                        f"the source prompts in {path} come from {source_model}, the target model is {target_model}: "
                        "source prompts must come from the same base model"
                    )
                if dec.num_sources != config.num_sources or dec.p0.shape[0] != config.num_virtual_tokens:
                    raise ValueError(
                        f"decomposition at {path} has K={dec.num_sources}, l={dec.p0.shape[0]}; config says "
                        f"num_sources={config.num_sources}, num_virtual_tokens={config.num_virtual_tokens}"
                    )
                self.embedding.set_sources(dec.p0, dec.specific)
            elif not config.inference_mode:  # (a missing folder, for training: the state must come from a load)
                logger.info("decomposition %s not found; expecting a saved PCT state to be loaded", path)
        self.source_names = list(config.source_names or [f"source_{i}" for i in range(config.num_sources)])
        _ENCODER_OF_CONFIG[id(config)] = self

    def __setstate__(self, state: dict) -> None:
        """``nn.Module``'s, then registers the copy (``copy.deepcopy``, unpickling) for adapters added with its config.

        Args:
            state: The module's ``__dict__``.
        """
        super().__setstate__(state)
        if "config" in self.__dict__:
            _ENCODER_OF_CONFIG[id(self.config)] = self

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Returns the prompt rows selected by ``indices`` (``[batch, n]`` -> ``[batch, n, d]``).

        Args:
            indices: Virtual-token indices, as PEFT passes them.
        """
        return F.embedding(indices, self.embedding.weight)

    def attention_weights(self) -> torch.Tensor:
        """Attention over the sources (detached), ``[K]``."""
        return self.embedding.attention().detach()

    def training_metrics(self) -> dict[str, float]:
        """Scalars a trainer logs each step: ``pct/attn/<source>`` and ``pct/attn_entropy``."""
        attn = [float(w) for w in self.attention_weights()]
        out = {f"pct/attn/{name}": w for name, w in zip(self.source_names, attn)}
        out["pct/attn_entropy"] = -sum(w * math.log(max(w, 1e-12)) for w in attn)
        return out

    def auxiliary_loss(self) -> torch.Tensor:
        """``contrastive_weight *`` InfoNCE keeping the target-specific part away from ``P_0``.

        Anchor: the target-specific part ``T = sum a_k S_k + R``; positive: the attended source mix
        ``sum a_k S_k``; negative: ``P_0``. It keeps the residual from drifting into the task-agnostic direction and
        pushes the attention toward sources whose specific part is least redundant with ``P_0``.

        Anchor and positive start near zero (uniform attention gives ``mean_k S_k``, which the SVD makes 0, and
        ``R = 0``), so vectors are divided by at least a tenth of the sources' task-specific norm, not by their own
        norm alone: the cosine of a near-zero vector has a ``1/|x|`` gradient (3e3 at init against 1e-5 for the
        task, on a decomposition made without refinement), whose first Adam step made the attention one-hot within
        ten steps and stalled the task loss. A part of ordinary size gets the plain cosine.
        """
        fus = self.embedding
        weight = self.config.contrastive_weight
        if weight == 0:
            return fus.p0.new_zeros(())
        mix = torch.einsum("k,kld->ld", fus.attention(), fus.specific)
        anchor = (mix + fus.residual).reshape(1, -1)
        with torch.no_grad():  # P_0 and S_k are frozen: the floor is a constant of the adapter
            scale = fus.specific.flatten(1).norm(dim=1).pow(2).mean().sqrt()
            scale = torch.where(scale > 0, scale, fus.p0.norm())  # K = 1: S_1 = 0
            eps = (0.1 * scale).clamp_min(1e-12)
        return weight * info_nce(anchor, mix.reshape(1, -1), fus.p0.reshape(1, -1),
                                 self.config.contrastive_temperature, eps=eps)

    # ---- PEFT state-dict hooks (BasePromptEncoder) ----

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        """Saves the full PCT state plus the fused prompt (``prompt_embeddings``, informational)."""
        fus = model.prompt_encoder[adapter_name].embedding
        out = {
            "prompt_embeddings": fus.weight.detach(),
            "pct_p0": fus.p0.detach(),
            "pct_specific": fus.specific.detach(),
            "pct_query": fus.query.detach(),
            "pct_key_offsets": fus.key_offsets.detach(),
            "pct_residual": fus.residual.detach(),
        }
        return {k: v.clone() for k, v in out.items()}

    def _load_adapter_state_dict(self, state_dict):
        """Loads the state written by :meth:`_get_adapter_state_dict`."""
        missing = [k for k in STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"not a PCT adapter state: missing {missing} (found {sorted(state_dict)}). A plain prompt-tuning "
                "adapter (e.g. an export) loads with peft.PromptTuningConfig, not PCTConfig"
            )
        fus = self.embedding
        for key in STATE_KEYS:
            target = getattr(fus, key.removeprefix("pct_"))
            value = state_dict[key]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"PCT state {key} has shape {tuple(value.shape)}, the adapter expects "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(value.to(target.device, target.dtype))
        fus.loaded = True
