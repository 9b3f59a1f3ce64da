"""Command-line helpers the benchmarks share: where a run executes (``--device``, ``to_device``) and which share
of a queue one of several parallel processes takes (``--shard I/N``)."""

from __future__ import annotations

import argparse

import torch


class ArgumentValueError(ValueError, argparse.ArgumentTypeError):
    """A bad ``--device`` or ``--shard`` value: a ``ValueError`` whose message argparse prints as it is when the
    function is an argument's ``type=``."""


def resolve_device(name: str) -> str:
    """The device a ``--device`` value names.

    Args:
        name: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (``cuda`` when torch sees one, else ``cpu``).

    Returns:
        ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ArgumentValueError: For another value, or for CUDA on a machine where torch sees none.
    """
    name = name.strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ArgumentValueError(f"--device {name}: torch sees no CUDA device on this machine (use cpu or auto)")
        return name
    raise ArgumentValueError(f"--device: expected cpu, cuda, cuda:N or auto, got {name!r}")


def to_device(batch: dict, device) -> dict:
    """A batch with every tensor moved to ``device``.

    Args:
        batch: Field name -> value; values that are not tensors are kept as they are.
        device: A torch device or its name.
    """
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def lightning_device(device: str) -> dict:
    """The Lightning ``Trainer`` arguments that place it on ``device`` (``cpu``, ``cuda`` or ``cuda:N``)."""
    if device == "cpu":
        return {"accelerator": "cpu", "devices": 1}
    index = device.partition(":")[2]
    return {"accelerator": "gpu", "devices": [int(index)] if index else 1}


def parse_shard(text: str) -> tuple[int, int]:
    """A ``--shard`` value: ``"I/N"`` -> ``(I, N)``, process I of N.

    Raises:
        ArgumentValueError: Unless it is two integers with ``0 <= I < N``.
    """
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise ArgumentValueError(f"--shard wants I/N (e.g. 0/6), got {text!r}") from None
    if not 0 <= index < count:
        raise ArgumentValueError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count
