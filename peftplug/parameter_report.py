"""The line a :class:`peftplug.lightning.PeftModule` logs about its parameters when it is built.

For training it is the usual count of what the optimizer will update. ``peftplug generate`` and ``chat`` build the
same module only to answer prompts, where "trainable parameters 86,976 of 86,976 (100.000%)" for a bare model
claimed a full finetuning that does not happen; under :func:`for_generation` the line says what answers instead:
the model as it is, or its adapter on the base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# Why the module is being built: "train" (fit, validate, test, predict, Python use) or "generate".
_PURPOSE: ContextVar[str] = ContextVar("peftplug_module_purpose", default="train")


@contextmanager
def for_generation() -> Iterator[None]:
    """Within this block, modules built report their parameters as a model that generates, not one that trains."""
    token = _PURPOSE.set("generate")
    try:
        yield
    finally:
        _PURPOSE.reset(token)


def parameter_report(model: torch.nn.Module, has_adapter: bool) -> str:
    """The parameter line for a freshly built module.

    Args:
        model: The module's model (PEFT-wrapped when it has an adapter).
        has_adapter: Whether a PEFT adapter is attached.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if _PURPOSE.get() == "generate":
        if not has_adapter:
            return f"peftplug: generating with the model as it is ({total:,} parameters, no adapter)"
        return (f"peftplug: generating with the adapter ({trainable:,} parameters) on its base model "
                f"({total - trainable:,} parameters)")
    return f"peftplug: trainable parameters {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.3f}%)"
