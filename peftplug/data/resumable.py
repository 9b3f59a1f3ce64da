"""Training loaders that resume mid-epoch: a seeded order per epoch and a position Lightning saves.

Lightning 2.6 restores a training loader's position only if the loader itself is stateful (``state_dict`` /
``load_state_dict``: ``FitLoop.on_save_checkpoint`` stores ``CombinedLoader._state_dicts()`` and
``FitLoop.setup_data`` loads them back right before it creates the epoch's iterator). Without that, a run resumed
from a mid-epoch checkpoint starts the epoch's batches again from the first one. Two pieces make our training
loaders resumable:

- :class:`EpochShuffleSampler`: the order of epoch ``e`` is a function of ``(seed, e)`` alone, so a resumed
  process draws the same order without replaying the epochs before. It is the order the former
  ``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))`` gave in each epoch when iterated on
  its own — but **not** inside Lightning's fit loop, which drew more from that shared generator: there the two
  agree in epoch 0 only (checked on 32 examples in batches of 16, Lightning 2.6), so runs recorded before this
  loader (the SmolLM2 HELENE grid) differ from their second epoch on. It is a ``RandomSampler``, so under DDP
  Lightning replaces it with its own seeded
  ``DistributedSampler`` as before.
- :class:`ResumableDataLoader`: counts the batches it has handed out in the current epoch; ``state_dict`` returns
  ``{"epoch", "batches"}`` and ``load_state_dict`` makes the next iterator skip the batches already trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler


class EpochShuffleSampler(RandomSampler):
    """A shuffling sampler whose order in epoch ``e`` depends only on ``seed`` and ``e``.

    Args:
        data_source: The dataset (anything with ``len``).
        seed: Seed of the order.
    """

    def __init__(self, data_source: Any, seed: int) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the order of ``epoch`` (Lightning calls this at every epoch start).

        Args:
            epoch: The epoch, from 0.
        """
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        # The former loader shared one generator, seeded once, between its iterators and torch's RandomSampler:
        # each epoch the iterator drew one int64 (its worker base seed), then the sampler two permutations (the
        # order, and one it slices to the remainder num_samples % n = 0). Replaying those draws gives every epoch
        # the order it had then, from (seed, epoch) alone.
        n = len(self.data_source)
        generator = self.generator
        generator.manual_seed(self.seed)
        for _ in range(self.epoch):
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            torch.randperm(n, generator=generator)
            torch.randperm(n, generator=generator)
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        yield from torch.randperm(n, generator=generator).tolist()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position within the epoch is saved in Lightning checkpoints and restored from them.

    Args:
        *args: ``DataLoader`` arguments.
        epoch_batches: Returns the number of batches an epoch really has (Lightning's ``num_training_batches``
            under ``limit_train_batches``), or ``None`` for ``len(self)``; a position at or past it is saved as the
            start of the next epoch.
        **kwargs: ``DataLoader`` arguments.
    """

    def __init__(self, *args: Any, epoch_batches: Callable[[], int | None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_batches = epoch_batches
        self._position = 0  # batches of the current epoch handed out (or skipped on resume)
        self._skip = 0
        self._iter_epoch = 0  # the epoch whose order the current iterator follows
        self._resuming = False  # load_state_dict ran and no iterator was created since
        self._after_resumed = False  # the current iterator is the restored epoch's (the next one follows it)
        self._epoch_shift = 0  # what to add to the epoch Lightning sets (non-zero only after a resume, see below)

    def _epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def _set_sampler_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(int(epoch))

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if self._resuming:  # the first iterator after load_state_dict: the restored epoch, from its position
            self._resuming, self._after_resumed = False, True
        elif self._after_resumed:
            # The epoch after the restored one must follow the next order. Lightning counts a checkpoint written
            # when max_steps stopped a run mid-epoch as a finished epoch, so it then sets one epoch more (seen
            # under DDP: epoch 2's order instead of epoch 1's); keep the difference for every later epoch.
            self._epoch_shift = self._iter_epoch + 1 - self._epoch()
            self._after_resumed = False
            self._set_sampler_epoch(self._epoch() + self._epoch_shift)
        elif self._epoch_shift and self._epoch() != self._iter_epoch:
            self._set_sampler_epoch(self._epoch() + self._epoch_shift)  # once per epoch that Lightning sets
        self._iter_epoch = self._epoch()
        self._position = 0
        iterator = super().__iter__()
        for _ in range(skip):  # collating a skipped batch costs little next to a training step
            next(iterator, None)
            self._position += 1
        return self._count(iterator)

    def _count(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": k}``: the next batch is the ``k``-th (from 0) of epoch ``e``."""
        limit = self.epoch_batches() if self.epoch_batches is not None else None
        limit = len(self) if limit is None else min(int(limit), len(self))
        if self._position >= limit:
            return {"epoch": self._iter_epoch + 1, "batches": 0}
        return {"epoch": self._iter_epoch, "batches": self._position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Makes the next iterator start at the saved position (Lightning calls this before creating it).

        Args:
            state_dict: From :meth:`state_dict`.
        """
        # Before the iterator exists: with workers it reads the sampler at once.
        self._set_sampler_epoch(int(state_dict["epoch"]))
        self._skip = int(state_dict["batches"])
        self._iter_epoch = int(state_dict["epoch"])
        self._resuming = True
        self._epoch_shift = 0
