"""Configuration of a steering-vector adapter (EasyEdit2-style activation steering as a PEFT method)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from peft.config import PeftConfig

from peftplug.validation import check_flag, check_real

OPERATORS = ("add", "ablate", "ablate_then_add")
POSITIONS = ("all", "prompt", "generated", "from_last_prompt")
HOOK_POINTS = ("block_output",)
LAYER_CONVENTIONS = ("block_index",)
#: PEFT task types a steering adapter accepts. PEFT's SEQ_CLS, TOKEN_CLS and QUESTION_ANS models add the task head to
#: ``modules_to_save`` (it would train and be saved with the adapter), which a vectors-only adapter cannot hold.
TASK_TYPES = (None, "CAUSAL_LM", "SEQ_2_SEQ_LM", "FEATURE_EXTRACTION")

# Position policies a gradient-trained vector can use. A training forward is one teacher-forced pass over whole
# texts with no prompt length: every token counts as prompt, so "generated" selects nothing (no gradient reaches the
# vector) and "from_last_prompt" only the last token of the padded width (often padding). "prompt" trains like "all".
TRAINABLE_POSITIONS = ("all", "prompt")


def check_trainable_positions(positions: str, where: str) -> None:
    """Refuses a position policy that a training forward cannot express (see :data:`TRAINABLE_POSITIONS`).

    Args:
        positions: The adapter's ``positions`` policy.
        where: What is being trained, for the message.
    """
    if positions not in TRAINABLE_POSITIONS:
        raise ValueError(
            f"positions={positions!r} ({where}) cannot be trained: training forwards are whole texts without a "
            f"prompt/generation split, so the vector would get no gradient; use positions in {TRAINABLE_POSITIONS} "
            "(the trained vectors can be applied under another policy afterwards: steering_adapter(model, vectors, "
            "positions=...))"
        )



@dataclass
class SteeringConfig(PeftConfig):
    """Configuration of a steering adapter: one vector per decoder block, applied to the block's output.

    With ``h`` the hidden state a decoder block returns, ``v`` its vector and ``m`` the layer's multiplier
    (``multiplier * layer_multipliers.get(layer, 1)``), the operators are

    - ``"add"``: ``h + m v`` (CAA / ActAdd / repeng);
    - ``"ablate"``: ``h - m (h . u) u`` with ``u = v / |v|`` (directional ablation; ``m = 1`` removes the
      direction completely);
    - ``"ablate_then_add"``: ``h - (h . u) u + m v`` (sets the component along ``u`` to ``m |v|``).

    and they act only at the token positions that ``positions`` selects (padding is never steered):
    ``"all"``, ``"prompt"`` (tokens of the prompt), ``"generated"`` (tokens produced by ``generate``), or
    ``"from_last_prompt"`` (the last prompt token and everything generated after it). What counts as the
    prompt is decided from the attention mask and the cache position (never from ``position_ids``), so left
    padding and KV-cache decoding steer the same tokens as one-by-one, cache-free runs.

    Args:
        layers: 0-based indices of the decoder blocks to steer (block ``L``'s output is
            ``output_hidden_states[L + 1]`` in transformers' convention, the same index EasyEdit2 and
            llama.cpp use for block outputs).
        multiplier: Global steering strength ``m`` (any real; 0 leaves the model unchanged for ``"add"``).
        layer_multipliers: Optional per-layer factors multiplied into ``multiplier`` (JSON keys may be strings).
        operator: One of :data:`OPERATORS`.
        positions: One of :data:`POSITIONS`.
        normalize: Scale each vector to unit norm before applying it (then ``m`` is an absolute length).
        method: Provenance: the generator that produced the vectors (``"caa"``, ``"pca_diff"``, ...).
        read_position: Provenance: where activations were read during extraction (``"answer"``, ``"last"``...).
        num_pairs: Provenance: number of contrastive pairs the vectors were extracted from.
        hidden_size: Hidden size the vectors belong to; filled in from the model when ``None``. Applying the
            adapter to a model of another hidden size raises a ``ValueError``.
        model_type: Provenance: ``config.model_type`` of the model the vectors come from (filled in).
        hook_point: Where the vector acts; only ``"block_output"`` (decoder-block output / residual stream).
        layer_convention: How ``layers`` index the model; only ``"block_index"`` (0-based decoder block).
        blocks_path: Dotted path of the ``nn.ModuleList`` of decoder blocks, when the family registry
            (``steering.families``) does not know the model.
        target_modules: Filled in automatically from ``layers`` (the full names of the steered blocks).
        modules_to_save: Must stay ``None``: a steering adapter holds vectors only. The field exists because TRL's
            ``SFTTrainer`` reads and extends it (with ``trainable_token_indices``) when its ``chat_template_path``
            adds tokens; creating the adapter then refuses with a one-line reason.
        trainable_token_indices: Must stay ``None`` (see ``modules_to_save``).
        task_type: One of :data:`TASK_TYPES`. To steer a classifier (``XForSequenceClassification``), leave it
            ``None``: PEFT's ``SEQ_CLS``/``TOKEN_CLS``/``QUESTION_ANS`` models would train the head as well.
    """

    layers: list[int] | None = field(default=None, metadata={"help": "0-based decoder blocks to steer."})
    multiplier: float = field(default=1.0, metadata={"help": "Global steering strength."})
    layer_multipliers: dict | None = field(default=None, metadata={"help": "Per-layer factors."})
    operator: str = field(default="add", metadata={"help": f"One of {OPERATORS}."})
    positions: str = field(default="all", metadata={"help": f"One of {POSITIONS}."})
    normalize: bool = field(default=False, metadata={"help": "Unit-normalise vectors before scaling."})
    method: str = field(default="manual", metadata={"help": "Generator that produced the vectors."})
    read_position: str | None = field(default=None, metadata={"help": "Where activations were read."})
    num_pairs: int | None = field(default=None, metadata={"help": "Number of contrastive pairs used."})
    hidden_size: int | None = field(default=None, metadata={"help": "Hidden size of the vectors."})
    model_type: str | None = field(default=None, metadata={"help": "model_type of the source model."})
    hook_point: str = field(default="block_output", metadata={"help": f"One of {HOOK_POINTS}."})
    layer_convention: str = field(default="block_index", metadata={"help": f"One of {LAYER_CONVENTIONS}."})
    blocks_path: str | None = field(default=None, metadata={"help": "Dotted path of the block ModuleList."})
    target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Filled in from `layers`; do not set by hand."}
    )
    modules_to_save: list[str] | None = field(default=None, metadata={"help": "Must stay None (vectors only)."})
    trainable_token_indices: list[int] | dict | None = field(
        default=None, metadata={"help": "Must stay None (vectors only)."}
    )

    def __post_init__(self):
        super().__post_init__()
        from peft.utils import PeftType

        self.peft_type = PeftType("STEERING")
        if self.layers is None or isinstance(self.layers, (str, bytes)):
            raise ValueError("SteeringConfig.layers must be a non-empty list of 0-based decoder block indices")
        layers = [self.layers] if isinstance(self.layers, int) else list(self.layers)
        if not layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
            raise ValueError(f"SteeringConfig.layers must be non-negative ints (at least one), got {self.layers!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"SteeringConfig.layers has duplicates: {layers}")
        self.layers = sorted(layers)
        self.multiplier = check_real("SteeringConfig.multiplier", self.multiplier)
        if self.layer_multipliers is not None:
            if not isinstance(self.layer_multipliers, Mapping):
                raise ValueError(
                    "SteeringConfig.layer_multipliers must be a dict {layer index: finite factor}, got "
                    f"{self.layer_multipliers!r}"
                )
            normalised = {}
            for key, value in self.layer_multipliers.items():
                try:
                    layer = int(key)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"SteeringConfig.layer_multipliers keys must be layer indices, got {key!r}"
                    ) from None
                if layer not in self.layers:
                    raise ValueError(
                        f"SteeringConfig.layer_multipliers has layer {layer}, which is not in layers {self.layers}"
                    )
                normalised[layer] = check_real(f"SteeringConfig.layer_multipliers[{layer}]", value)
            self.layer_multipliers = normalised
        for name, value, accepted in (
            ("operator", self.operator, OPERATORS),
            ("positions", self.positions, POSITIONS),
            ("hook_point", self.hook_point, HOOK_POINTS),
            ("layer_convention", self.layer_convention, LAYER_CONVENTIONS),
        ):
            if value not in accepted:
                raise ValueError(f"SteeringConfig.{name} must be one of {accepted}, got {value!r}")
        # A string such as "false" is truthy: it used to normalise silently.
        check_flag("SteeringConfig.normalize", self.normalize)
        if self.hidden_size is not None and (
            not isinstance(self.hidden_size, int) or isinstance(self.hidden_size, bool) or self.hidden_size <= 0
        ):
            raise ValueError(f"SteeringConfig.hidden_size must be a positive int, got {self.hidden_size!r}")
        self.check_vectors_only()

    def check_vectors_only(self) -> None:
        """Raises ``ValueError`` if ``modules_to_save`` or ``trainable_token_indices`` is set (also when a trainer
        set it after construction, as TRL's ``SFTTrainer`` does for tokens its chat template added), or if
        ``task_type`` is not one of :data:`TASK_TYPES` (also checked again when the adapter is created, as a trainer
        may fill ``task_type`` in after construction)."""
        task = getattr(self.task_type, "value", self.task_type)
        if task not in TASK_TYPES:
            # Before the modules_to_save check: PEFT's SEQ_CLS model fills that in first, and the message about it
            # (TRL) would not name the real cause. TOKEN_CLS / QUESTION_ANS fill it in only after the adapter is
            # created, so without this they trained the head and saved an adapter that this class refuses to load.
            raise ValueError(
                f"SteeringConfig.task_type must be one of {TASK_TYPES}, got {task!r}: PEFT's {task} model trains "
                "the task head with the adapter, and a steering adapter holds vectors only (to steer a classifier with "
                "PEFT, leave task_type None; a peftplug task seq_cls trains a new head: use an adapter that saves it, "
                "e.g. LoRA or OFTv2)"
            )
        for name in ("trainable_token_indices", "modules_to_save"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"SteeringConfig.{name} must be None, got {getattr(self, name)!r}: a steering adapter trains "
                    "only its vectors, not token embeddings or whole modules (TRL sets both when chat_template_path "
                    "adds tokens: keep the tokenizer's own chat template, or set tokenizer.chat_template instead)"
                )

    def layer_multiplier(self, layer: int) -> float:
        """Effective multiplier of ``layer`` (global times per-layer factor).

        Args:
            layer: A block index from :attr:`layers`.
        """
        factor = (self.layer_multipliers or {}).get(layer, 1.0)
        return self.multiplier * factor

    def to_dict(self):
        """JSON-ready dict (per-layer multiplier keys become strings, as JSON requires)."""
        out = super().to_dict()
        if out.get("layer_multipliers") is not None:
            out["layer_multipliers"] = {str(k): v for k, v in out["layer_multipliers"].items()}
        return out
