"""The tokenized LightningDataModule every peftplug data module builds on, and batch padding.

A data module reads its splits in ``setup`` into :attr:`TokenizedDataModule.splits` (lists of tokenized example
dicts); the base class finds the tokenizer (its own ``tokenizer`` setting, else the one of the trainer's
:class:`peftplug.lightning.PeftModule`, so a recipe names the model once), and builds the loaders.

Evaluation under DDP/FSDP2: Lightning's own ``DistributedSampler`` would pad the evaluation set to a multiple of the
number of ranks by repeating examples, and those repeats would be counted in ``val_loss``/``val_acc``. The evaluation
loaders therefore shard the data themselves (:class:`RankPaddedRows`): the padding rows are copies whose loss and
answers are masked (:meth:`TokenizedDataModule.padding_row`), so that they count for nothing, while every rank still
runs the same number of batches (FSDP2's forward communicates). Lightning keeps a loader whose sampler is already a
``DistributedSampler``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from peftplug.data.resumable import EpochShuffleSampler, ResumableDataLoader
from peftplug.errors import ConfigError, DataError
from peftplug.model_checks import (
    decoder_position_table,
    decoder_virtual_tokens,
    position_table,
    virtual_tokens,
)
from peftplug.pad_token import ensure_pad_token


def pad_batch(features: list[dict[str, list[int]]], pad_id: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Pads a list of tokenized examples into tensors (labels with -100, attention mask with 0).

    Args:
        features: Dicts of int lists (``input_ids``, ``attention_mask``, optional ``labels``, ...) or int labels.
        pad_id: Pad token id.
        left: Pad on the left (prompts for generation) instead of the right.
    """
    batch: dict[str, torch.Tensor] = {}
    for key in features[0]:
        values = [f[key] for f in features]
        if not isinstance(values[0], list):
            batch[key] = torch.tensor(values)
            continue
        width = max(len(v) for v in values)
        fill = -100 if key == "labels" else (0 if key in ("attention_mask", "token_type_ids") else pad_id)
        rows = [([fill] * (width - len(v)) + v) if left else (v + [fill] * (width - len(v))) for v in values]
        batch[key] = torch.tensor(rows, dtype=torch.long)
    return batch


def mask_labels(example: dict) -> dict:
    """A copy of a tokenized example that carries no loss: token ``labels`` all -100, a class label -100.

    Args:
        example: An example dict; other fields are kept, so the copy has the shape of the original.
    """
    labels = example.get("labels")
    return {**example, "labels": [-100] * len(labels) if isinstance(labels, list) else -100}


class RankPaddedRows(Dataset):
    """Evaluation rows padded to a multiple of ``ranks`` with masked copies of the first rows.

    Args:
        rows: The split's example dicts.
        ranks: Number of data-parallel ranks.
        masked: Turns an example into its padding copy (one that contributes to no metric).
    """

    def __init__(self, rows: list[dict], ranks: int, masked: Any) -> None:
        self.rows, self.masked = rows, masked
        self.size = -(-len(rows) // ranks) * ranks

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if index < len(self.rows):
            return self.rows[index]
        return self.masked(self.rows[index % len(self.rows)])


class TokenizedDataModule(L.LightningDataModule):
    """A LightningDataModule of tokenized examples: the base of every peftplug data module, and of yours.

    A subclass reads and tokenizes its data in ``setup`` into :attr:`splits` (``{"train": [...], "validation":
    [...], "test": [...]}``, each a list of example dicts of int lists such as ``input_ids``, ``attention_mask``,
    ``labels``), calling :meth:`resolve_tokenizer` for the tokenizer; it may override :meth:`collate` (right
    padding by default). The loaders are built here: training batches in an order seeded by ``seed`` and the
    epoch, from a loader that resumes mid-epoch (:mod:`peftplug.data.resumable`); evaluation batches in order,
    sharded over the ranks under DDP/FSDP2 with masked padding rows (:meth:`padding_row`), so that metrics count
    every example exactly once.

    Args:
        tokenizer: Tokenizer name/path; ``None`` borrows the tokenizer of the trainer's ``PeftModule``.
        max_length: Maximum tokens per example (>= 1).
        batch_size: Training batch size (>= 1).
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers (>= 0).
        seed: Seed of the training shuffle (and of subclasses' splits).

    Raises:
        ConfigError: If a size is out of range (the message names the ``data.`` field).
    """

    #: How the module turns a prompt into tokens, recorded in ``peftplug fit`` checkpoints so that ``peftplug
    #: generate`` prompts the trained model the same way: ``"plain"`` (the tokenizer on the text), ``"chat"`` (the
    #: chat template), ``None`` (not text prompts, or not said).
    prompt_format: str | None = None

    def __init__(self, tokenizer: str | None, max_length: int, batch_size: int, eval_batch_size: int | None,
                 num_workers: int, seed: int) -> None:
        super().__init__()
        for name, value in (("max_length", max_length), ("batch_size", batch_size)):
            if value < 1:
                raise ConfigError(f"data.{name} must be >= 1; got {value}")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ConfigError(f"data.eval_batch_size must be >= 1 (or null for batch_size); got {eval_batch_size}")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0; got {num_workers}")
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Any = None
        self.splits: dict[str, list[dict]] = {}

    def _module(self) -> Any:
        trainer = getattr(self, "trainer", None)
        return None if trainer is None else trainer.lightning_module

    def check_model_task(self, served: str, instead: str) -> None:
        """Refuses a trainer's module of another task than the one these rows are for (no module: nothing to check).

        Classification rows under a causal LM stopped with a batch-size ``ValueError`` from the loss; prompt rows
        under a ``seq_cls`` model trained its head on the template text, ignoring the label words, silently.

        Args:
            served: The ``model.task`` the rows are made for.
            instead: What to use for the other tasks, for the message.

        Raises:
            ConfigError: If the module's ``task`` is another.
        """
        task = getattr(self._module(), "task", None)
        if task is not None and task != served:
            raise ConfigError(f"{type(self).__name__} serves model.task {served!r}, but model.task is {task!r}: set "
                              f"model.task: {served}, or {instead}")

    def resolve_tokenizer(self) -> Any:
        """The tokenizer: loaded from the ``tokenizer`` setting, else borrowed from the trainer's module (once).

        Raises:
            ConfigError: If neither is available, or the tokenizer has no token to pad with
                (:func:`peftplug.pad_token.ensure_pad_token`).
        """
        if self.tokenizer is not None:  # given as an object in Python: the same pad fallback as a loaded one
            return ensure_pad_token(self.tokenizer, "data.tokenizer")
        if self.tokenizer_name is not None:
            from peftplug.loading import load_tokenizer

            self.tokenizer = load_tokenizer(self.tokenizer_name)
            model = getattr(self._module(), "model", None)
            if isinstance(model, torch.nn.Module):  # ids past the model's embeddings would fail at the first batch
                from peftplug.model_checks import check_tokenizer_fits

                check_tokenizer_fits(model, self.tokenizer, "data.tokenizer")
        elif getattr(self._module(), "tokenizer", None) is not None:
            # The module's: loaded by name (already checked), or assigned in Python (``module.tokenizer = tok``).
            self.tokenizer = ensure_pad_token(self._module().tokenizer, "model.tokenizer")
        else:
            raise ConfigError("data.tokenizer is not set and the model has no tokenizer to borrow")
        return self.tokenizer

    def loader(self, split: str, shuffle: bool, collate: Any = None) -> DataLoader:
        """A DataLoader over one prepared split (after ``setup``).

        Args:
            split: ``train``, ``validation`` or ``test``.
            shuffle: Shuffle (seeded, training batch size) or not (evaluation batch size; under DDP/FSDP2 sharded
                over the ranks with :meth:`padding_row` copies filling the last batches).
            collate: Collate function (default: :meth:`collate`).

        Raises:
            DataError: If the split is not configured.
        """
        if split not in self.splits:
            raise DataError(f"no {split} data configured")
        self._check_positions(split)
        if not shuffle:
            rows, ranks = self.splits[split], self._eval_ranks()
            # Sharded here, not by Lightning, whose padding repeats would be counted (see the module docstring).
            sampler = None if ranks is None else DistributedSampler(
                RankPaddedRows(rows, ranks["num_replicas"], self.padding_row), ranks["num_replicas"], ranks["rank"],
                shuffle=False)
            return DataLoader(rows if sampler is None else sampler.dataset, batch_size=self.eval_batch_size,
                              sampler=sampler, num_workers=self.num_workers, collate_fn=collate or self.collate)
        # Training order: seeded per epoch, and the position is saved in checkpoints (peftplug.data.resumable).
        # The loader's own generator only seeds its workers, so that the global RNG (dropout) is never drawn from.
        return ResumableDataLoader(
            self.splits[split], batch_size=self.batch_size, sampler=EpochShuffleSampler(self.splits[split], self.seed),
            num_workers=self.num_workers, collate_fn=collate or self.collate,
            generator=torch.Generator().manual_seed(self.seed), epoch_batches=self._epoch_batches,
        )

    def _check_positions(self, split: str) -> None:
        """Refuses rows longer than the model's learned position table (BERT's and MiniLM's 512, GPT-2's 1024), which
        stopped the first long batch with torch's ``IndexError: index out of range in self`` from the embedding.

        Args:
            split: The split about to be loaded.
        """
        model = getattr(self._module(), "model", None)
        if not isinstance(model, torch.nn.Module) or not self.splits[split]:
            return
        # An encoder-decoder's targets (BART's) run on its decoder's table: long answers to short prompts stopped
        # the first such batch with the same IndexError. A prefix (prefix tuning) is the decoder's, not the encoder's.
        decoder, prefix = decoder_position_table(model), decoder_virtual_tokens(model)
        checks = [(position_table(model), "input_ids", "rows", virtual_tokens(model) - prefix)]
        if decoder is not None:
            checks.append((decoder, "labels", "targets", prefix))
        for table, key, kind, virtual in checks:
            if table is None:  # rotary or relative positions: no table to run past
                continue
            name, limit = table
            longest = max(len(row[key]) if isinstance(row.get(key), list) else 0 for row in self.splits[split])
            if longest + virtual > limit:
                raise DataError(
                    f"the {split} split has {kind} of {longest} tokens{f' + {virtual} virtual' if virtual else ''}, "
                    f"but the model's learned position table ({name}) holds {limit} positions: set data.max_length "
                    f"to {limit - virtual} or less"
                )

    def _eval_ranks(self) -> dict[str, int] | None:
        """``num_replicas`` and ``rank`` to shard evaluation over, or ``None`` on one rank (or when Lightning is
        told not to shard: ``use_distributed_sampler=False``, and in ``predict``, whose sampler Lightning sets)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            connector = getattr(trainer, "_accelerator_connector", None)
            if getattr(trainer, "predicting", False) or not getattr(connector, "use_distributed_sampler", True):
                return None
            ranks = trainer.distributed_sampler_kwargs
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = {"num_replicas": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank()}
        else:
            ranks = None
        return ranks if ranks and ranks["num_replicas"] > 1 else None

    def padding_row(self, example: dict) -> dict:
        """The copy of ``example`` that pads an evaluation split to a multiple of the ranks: it must count in no
        metric (:class:`peftplug.lightning.PeftModule` counts labels other than -100). Subclasses whose examples
        carry more than ``labels`` for evaluation (chat answers) mask those too.

        Args:
            example: An example dict of the split.
        """
        return mask_labels(example)

    def _epoch_batches(self) -> int | None:
        """Batches per training epoch as Lightning runs them (``limit_train_batches``), if a trainer is attached."""
        trainer = getattr(self, "trainer", None)
        batches = getattr(trainer, "num_training_batches", None)
        return int(batches) if isinstance(batches, (int, float)) and batches != float("inf") else None

    # The name scripts written before the base class was public call.
    _loader = loader

    def collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Right-pads a list of examples into a batch (see :func:`pad_batch`).

        Args:
            features: Example dicts from :attr:`splits`.
        """
        return pad_batch(features, self.tokenizer.pad_token_id)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches."""
        return self.loader("validation", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Held-out test batches (the validation split when no test data is configured)."""
        return self.loader("test" if "test" in self.splits else "validation", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """Batches to predict on: the test split, else the validation split."""
        return self.test_dataloader()
