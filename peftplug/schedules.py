"""LR schedules that follow the run: lengths sized from the trainer, and a refusal before training when a fixed
length would run out.

A recipe that fixes a schedule's length (``OneCycleLR``'s ``total_steps: 48``) breaks as soon as the data grows:
``OneCycleLR`` raises at step 49, after training, and a cosine or polynomial decay that ends early trains the rest
of the run at a learning rate climbing back up or stuck at 0. :func:`build_lr_scheduler` (called by
``PeftModule.configure_optimizers``) therefore

- fills a length left ``null`` (or out) with the run's length: ``trainer.estimated_stepping_batches`` optimizer
  steps (``lr_scheduler_interval: step``, and always for zeroth-order training, which steps the schedule once a
  step), or the run's epochs (``interval: epoch``); torch's ``CosineAnnealingLR`` requires ``T_max``, so recipes
  use :class:`CosineAnnealingLR` here, which takes ``null``;
- refuses a ``OneCycleLR`` whose ``max_lr`` differs from the optimizer's ``lr`` (OneCycleLR overrides it: a new
  optimizer's lr given on the command line would be ignored), naming the flag that sets it;
- refuses, in one :class:`~peftplug.errors.ConfigError` line naming both numbers, a fixed length shorter than the
  run when the schedule cannot go on past it (table :data:`OUTRUN`) — before the first training step;
- turns ``OneCycleLR``'s momentum cycling off for an optimizer that has no momentum to cycle (the zeroth-order
  ones): torch refuses that combination (and would cycle a zeroth-order optimizer's betas) although the learning-rate
  schedule is all that matters there.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peftplug.errors import ConfigError

# Each length-bearing torch scheduler's length argument (and the attribute the built scheduler keeps it in).
LENGTH_ARGUMENTS: dict[type, str] = {
    torch.optim.lr_scheduler.OneCycleLR: "total_steps",  # and OneCycleLR's max_lr must be the optimizer's lr
    torch.optim.lr_scheduler.CosineAnnealingLR: "T_max",
    torch.optim.lr_scheduler.PolynomialLR: "total_iters",
    torch.optim.lr_scheduler.LinearLR: "total_iters",
    torch.optim.lr_scheduler.ConstantLR: "total_iters",
}


class CosineAnnealingLR(torch.optim.lr_scheduler.CosineAnnealingLR):
    """torch's ``CosineAnnealingLR`` with ``T_max`` optional: ``null`` (the default) is the run's length, filled in by
    :func:`build_lr_scheduler` (torch's own requires the number, so a recipe would have to fix it).

    Args:
        optimizer: The optimizer.
        T_max: Steps (or epochs) of the half cosine; ``None`` = the run's length.
        eta_min: The last learning rate.
        last_epoch: torch's resume index.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, T_max: int | None = None, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        if T_max is None:
            raise ConfigError("lr_scheduler.init_args.T_max: null means the run's length, which only a training run "
                              "(PeftModule under a Trainer, given this class or a functools.partial of it, not a "
                              "function that calls it) knows; give a number")
        super().__init__(optimizer, T_max=T_max, eta_min=eta_min, last_epoch=last_epoch)


def _linear_ends_at_zero(scheduler: Any) -> bool:
    return float(scheduler.end_factor) == 0.0


# Schedulers that cannot continue past their length, and why: shorter than the run is refused. LinearLR only when it
# decays to 0 (a shorter one is a warm-up or a decay to a floor, both common), ConstantLR never (it ends on purpose).
OUTRUN: dict[type, tuple[str, Callable[[Any], bool]]] = {
    torch.optim.lr_scheduler.OneCycleLR: ("it raises at the step after its last", lambda s: True),
    torch.optim.lr_scheduler.CosineAnnealingLR: ("its learning rate would climb back up after it", lambda s: True),
    torch.optim.lr_scheduler.PolynomialLR: ("its learning rate stays at 0 after it", lambda s: float(s.power) > 0),
    torch.optim.lr_scheduler.LinearLR: ("its learning rate stays at 0 after it (end_factor 0)", _linear_ends_at_zero),
}


@dataclass(frozen=True)
class RunLength:
    """How long the scheduler will be stepped in this run.

    Args:
        length: Scheduler steps (optimizer steps, or epochs for ``interval: epoch``); ``inf`` when the run sets no
            limit.
        unit: ``"steps"`` or ``"epochs"``.
        why: Where the number comes from, for messages (``"trainer.max_epochs 1 × 125 steps per epoch"``).
    """

    length: float
    unit: str
    why: str


def run_length(trainer: Any, interval: str = "step", zeroth_order: bool = False) -> RunLength:
    """The number of times this run steps its LR scheduler, from Lightning's own estimate of the run.

    Args:
        trainer: The Lightning ``Trainer`` the module is attached to.
        interval: ``model.lr_scheduler_interval`` (``step`` or ``epoch``).
        zeroth_order: Zeroth-order training steps the scheduler once per optimizer step whatever the interval.
    """
    steps = trainer.estimated_stepping_batches  # loads the train dataloader if it is not yet (Lightning's)
    if steps < 0:
        steps = math.inf  # Lightning returns max_steps (-1) for an endless dataset without a step limit
    batches = trainer.num_training_batches
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else math.inf
    limit = "trainer.max_steps" if trainer.max_steps != -1 and steps == trainer.max_steps else None
    if interval == "epoch" and not zeroth_order:
        if not math.isfinite(steps):
            return RunLength(math.inf, "epochs", "trainer.max_epochs -1 and no trainer.max_steps")
        epochs = math.ceil(steps / per_epoch) if math.isfinite(per_epoch) and per_epoch else trainer.max_epochs
        return RunLength(epochs, "epochs", f"{limit} {trainer.max_steps} at {per_epoch} steps per epoch" if limit
                         else f"trainer.max_epochs {trainer.max_epochs}")
    if not math.isfinite(steps):
        return RunLength(math.inf, "steps", "trainer.max_epochs -1 and no trainer.max_steps")
    why = (f"{limit} {trainer.max_steps}" if limit else
           f"trainer.max_epochs {trainer.max_epochs} × {per_epoch} steps per epoch: {batches} batches of the data"
           + (f", accumulating {trainer.accumulate_grad_batches}" if trainer.accumulate_grad_batches > 1 else ""))
    return RunLength(int(steps), "steps", why)


def _factory_class(factory: Callable[..., Any]) -> tuple[type | None, dict[str, Any]]:
    """The scheduler class and keyword arguments of a factory, when it is the class or a ``functools.partial`` of one
    (what jsonargparse builds from a recipe: ``partial(instantiator, cls, **init_args)``, flattened by functools into
    ``partial(call, instantiator, cls, **init_args)``), else ``(None, {})``."""
    if inspect.isclass(factory):  # the class itself, from Python: every argument left at its default
        return factory, {}
    if not isinstance(factory, functools.partial):
        return None, {}
    cls = factory.func if inspect.isclass(factory.func) else next((a for a in factory.args if inspect.isclass(a)), None)
    return (cls, dict(factory.keywords)) if cls is not None else (None, {})


def _left_null(cls: type, name: str, kwargs: dict[str, Any]) -> bool:
    """Whether the length argument ``name`` is null: given as ``None``, or left out where the class defaults it to
    ``None`` (``OneCycleLR.total_steps``, our ``CosineAnnealingLR.T_max``; Python callers pass the class or a
    ``partial`` without it, which torch then refused, or our ``CosineAnnealingLR`` as if no run were there)."""
    if name in kwargs:
        return kwargs[name] is None
    try:
        parameter = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read: leave the scheduler to its own defaults
        return False
    return parameter is not None and parameter.default is None


def _has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return "momentum" in optimizer.defaults or "betas" in optimizer.defaults


def _fill_in(cls: type, kwargs: dict[str, Any], optimizer: torch.optim.Optimizer, run: RunLength,
             field: str, zeroth_order: bool = False) -> dict[str, Any]:
    """The arguments :func:`build_lr_scheduler` adds to a recipe's scheduler (lengths left null, OneCycleLR's
    ``max_lr`` and ``cycle_momentum``)."""
    fill: dict[str, Any] = {}
    name = next((arg for base, arg in LENGTH_ARGUMENTS.items() if issubclass(cls, base)), None)
    one_cycle = issubclass(cls, torch.optim.lr_scheduler.OneCycleLR)
    if name is not None and _left_null(cls, name, kwargs) and not (one_cycle and kwargs.get("epochs")):
        if not math.isfinite(run.length):
            raise ConfigError(f"{field}.init_args.{name}: null means the run's length, but this run sets none "
                              f"({run.why}); set trainer.max_steps or trainer.max_epochs, or give {name}")
        fill[name] = int(run.length)
    if one_cycle:
        _check_peak(kwargs.get("max_lr"), optimizer, field)
        if kwargs.get("cycle_momentum", True) and (zeroth_order or not _has_momentum(optimizer)):
            # torch refuses it without momentum; a zeroth-order optimizer's betas (HELENE's β1 drives its annealed
            # momentum) are not a first-order momentum to cycle. The LR cycle is unaffected.
            fill["cycle_momentum"] = False
    return fill


def _check_peak(max_lr: Any, optimizer: torch.optim.Optimizer, field: str) -> None:
    """Refuses a ``OneCycleLR`` peak that differs from the optimizer's ``lr``: OneCycleLR sets the learning rate
    itself, so a changed ``model.optimizer.init_args.lr`` (a new optimizer, a sweep) would be silently ignored."""
    rates = {group["lr"] for group in optimizer.param_groups}
    if isinstance(max_lr, (int, float)) and len(rates) == 1 and not math.isclose(max_lr, lr := rates.pop()):
        raise ConfigError(f"{field}.init_args.max_lr: {max_lr:g} differs from the optimizer's lr {lr:g}, which "
                          f"OneCycleLR would ignore (it sets the lr itself, peaking at max_lr); set "
                          f"--{field}.init_args.max_lr {lr:g}, or drop the schedule with --{field} null")


COMPOSITES = (torch.optim.lr_scheduler.SequentialLR, torch.optim.lr_scheduler.ChainedScheduler)


def _parts(scheduler: Any, length: float, start: int = 0, label: str = "") -> list[tuple[Any, float, int, str]]:
    """The schedulers a run of ``length`` steps, each with its share of the run: ``(scheduler, length, start,
    label)``. A ``SequentialLR`` hands the run to its schedulers in turn (the i-th from its milestone, restarted at 0,
    until the next), a ``ChainedScheduler`` steps all of them through the whole run; a warm-up plus a decay is one of
    these, and its decay runs out just as a bare one would.

    Args:
        scheduler: The built scheduler.
        length: The steps (or epochs) the run steps it.
        start: The run's step at which it starts (inside a ``SequentialLR``).
        label: Where it sits in the composite, for messages (``"schedulers[1] "``).
    """
    if isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR):
        bounds = [0, *scheduler._milestones, math.inf]
        return [part for i, inner in enumerate(scheduler._schedulers) if min(length, bounds[i + 1]) > bounds[i]
                for part in _parts(inner, min(length, bounds[i + 1]) - bounds[i], start + bounds[i],
                                   f"{label}schedulers[{i}] ")]
    if isinstance(scheduler, torch.optim.lr_scheduler.ChainedScheduler):
        return [part for i, inner in enumerate(scheduler._schedulers)
                for part in _parts(inner, length, start, f"{label}schedulers[{i}] ")]
    return [(scheduler, length, start, label)]


def _outrun(scheduler: Any, run: RunLength) -> tuple[Any, str, float, int, str] | None:
    """The first scheduler (``scheduler`` or one inside it) that runs out before its share of the run ends:
    ``(scheduler, length argument, its share, the step it starts at, label)``, or ``None``."""
    for part, need, start, label in _parts(scheduler, run.length):
        base = next((b for b in OUTRUN if isinstance(part, b)), None)
        if base is None:
            continue
        length = getattr(part, LENGTH_ARGUMENTS[base], None)
        if length is not None and OUTRUN[base][1](part) and length < need:
            return part, LENGTH_ARGUMENTS[base], need, start, label
    return None


def _outrun_message(scheduler: Any, found: tuple[Any, str, float, int, str], run: RunLength) -> tuple[str, str, str]:
    """What runs out, how long it is stepped, and the ``--trainer`` flag that would fit the run to it."""
    part, name, need, start, label = found
    length = getattr(part, name)
    limit = "max_epochs" if run.unit == "epochs" else "max_steps"
    if not label:
        return (f"{type(part).__name__} lasts {length} {run.unit}", f"this run takes {run.length} ({run.why})",
                f"--trainer.{limit} {length}")
    # Inside a composite its share of the run is what must fit (recipes cannot build these: Python factories do).
    what = f"{type(scheduler).__name__}'s {label}({type(part).__name__}) lasts {length} {run.unit}"
    takes = f"it runs for {need} of this run's {run.length}, from {run.unit[:-1]} {start} ({run.why})"
    return what, takes, f"--trainer.{limit} {start + length}"


def check_length(scheduler: Any, run: RunLength, field: str = "model.lr_scheduler") -> None:
    """Refuses a scheduler that would run out before the run ends (see :data:`OUTRUN`), also one inside a
    ``SequentialLR`` or ``ChainedScheduler`` (a warm-up then a decay) over its share of the run.

    Args:
        scheduler: The built scheduler.
        run: The run's length (:func:`run_length`).
        field: The config field of the scheduler, for the message.

    Raises:
        ConfigError: Naming the scheduler's length and the run's, and the two ways out.
    """
    found = _outrun(scheduler, run)
    if found is None:
        return
    what, takes, flag = _outrun_message(scheduler, found, run)
    why, name = OUTRUN[next(b for b in OUTRUN if isinstance(found[0], b))][0], found[1]
    if not found[4]:
        raise ConfigError(f"{field}.init_args.{name}: {what} but {takes}; {why}. Set {name} to null to size it "
                          f"from the run, or {flag}")
    raise ConfigError(f"{field}: {what} but {takes}; {why}. Give it {name} {found[2]}, or {flag}")


def check_resumed_length(scheduler: Any, trainer: Any, interval: str = "step", zeroth_order: bool = False,
                         field: str = "model.lr_scheduler") -> None:
    """After a resume restored the scheduler's state: refuses a schedule that this run outlasts.

    :func:`build_lr_scheduler` sizes and checks the scheduler for this run, but Lightning then loads the checkpoint's
    scheduler state over it, length included (``OneCycleLR.total_steps``, ``T_max``, ...): resuming with a larger
    ``trainer.max_steps`` would otherwise end in torch's "Tried to step N times" traceback mid-run. Call it when
    training starts (after the restore); nothing happens unless the fit resumes.

    Args:
        scheduler: The run's scheduler (``None`` for none).
        trainer: The Lightning ``Trainer``; its ``ckpt_path`` says whether the fit resumed.
        interval: ``step`` or ``epoch``.
        zeroth_order: Whether training is zeroth-order.
        field: The config field of the scheduler, for the message.

    Raises:
        ConfigError: Naming the restored length, the run's, and the ways out.
    """
    if scheduler is None or trainer is None or not getattr(trainer, "ckpt_path", None):
        return
    if not any(isinstance(scheduler, b) for b in (*OUTRUN, *COMPOSITES)):
        return
    run = run_length(trainer, interval, zeroth_order)
    found = _outrun(scheduler, run)
    if found is None:
        return
    what, takes, flag = _outrun_message(scheduler, found, run)
    why = OUTRUN[next(b for b in OUTRUN if isinstance(found[0], b))][0]
    raise ConfigError(f"--ckpt_path {trainer.ckpt_path}: its {what} (restored with the checkpoint) but {takes}; "
                      f"{why}. Resume with {flag}, or start a new run from the checkpoint's adapter")


def check_plateau(scheduler: Any, trainer: Any, interval: str, zeroth_order: bool = False,
                  field: str = "model.lr_scheduler") -> None:
    """Refuses a first-order ``ReduceLROnPlateau`` that Lightning would step before ``val_loss`` exists.

    Lightning steps it on ``val_loss`` at every scheduler step and raises ``MisconfigurationException`` when no
    validation has logged it yet: after the first training step with ``interval: step``, after the first epoch when the
    run does not validate. A recipe cannot set Lightning's ``monitor``/``frequency``/``strict`` keys (the module builds
    that dict), so the refusal names what it can change. Zeroth-order runs step it once per validation themselves.

    Args:
        scheduler: The built scheduler.
        trainer: The attached Lightning ``Trainer``, or ``None``.
        interval: ``model.lr_scheduler_interval``.
        zeroth_order: Whether training is zeroth-order.
        field: The config field of the scheduler, for the message.

    Raises:
        ConfigError: Naming the setting to change.
    """
    if zeroth_order or not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return
    if interval == "step":
        raise ConfigError(f"model.lr_scheduler_interval: step steps {field} (ReduceLROnPlateau) after every training "
                          "step, on a val_loss that exists only after a validation; use "
                          "--model.lr_scheduler_interval epoch (it then steps after each epoch, on the latest val_loss)")
    if trainer is not None and not trainer.limit_val_batches:
        raise ConfigError(f"trainer.limit_val_batches: 0 runs no validation, and {field} (ReduceLROnPlateau) steps on "
                          "val_loss; validate (limit_val_batches > 0) or use another scheduler")


def build_lr_scheduler(factory: Callable[..., Any], optimizer: torch.optim.Optimizer, trainer: Any,
                       interval: str = "step", zeroth_order: bool = False,
                       field: str = "model.lr_scheduler") -> Any:
    """Builds the LR scheduler of a run, sized from the run and checked against it.

    Args:
        factory: Builds the scheduler from the optimizer (a recipe's ``lr_scheduler``, or any callable).
        optimizer: The run's optimizer.
        trainer: The attached Lightning ``Trainer``, or ``None`` (then nothing is sized or checked).
        interval: ``step`` or ``epoch``.
        zeroth_order: Whether training is zeroth-order (the scheduler then steps once per step).
        field: The config field of the scheduler, for messages.

    Returns:
        The scheduler.
    """
    if trainer is None:
        return factory(optimizer)
    cls, kwargs = _factory_class(factory)
    needs_run = cls is not None and issubclass(cls, (*LENGTH_ARGUMENTS, *OUTRUN, *COMPOSITES))
    run = run_length(trainer, interval, zeroth_order) if cls is None or needs_run else None
    fill = _fill_in(cls, kwargs, optimizer, run, field, zeroth_order) if cls is not None and run is not None else {}
    scheduler = factory(optimizer, **fill)
    check_plateau(scheduler, trainer, interval, zeroth_order, field)
    if run is not None:
        check_length(scheduler, run, field)
    return scheduler


__all__ = ["COMPOSITES", "LENGTH_ARGUMENTS", "OUTRUN", "CosineAnnealingLR", "RunLength", "build_lr_scheduler",
           "check_length", "check_plateau", "check_resumed_length", "run_length"]
