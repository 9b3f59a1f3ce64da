"""Interleaved timing: on shared cores only ratios measured round by round in one process mean anything."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def interleaved(methods: Sequence[str], step: Callable[[str], Any], rounds: int, steps_per_round: int,
                warmup: int) -> dict[str, list]:
    """Runs ``step(method)`` for every method, round by round; returns ``{method: [step(method) results]}``.

    Load changes on the shared cores then hit every method alike, which back-to-back runs do not.

    Args:
        methods: Method names.
        step: Runs one timed step of a method and returns its measurement.
        rounds: Rounds; each runs every method ``steps_per_round`` times.
        steps_per_round: Steps per method and round.
        warmup: Untimed steps per method before the first round.

    Raises:
        ValueError: If ``rounds`` or ``steps_per_round`` is below 1 or ``warmup`` below 0.
    """
    if rounds < 1 or steps_per_round < 1:
        raise ValueError(f"rounds and steps_per_round must be >= 1, got {rounds} and {steps_per_round}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    methods = list(methods)
    for method in methods:
        for _ in range(warmup):
            step(method)
    times: dict[str, list] = {method: [] for method in methods}
    for r in range(rounds):
        # Rotate the order each round: no method always runs right after the same neighbour.
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for method in order:
            times[method].extend(step(method) for _ in range(steps_per_round))
    return times


def lm_train_step(model: Any, optimizer: Any, ids: Any) -> Any:
    """One causal-LM training step on ``ids`` (labels = inputs): forward, backward, optimizer step, grads freed.

    The step every training-time benchmark times; callers add their own clocks and synchronisation around it.

    Args:
        model: A Hugging Face causal LM (possibly wrapped by PEFT or ``torch.compile``).
        optimizer: Its optimizer.
        ids: ``[batch, seq]`` token ids.

    Returns:
        The step's loss (a tensor, not synchronised).
    """
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
