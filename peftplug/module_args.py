"""Checks and plain forms of :class:`peftplug.lightning.PeftModule`'s arguments as Python code passes them.

From a notebook the arguments arrive as objects, not as the recipe's plain values, and four things went wrong there:

- a ``PeftModel`` given as ``model`` together with ``peft=`` was wrapped in a second ``PeftModel``; its
  ``save_pretrained`` wrote the first adapter's tensors under names no base model has, which PEFT's loading skips:
  the saved adapter reloaded as a different model, without an error (:func:`check_adapter_target`);
- a ``PeftConfig`` object was attached as is: the module set its ``task_type`` on the caller's object, so reusing
  one config for a module of another task failed with "peft.task_type 'SEQ_CLS' does not fit model.task" although
  the caller never set it, and a later edit of the caller's object changed the module's adapter config
  (:func:`own_peft_spec`);
- a ``class_path`` dict kept PEFT's enums inside its ``init_args`` in the saved hyperparameters, and every later
  ``load_from_checkpoint`` / ``fit(ckpt_path=...)`` (torch's ``weights_only`` loading) refused the checkpoint
  (:func:`peft_hparams`);
- an optimizer (or scheduler) object, or a recipe's ``class_path`` dict, instead of a callable failed only in
  ``configure_optimizers``, with ``TypeError: 'dict' object is not callable`` (:func:`check_factories`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from peftplug.errors import ConfigError


def check_adapter_target(model: torch.nn.Module, peft: Any) -> None:
    """Refuses a new adapter for a model that is a ``PeftModel`` already.

    PEFT's ``get_peft_model`` wraps it again without a word; the nested model trains both adapters but saves them
    under the outer wrapper's names, which PEFT skips when it loads the folder onto a base model.

    Args:
        model: The model the adapter would be attached to.
        peft: The ``peft`` argument (``None``: the model is trained as it is).

    Raises:
        ConfigError: If ``peft`` is given for a ``PeftModel``.
    """
    from peft import PeftMixedModel, PeftModel

    if peft is None or not isinstance(model, (PeftModel, PeftMixedModel)):
        return
    names = ", ".join(repr(name) for name in model.peft_config)
    raise ConfigError(f"peft: model is a PeftModel already (adapter {names}), and a second adapter would wrap it in "
                      "another PeftModel whose save_pretrained no base model loads; pass peft=None to train its "
                      "adapter, or model.unload() (its base model, adapter removed) with peft=")


def own_peft_spec(peft: Any) -> Any:
    """A copy of a ``PeftConfig`` object, which the module completes (``task_type``) and PEFT keeps; other specs
    (dicts, ``None``) as they are: building the config from them makes a new object anyway.

    Args:
        peft: The ``peft`` argument.
    """
    from peft import PeftConfig

    return copy.deepcopy(peft) if isinstance(peft, PeftConfig) else peft


def peft_hparams(peft: Any, config: Any) -> Any:
    """What ``hparams.peft`` records: the built config as a plain dict for a ``PeftConfig`` object, else the dict as
    given in plain form (:func:`peftplug.loading.plain_value`: PEFT's enums by value, at any depth, ``init_args`` of
    a ``class_path`` dict included).

    A plain Trainer's ``fit(ckpt_path=...)`` and ``load_from_checkpoint`` load with torch's default
    ``weights_only=True``, which refuses the enums' class.

    Args:
        peft: The ``peft`` argument (a ``PeftConfig`` or a dict).
        config: The ``PeftConfig`` built from it.
    """
    from peft import PeftConfig

    from peftplug.loading import peft_config_to_dict, plain_value

    return peft_config_to_dict(config) if isinstance(peft, PeftConfig) else plain_value(peft)


def check_factories(optimizer: Any, lr_scheduler: Any) -> None:
    """Refuses an ``optimizer`` / ``lr_scheduler`` that is not a callable building one from the parameters / the
    optimizer.

    Args:
        optimizer: The ``optimizer`` argument.
        lr_scheduler: The ``lr_scheduler`` argument.

    Raises:
        ConfigError: Naming the field, what it got and an example of what it takes.
    """
    examples = {"optimizer": ("the trainable parameters", "functools.partial(torch.optim.AdamW, lr=1e-3)"),
                "lr_scheduler": ("the optimizer", "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)")}
    for field, value in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if value is None or callable(value):
            continue
        source, example = examples[field]
        got = "a dict" if isinstance(value, dict) else f"a built {type(value).__name__} (the module builds it itself)"
        raise ConfigError(f"model.{field} must be a callable that builds it from {source}, e.g. {example} or a "
                          f"class; got {got}")
