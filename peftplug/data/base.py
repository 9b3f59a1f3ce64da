"""The tokenized LightningDataModule every peftplug data module builds on, and batch padding.

A data module reads its splits in ``setup`` into :attr:`TokenizedDataModule.splits` (lists of tokenized example
dicts); the base class finds the tokenizer (its own ``tokenizer`` setting, else the one of the trainer's
:class:`peftplug.lightning.PeftModule`, so a recipe names the model once), and builds the loaders.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from peftplug.data.resumable import EpochShuffleSampler, ResumableDataLoader
from peftplug.errors import ConfigError, DataError


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


class TokenizedDataModule(L.LightningDataModule):
    """A LightningDataModule of tokenized examples: the base of every peftplug data module, and of yours.

    A subclass reads and tokenizes its data in ``setup`` into :attr:`splits` (``{"train": [...], "validation":
    [...], "test": [...]}``, each a list of example dicts of int lists such as ``input_ids``, ``attention_mask``,
    ``labels``), calling :meth:`resolve_tokenizer` for the tokenizer; it may override :meth:`collate` (right
    padding by default). The loaders are built here: training batches in an order seeded by ``seed`` and the
    epoch, from a loader that resumes mid-epoch (:mod:`peftplug.data.resumable`); evaluation batches in order.

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

    def resolve_tokenizer(self) -> Any:
        """The tokenizer: loaded from the ``tokenizer`` setting, else borrowed from the trainer's module (once).

        Raises:
            ConfigError: If neither is available.
        """
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_name is not None:
            from peftplug.loading import load_tokenizer

            self.tokenizer = load_tokenizer(self.tokenizer_name)
        elif getattr(self._module(), "tokenizer", None) is not None:
            self.tokenizer = self._module().tokenizer
        else:
            raise ConfigError("data.tokenizer is not set and the model has no tokenizer to borrow")
        return self.tokenizer

    def loader(self, split: str, shuffle: bool, collate: Any = None) -> DataLoader:
        """A DataLoader over one prepared split (after ``setup``).

        Args:
            split: ``train``, ``validation`` or ``test``.
            shuffle: Shuffle (seeded, training batch size) or not (evaluation batch size).
            collate: Collate function (default: :meth:`collate`).

        Raises:
            DataError: If the split is not configured.
        """
        if split not in self.splits:
            raise DataError(f"no {split} data configured")
        if not shuffle:
            return DataLoader(self.splits[split], batch_size=self.eval_batch_size, shuffle=False,
                              num_workers=self.num_workers, collate_fn=collate or self.collate)
        # Training order: seeded per epoch, and the position is saved in checkpoints (peftplug.data.resumable).
        # The loader's own generator only seeds its workers, so that the global RNG (dropout) is never drawn from.
        return ResumableDataLoader(
            self.splits[split], batch_size=self.batch_size, sampler=EpochShuffleSampler(self.splits[split], self.seed),
            num_workers=self.num_workers, collate_fn=collate or self.collate,
            generator=torch.Generator().manual_seed(self.seed), epoch_batches=self._epoch_batches,
        )

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
