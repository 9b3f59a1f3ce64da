"""Configuration of the OFTv2 adapter (input-centric orthogonal finetuning, Cayley–Neumann parameterisation)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

from peft.config import PeftConfig

# Orthogonalisation forms (the names peftplug_kernels.ops.cayley_neumann accepts).
ORTHOGONALIZATIONS = ("cayley_neumann", "cayley", "peft_cn")
# Forms built from a truncated Neumann series: they converge only for ||Q||_2 < 1.
NEUMANN_FORMS = ("cayley_neumann", "peft_cn")
BIAS_CHOICES = ("none", "all", "oftv2_only")
KERNEL_IMPLS = ("auto", "torch", "triton")
CONV_EVALUATIONS = ("auto", "weight", "input")
MAX_NEUMANN_TERMS = 64
DEFAULT_BLOCK_SIZE = 32


@dataclass
class OFTv2Config(PeftConfig):
    """Configuration of an OFTv2 adapter.

    Each targeted layer gets a block-diagonal orthogonal matrix ``R`` (``in × in``, blocks of size ``b``) and
    computes ``y = base_layer(x R)``; ``R`` is never multiplied into the weight during training.

    Args:
        block_size: Size ``b`` of each rotation block. Give exactly one of ``block_size`` and ``r``; when both
            are ``None`` the block size is 32. Every targeted layer's input width must be a multiple of it:
            otherwise adapter creation raises a ``ValueError`` listing the valid block sizes of that layer.
        r: Number of blocks per layer (``block_size = in_features / r``, so it can differ between layers).
        orthogonalization: How ``R`` is computed from the skew-symmetric ``Q``: ``"cayley_neumann"`` (default;
            the Taylor series of the exact Cayley map truncated after ``neumann_terms - 1`` powers, error
            O(||Q||^neumann_terms)), ``"cayley"`` (exact ``(I + Q)(I - Q)^-1`` via a linear solve) or
            ``"peft_cn"`` (PEFT's product form, identical to ``peft.OFTConfig(use_cayley_neumann=True)`` with
            ``num_cayley_neumann_terms = neumann_terms``; use it for parity with PEFT adapters).
        neumann_terms: Series length ``n`` of the Neumann forms (highest power ``n - 1``), 2..64.
        block_share: Share one block (and its parameters) across all blocks of a layer.
        module_dropout: OFT block dropout: in training mode each rotation block is replaced by the identity with
            this probability (independently per block and step). In ``[0, 1)``. Each layer holds it as an
            ``nn.Dropout`` (as LoRA's ``lora_dropout``), so TRL's ``disable_dropout`` switches it off.
        max_q_norm: Optional bound on the Frobenius norm of each skew block ``Q_i``: blocks whose norm exceeds it
            are rescaled onto the bound in the forward pass (differentiably). Since ``||Q||_2 <= ||Q||_F``, a bound
            below 1 keeps the Neumann series convergent. ``None`` disables it.
        init_weights: ``True`` initialises ``Q = 0`` (``R = I``: the adapted model equals the base model);
            ``False`` draws ``Q`` entries from N(0, 0.1^2) (for tests and debugging only).
        kernel_impl: ``"auto"`` (Triton on CUDA when available, else pure torch), ``"torch"`` or ``"triton"``.
        conv_evaluation: How ``nn.Conv2d`` layers apply ``R`` (all compute the same function): ``"weight"``
            (convolve with ``W Rᵀ``, rebuilt each step: cost ∝ out · in·k² · b), ``"input"`` (rotate the
            unfolded input patches, then one matmul with the frozen weight: cost ∝ pixels · in·k² · b, no weight
            gradient) or ``"auto"`` (default: per layer and call, ``"input"`` when the output has fewer pixels
            ``batch · H_out · W_out`` times groups than the layer has output channels, else ``"weight"``, the
            crossover measured on CPU; see docs/oftv2.md).
        stack_rotations: Compute the rotation blocks of every adapted layer as one batch per model forward
            (``oftv2.stack_rotations``; a layer then only rotates its input: 2 kernel calls forward and 3
            backward where it computed its own series and rotation in 6 and 8). Same results; off under
            gradient checkpointing and FSDP2 (see docs/oftv2.md). Model-wide: on when any loaded adapter's
            config sets it.
        target_modules: Module names (list: exact or suffix match; str: regex) or ``"all-linear"``.
        exclude_modules: Module names (same matching rules) never to adapt.
        layers_to_transform: Layer indices to adapt (int or list of non-negative ints).
        layers_pattern: Name of the ``nn.ModuleList`` holding the layers (needs ``layers_to_transform``).
        modules_to_save: Extra modules trained fully and saved with the adapter (e.g. a classifier head).
        trainable_token_indices: Token ids whose embedding rows train (PEFT's trainable tokens, as in
            ``LoraConfig``): a list of ids for the input embedding, or ``{embedding module name: [ids]}``. TRL's
            ``SFTTrainer`` fills it in (with ``modules_to_save=["lm_head"]``) when its ``chat_template_path``
            adds tokens to the tokenizer. Give the layer either here or in ``modules_to_save``, not both.
        bias: ``"none"``, ``"all"`` or ``"oftv2_only"``: which biases are trained.
        fan_in_fan_out: Whether the targeted weights are stored ``in × out`` (GPT-2 ``Conv1D``); set
            automatically for ``Conv1D`` layers.
    """

    block_size: int | None = field(default=None, metadata={"help": "Rotation block size b (or give r)."})
    r: int | None = field(
        default=None, metadata={"help": "Number of rotation blocks per layer (or give block_size)."}
    )
    orthogonalization: Literal["cayley_neumann", "cayley", "peft_cn"] = field(
        default="cayley_neumann", metadata={"help": f"One of {ORTHOGONALIZATIONS}."}
    )
    neumann_terms: int = field(default=5, metadata={"help": "Neumann series length (highest power n-1)."})
    block_share: bool = field(default=False, metadata={"help": "Share one rotation block across the width."})
    module_dropout: float = field(default=0.0, metadata={"help": "Probability of replacing a block by I."})
    max_q_norm: float | None = field(
        default=None, metadata={"help": "Rescale Q blocks whose Frobenius norm exceeds this bound."}
    )
    init_weights: bool = field(default=True, metadata={"help": "Q = 0 at init (identity rotation)."})
    kernel_impl: Literal["auto", "torch", "triton"] = field(
        default="auto", metadata={"help": "Kernel choice."}
    )
    conv_evaluation: Literal["auto", "weight", "input"] = field(
        default="auto", metadata={"help": f"Conv2d evaluation, one of {CONV_EVALUATIONS}."}
    )
    stack_rotations: bool = field(
        default=False, metadata={"help": "One batched rotation series per model forward (fewer kernel calls)."}
    )
    target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or regex to adapt, or 'all-linear'."}
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or regex not to adapt."}
    )
    layers_to_transform: list[int] | int | None = field(
        default=None, metadata={"help": "Layer indices to adapt."}
    )
    layers_pattern: list[str] | str | None = field(
        default=None, metadata={"help": "Name of the layer ModuleList (with layers_to_transform)."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Extra modules to train and save (e.g. the classifier)."}
    )
    trainable_token_indices: list[int] | dict[str, list[int]] | None = field(
        default=None, metadata={"help": "Token ids whose embedding rows train (PEFT trainable tokens)."}
    )
    bias: Literal["none", "all", "oftv2_only"] = field(
        default="none", metadata={"help": f"One of {BIAS_CHOICES}."}
    )
    fan_in_fan_out: bool = field(default=False, metadata={"help": "Weights stored in x out (GPT-2 Conv1D)."})

    def __post_init__(self):
        super().__post_init__()
        # Imported here: the registry adds the OFTV2 member to PeftType at `import oftv2`.
        from peft.utils import PeftType

        self.peft_type = PeftType.OFTV2
        self._validate()
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)

    def _validate(self) -> None:
        """Checks every field; raises ``ValueError`` naming the field and the accepted values."""
        if self.block_size is not None and self.r is not None:
            raise ValueError(
                f"give exactly one of `block_size` ({self.block_size}) and `r` ({self.r}): "
                "r x block_size = in_features, so one determines the other"
            )
        if self.block_size is None and self.r is None:
            self.block_size = DEFAULT_BLOCK_SIZE
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 2):
            raise ValueError(f"`block_size` must be an integer >= 2, got {self.block_size!r}")
        if self.r is not None and (not _is_int(self.r) or self.r < 1):
            raise ValueError(f"`r` (number of blocks) must be an integer >= 1, got {self.r!r}")
        if self.orthogonalization not in ORTHOGONALIZATIONS:
            raise ValueError(
                f"`orthogonalization` must be one of {ORTHOGONALIZATIONS}, got {self.orthogonalization!r}"
            )
        if not _is_int(self.neumann_terms) or not 2 <= self.neumann_terms <= MAX_NEUMANN_TERMS:
            raise ValueError(
                f"`neumann_terms` must be an integer in [2, {MAX_NEUMANN_TERMS}] (with 1 term R = I), "
                f"got {self.neumann_terms!r}"
            )
        for name in ("block_share", "init_weights", "fan_in_fan_out", "stack_rotations"):
            if not isinstance(getattr(self, name), bool):
                # ValueError for every bad config value (the house rule), wrong type included.
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")  # noqa: TRY004
        p = self.module_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"`module_dropout` must be a float in [0, 1), got {p!r}")
        if self.max_q_norm is not None:
            bound = self.max_q_norm
            if (
                isinstance(bound, bool)
                or not isinstance(bound, (int, float))
                or not math.isfinite(bound)
                or bound <= 0
            ):
                raise ValueError(f"`max_q_norm` must be None or a finite float > 0, got {bound!r}")
            if bound >= 1.0 and self.orthogonalization in NEUMANN_FORMS:
                warnings.warn(
                    f"max_q_norm={bound} >= 1 does not guarantee that the Neumann series of "
                    f"orthogonalization={self.orthogonalization!r} converges (that needs ||Q||_2 < 1)",
                    stacklevel=3,
                )
        if self.kernel_impl not in KERNEL_IMPLS:
            raise ValueError(f"`kernel_impl` must be one of {KERNEL_IMPLS}, got {self.kernel_impl!r}")
        if self.kernel_impl == "triton" and self.orthogonalization == "cayley":
            raise ValueError(
                "`kernel_impl`='triton' needs a Neumann orthogonalization: the exact 'cayley' form uses a linear "
                "solve and has no Triton kernel (use kernel_impl='auto')"
            )
        if self.conv_evaluation not in CONV_EVALUATIONS:
            raise ValueError(
                f"`conv_evaluation` must be one of {CONV_EVALUATIONS}, got {self.conv_evaluation!r}"
            )
        if self.bias not in BIAS_CHOICES:
            raise ValueError(f"`bias` must be one of {BIAS_CHOICES}, got {self.bias!r}")
        _check_names("target_modules", self.target_modules, allow_none=True)
        _check_names("exclude_modules", self.exclude_modules, allow_none=True)
        _check_names("layers_pattern", self.layers_pattern, allow_none=True)
        if self.modules_to_save is not None and (
            isinstance(self.modules_to_save, str)
            or not all(isinstance(n, str) and n for n in self.modules_to_save)
        ):
            raise ValueError(
                f"`modules_to_save` must be None or a list of module names, got {self.modules_to_save!r}"
            )
        _check_token_indices(self.trainable_token_indices)
        layers = self.layers_to_transform
        if layers is not None:
            items = [layers] if not isinstance(layers, (list, tuple)) else list(layers)
            if not items or not all(_is_int(i) and i >= 0 for i in items):
                raise ValueError(
                    f"`layers_to_transform` must be None, a non-negative int or a non-empty list of them, got {layers!r}"
                )
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError("`layers_pattern` is only used with `layers_to_transform`; give both or neither")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_indices(value) -> None:
    """``trainable_token_indices``: None, a list of token ids >= 0, or ``{module name: [ids]}``."""
    if value is None:
        return
    lists = list(value.values()) if isinstance(value, dict) else [value]
    names_ok = not isinstance(value, dict) or all(isinstance(k, str) and k for k in value)
    if names_ok and all(
        isinstance(ids, (list, tuple)) and all(_is_int(i) and i >= 0 for i in ids) for ids in lists
    ):
        return
    raise ValueError(
        "`trainable_token_indices` must be None, a list of token ids >= 0, or a dict {embedding module name: "
        f"[token ids >= 0]}}, got {value!r}"
    )


def _check_names(field_name: str, value, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, str):
        if not value:
            raise ValueError(f"`{field_name}` must not be an empty string")
        return
    if isinstance(value, (list, set, tuple)) and all(isinstance(n, str) and n for n in value):
        return
    raise ValueError(
        f"`{field_name}` must be None, a string (regex) or a list of module names, got {value!r}"
    )
