"""The line a :class:`peftplug.lightning.PeftModule` logs about its parameters when it is built.

For training it is the usual count of what the optimizer will update. ``peftplug generate`` and ``chat`` build the
same module only to answer prompts, where "trainable parameters 86,976 of 86,976 (100.000%)" for a bare model
claimed a full finetuning that does not happen; under :func:`for_generation` the line says what answers instead:
the model as it is, or its adapter on the base model.

A 4-bit (``nf4``/``fp4``) weight of bitsandbytes is stored packed, two values per byte of its storage dtype, so
its ``numel()`` counts half its values (or less): the counts here unpack it, as PEFT's ``print_trainable_parameters``
does, and a quantized model reports the size of its unquantized self.
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


def parameter_count(param: torch.Tensor) -> int:
    """The number of values ``param`` holds: ``numel()``, times the values packed per element for a bitsandbytes
    4-bit weight (``Params4bit``: two 4-bit values per byte of its ``quant_storage`` dtype).

    Args:
        param: A parameter of the model.
    """
    if type(param).__name__ == "Params4bit":
        # numel() of the packed storage counted nf4 models at about half their size: a QOFT/QLoRA run reported
        # "trainable parameters 512 of 50,624 (1.011%)" for what PEFT counts as 512 of 87,488 (0.585%).
        return param.numel() * 2 * param.element_size()
    return param.numel()


def parameter_report(model: torch.nn.Module, has_adapter: bool) -> str:
    """The parameter line for a freshly built module.

    Args:
        model: The module's model (PEFT-wrapped when it has an adapter).
        has_adapter: Whether a PEFT adapter is attached.
    """
    trainable = sum(parameter_count(p) for p in model.parameters() if p.requires_grad)
    total = sum(parameter_count(p) for p in model.parameters())
    if _PURPOSE.get() == "generate":
        if not has_adapter:
            return f"peftplug: generating with the model as it is ({total:,} parameters, no adapter)"
        return (f"peftplug: generating with the adapter ({trainable:,} parameters) on its base model "
                f"({total - trainable:,} parameters)")
    return f"peftplug: trainable parameters {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.3f}%)"
