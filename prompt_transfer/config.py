"""Configuration of PCT (prompt contrastive transformation) target prompts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from peft.config import PromptLearningConfig

from peftplug.validation import check_flag, check_int, check_real, python_number

FUSIONS = ("attention", "mean")


@dataclass
class PCTConfig(PromptLearningConfig):
    """Configuration of a PCT target prompt: ``P_t = P_0 + sum_k a_k S_k (+ R)``.

    ``P_0`` (task-agnostic) and ``S_k`` (task-specific, one per source task) come from a decomposition written by
    :func:`prompt_transfer.decompose.save_decomposition`; they stay frozen. Only the attention query, the key
    offsets and (optionally) the residual ``R`` train.

    Args:
        decomposition_path: Directory written by ``save_decomposition``. Needed to create a new adapter; a saved
            PCT adapter carries ``P_0``/``S_k`` in its own state, so loading it works without the directory.
        num_sources: Number of source tasks ``K``. Read from the decomposition when ``None``.
        source_names: Names of the source tasks (for logging the attention). Read from the decomposition.
        attention_temperature: Softmax temperature ``tau`` of ``a = softmax(q . key_k / (tau * sqrt(d)))``; keys
            are unit vectors, so ``tau`` sets how fast the query can sharpen the attention. Must be > 0.
        fusion: ``"attention"`` (learned softmax over sources) or ``"mean"`` (uniform ``1/K`` weights: the
            "without attention" ablation; only the residual trains).
        trainable_residual: Whether a residual prompt ``R`` (zero at init) trains next to the attention.
        contrastive_weight: Weight of the auxiliary InfoNCE loss that keeps the target's task-specific part away
            from ``P_0`` (0 disables it: the "without contrastive" ablation). Must be >= 0.
        contrastive_temperature: Temperature of that InfoNCE loss. Must be > 0.
        target_task: Name of the target task (optional). A target that is also one of the source tasks is refused
            (its test set would have shaped a source prompt: leakage); names compare case- and punctuation-blind
            (``SST-2`` = ``sst2``).
        trainable_token_indices: Must stay ``None``. The field exists because TRL's ``SFTTrainer`` reads and sets
            it when its ``chat_template_path`` adds tokens; creating the adapter then refuses with a one-line reason
            (the exported plain prompt-tuning adapter could not carry trained token rows).
    """

    decomposition_path: str | None = field(default=None, metadata={"help": "Directory of the decomposition"})
    num_sources: int | None = field(default=None, metadata={"help": "Number of source tasks K"})
    source_names: list | None = field(default=None, metadata={"help": "Names of the K source tasks"})
    attention_temperature: float = field(default=0.1, metadata={"help": "Softmax temperature of the attention"})
    fusion: str = field(default="attention", metadata={"help": "attention | mean"})
    trainable_residual: bool = field(default=True, metadata={"help": "Train a residual prompt R"})
    contrastive_weight: float = field(default=0.01, metadata={"help": "Weight of the auxiliary InfoNCE loss"})
    contrastive_temperature: float = field(default=0.5, metadata={"help": "Temperature of the InfoNCE loss"})
    target_task: str | None = field(default=None, metadata={"help": "Target task; refused if it is a source"})
    trainable_token_indices: list | dict | None = field(
        default=None, metadata={"help": "Must stay None: PCT trains no token embeddings"}
    )

    def __post_init__(self):
        super().__post_init__()
        from peft.utils import PeftType

        # The member exists once prompt_transfer is imported (the package registers it before using this class).
        self.peft_type = PeftType["PCT"]
        check_real("attention_temperature", self.attention_temperature, low=0.0, low_open=True)
        check_real("contrastive_temperature", self.contrastive_temperature, low=0.0, low_open=True)
        check_real("contrastive_weight", self.contrastive_weight, low=0.0)
        # A tensor or numpy value passes the checks; to_dict writes the config to JSON, which wants plain numbers.
        self.attention_temperature, self.contrastive_temperature, self.contrastive_weight = (
            python_number(v) for v in (self.attention_temperature, self.contrastive_temperature,
                                       self.contrastive_weight))
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        # A string such as "false" is truthy: it used to train the residual silently.
        check_flag("trainable_residual", self.trainable_residual)
        if self.fusion == "mean" and not self.trainable_residual:
            raise ValueError("fusion='mean' with trainable_residual=False leaves nothing to train; "
                             "set trainable_residual=True or fusion='attention'")
        # Types first: a float or NaN here was reported as a mismatch with the decomposition (`num_sources=inf does
        # not match ... (K=2)`), or reached torch.empty as a TypeError.
        for name in ("num_sources", "num_virtual_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, python_number(check_int(name, getattr(self, name), low=1)))
        # A saved adapter (inference_mode, as PEFT saves and loads it) holds P_0 and S_k itself: the folder at its
        # decomposition_path may since hold another decomposition, which must not stop it from loading.
        meta = None if self.inference_mode and self.num_sources is not None else self._read_decomposition_meta()
        if meta is not None:
            self._check_against(meta)
        elif self.num_sources is None:
            raise ValueError(
                "PCTConfig needs decomposition_path (a directory written by prompt_transfer.save_decomposition) "
                f"or num_sources; got decomposition_path={self.decomposition_path!r} (missing or unreadable)"
            )
        if self.num_sources is not None:
            check_int("num_sources", self.num_sources, low=1)
            self.num_sources = python_number(self.num_sources)
        # A string would pass the length check below as one name per character ("abc": three sources).
        if self.source_names is not None and (
            isinstance(self.source_names, str)
            or not isinstance(self.source_names, (list, tuple))
            or not all(isinstance(n, str) and n for n in self.source_names)
        ):
            raise ValueError(f"source_names must be a list of non-empty task names, got {self.source_names!r}")
        if self.source_names is not None and not self.source_names:
            raise ValueError("source_names is empty: PCT needs at least one source prompt")
        if self.source_names is not None and len(self.source_names) != self.num_sources:
            raise ValueError(f"source_names has {len(self.source_names)} names for num_sources={self.num_sources}")
        if self.target_task is not None and self.source_names:
            from prompt_transfer.decompose import task_key

            clash = [n for n in self.source_names if task_key(n) == task_key(self.target_task)]
            if clash:
                raise ValueError(f"target_task {self.target_task!r} is also a source task ({clash[0]!r} in "
                                 f"source_names {list(self.source_names)}): the target must be held out from the "
                                 "sources (leakage)")
        if self.num_virtual_tokens is None or self.num_virtual_tokens < 1:
            raise ValueError(f"num_virtual_tokens must be >= 1, got {self.num_virtual_tokens!r}")

    def _read_decomposition_meta(self) -> dict | None:
        if self.decomposition_path is None:
            return None
        meta_file = os.path.join(self.decomposition_path, "decomposition.json")
        if not os.path.isfile(meta_file):
            if os.path.isdir(self.decomposition_path) and not self.inference_mode:
                # A new adapter reads the sources from that folder when it is built: another folder (the sources'
                # run folder, its parent) was a FileNotFoundError traceback there.
                raise ValueError(
                    f"decomposition_path {self.decomposition_path!r} is a folder without decomposition.json: not a "
                    "PCT decomposition (give the folder that `peftplug pct decompose --out` or the source stage wrote)"
                )
            # Loading a saved adapter whose decomposition directory is gone is fine: the adapter holds the tensors.
            return None
        with open(meta_file) as f:
            return json.load(f)

    def _check_against(self, meta: dict) -> None:
        length, dim, k = meta["num_virtual_tokens"], meta["token_dim"], meta["num_sources"]
        if self.num_virtual_tokens is None:
            self.num_virtual_tokens = length
        elif self.num_virtual_tokens != length:
            raise ValueError(
                f"num_virtual_tokens={self.num_virtual_tokens} does not match the decomposition at "
                f"{self.decomposition_path} (prompts of {length} tokens)"
            )
        if self.token_dim is not None and self.token_dim != dim:
            raise ValueError(
                f"token_dim={self.token_dim} does not match the decomposition at {self.decomposition_path} "
                f"(token_dim {dim}): the source prompts come from a model with another hidden size"
            )
        if self.source_names is None:
            self.source_names = list(meta["source_names"])
        if self.num_sources is None:
            self.num_sources = k
        elif self.num_sources != k:
            raise ValueError(f"num_sources={self.num_sources} does not match the decomposition (K={k})")
