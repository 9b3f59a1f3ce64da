"""Resuming an interrupted zeroth-order run from a journal of its losses: a few floats per step, no weights.

A zeroth-order step changes the parameters by an amount fixed by two things only: the step's seed, which the
optimizer draws from its own seeded generator, and the losses its closure returned (``L+``, ``L−``, and ``L0`` on
the steps that need it). So a run that writes those losses down can be brought back to any step, bit for bit, by
running the same steps again with the closure answering from the journal: the perturbation passes run (they are
part of what moves the parameters, rounding included), the training forwards do not (the dev evaluations do, as
the check below). A SmolLM2 RTE step costs 12-20 s on one shared CPU core; its replay, the three z-draw passes
(30 steps replayed in about 100 s, model load and two dev evaluations included).

Why this and not a Lightning checkpoint: a full-parameter checkpoint is 0.5 GB (1.5 GB with HELENE's state) and
cannot be committed, while this benchmark's runs outlive the sessions that start them (the machine keeps no
ignored files). The journal is a JSON of ~50 KB beside the results, ``partial/<run_id>.json``, rewritten
atomically every :data:`FLUSH_EVERY` steps and removed once the run's result is written; a stop loses at most
that many steps.

The replay checks itself: every validation point it passes again is compared with the one on record, and a
difference (the model, data or optimizer code changed since) raises :class:`ReplayMismatch`, after which the run
starts over from step 0. Resume with the thread count the run started with (the queue's command pins one): the
replay is exact either way, but only then are the steps after it the uninterrupted run's, bit for bit.
First-order runs (AdamW-LoRA) have no such record and start over when interrupted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

#: Steps between two journal writes (a write is ~50 KB; a step is seconds).
FLUSH_EVERY = 10


class ReplayMismatch(RuntimeError):
    """A validation point recomputed during a replay differs from the one on record."""


def journaled(optimizer_cls: type, journal: list[list[float]]) -> type:
    """A subclass of a zeroth-order optimizer class that records, and replays, its closure's values.

    Step ``k`` (the optimizer's ``step_count`` before the step) replays ``journal[k]`` when the journal has it:
    the closure given is not called and the recorded values answer in their order. Past the journal's end, the
    closure's values are appended to it. ``journal`` is shared, so the caller can write it to disk.

    Args:
        optimizer_cls: A :class:`helene.zo.ZerothOrderOptimizer` subclass (its ``step(closure)`` calls the
            closure two or three times and reduces each value with ``float``).
        journal: Values per step so far (``[]`` for a fresh run).
    """

    class Journaled(optimizer_cls):
        def step(self, closure=None):
            k = self.step_count
            if k < len(journal):
                answers = iter(journal[k])
                return super().step(lambda: next(answers))
            values: list[float] = []

            def recording():
                loss = closure()
                # Exactly the float the optimizer takes from it (a 0-dim fp32 tensor -> Python float).
                values.append(float(loss))
                return loss

            out = super().step(recording)
            journal.append(values)
            return out

    Journaled.__name__ = Journaled.__qualname__ = optimizer_cls.__name__
    return Journaled


def partial_path(partial_dir: Path, run_id: str) -> Path:
    """Where the journal of the unfinished run ``run_id`` lives."""
    return partial_dir / f"{run_id}.json"


def load_partial(path: Path, spec: dict, device: str) -> dict | None:
    """The journal at ``path`` if it belongs to a run with exactly these settings on this device, else ``None``.

    Args:
        path: A :func:`partial_path`.
        spec: The run's settings (``dataclasses.asdict`` of its RunSpec).
        device: ``cpu`` or ``cuda``: z is drawn by that device's generator, so a journal replays only there.
    """
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    # Journals written before the field existed (commit e4ca7ea, 2026-12-01) all came from CPU processes.
    if data.get("spec") != spec or data.get("device", "cpu") != device:
        return None
    steps, journal = data.get("steps", []), data.get("journal", [])
    if len(steps) != len(journal):  # written together, so this is a damaged file: start over
        return None
    return data


#: Relative difference allowed between a replayed validation loss and the recorded one. The replayed parameters
#: are bit-exact (element-wise passes and a seeded generator), but a forward with another thread count sums in
#: another order (~1e-7 relative); a replay that went wrong differs by what one ZO step moves the loss (~1e-3).
LOSS_RTOL = 1e-5


def same_point(recorded: dict, recomputed: dict) -> bool:
    """Whether a validation point recomputed in a replay matches the one on record: the same step and accuracy,
    the loss within :data:`LOSS_RTOL` (NaN matches NaN)."""
    if recorded.get("step") != recomputed.get("step") or recorded.get("acc") != recomputed.get("acc"):
        return False
    a, b = recorded.get("loss"), recomputed.get("loss")
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=1e-9)
