"""Zeroth-order training in Hugging Face's ``Trainer``: forward passes only, the optimizer's ``step(closure)``.

The stock ``Trainer`` runs ``training_step`` (forward + ``backward``) and then ``optimizer.step()`` without a
closure, which a zeroth-order optimizer cannot use. :class:`ZeroOrderTrainer` runs the whole zeroth-order step in
``training_step`` instead — model in eval mode (dropout off, so every forward of a step sees the same function),
the closure evaluating ``compute_loss`` under ``no_grad`` — and hands the ``Trainer`` a stand-in optimizer that
shares the real one's param groups (so the LR scheduler drives the real learning rate) and whose closure-less
``step()`` does nothing. Everything else is the ``Trainer``'s: data loading, the LR scheduler (stepped once per
step, after the zeroth-order step, and held after a step skipped for a non-finite loss, as in
``peftplug.lightning``), logging (the step's loss plus the optimizer's
``counters()``), checkpoints (the optimizer's own ``state_dict``) and evaluation.

This is the only module of ``helene`` that imports transformers; ``import helene`` does not import it::

    from helene import Helene
    from helene.hf import ZeroOrderTrainer

    trainer = ZeroOrderTrainer(model, args, train_dataset=ds, optimizers=(Helene(model.named_parameters()), None))
    trainer.train()
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer


class _TrainerFacingOptimizer(torch.optim.Optimizer):
    """What the ``Trainer``, accelerate and the LR scheduler hold as "the optimizer".

    Its ``param_groups`` and ``state`` are the zeroth-order optimizer's, looked up on every access: an LR schedule
    written into a group is the real optimizer's learning rate, also after a ``load_state_dict`` (which replaces
    the group dicts; accelerate does one when it prepares the optimizer). It steps only when given a closure and
    saves / loads the real optimizer's state.

    Args:
        zo: The zeroth-order optimizer.
    """

    def __init__(self, zo: torch.optim.Optimizer):
        super().__init__(zo.param_groups, zo.defaults)  # torch's bookkeeping (hooks); its groups are not used
        self.zo = zo

    # Optimizer.__init__ assigns both before ``zo`` exists; from then on they are the zeroth-order optimizer's.
    @property
    def param_groups(self) -> list[dict]:
        zo = self.__dict__.get("zo")
        return self.__dict__["_own_groups"] if zo is None else zo.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> dict:
        zo = self.__dict__.get("zo")
        return self.__dict__["_own_state"] if zo is None else zo.state

    @state.setter
    def state(self, state: dict) -> None:
        self.__dict__["_own_state"] = state

    @torch.no_grad()
    def step(self, closure=None):
        """``step(closure)`` is the zeroth-order step; the ``Trainer``'s own ``step()`` after it does nothing."""
        return None if closure is None else self.zo.step(closure)

    def state_dict(self) -> dict:
        """The zeroth-order optimizer's state dict."""
        return self.zo.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads into the zeroth-order optimizer.

        Args:
            state_dict: Output of :meth:`state_dict`.
        """
        self.zo.load_state_dict(state_dict)


class ZeroOrderTrainer(Trainer):
    """A ``transformers.Trainer`` whose steps are zeroth-order: no ``backward``, no gradients.

    Takes the ``Trainer``'s arguments; ``optimizers=(zo_optimizer, scheduler_or_None)`` is required, with an
    optimizer that has ``is_zeroth_order = True`` (``Helene``, ``ZOSGD``, ``ZOAdam``, ``FZOO``). The loss of a step
    is the batch loss ``compute_loss`` returns (averaged over processes under DDP; the closure does that, so only
    scalars are communicated), computed without ``num_items_in_batch``, i.e. the model's own per-batch mean. An
    optimizer with ``set_total_steps`` (HELENE's ``anneal_horizon="auto"``) is told the run's ``max_steps``.

    Args:
        *args: Positional arguments of ``transformers.Trainer``.
        optimizers: ``(zeroth-order optimizer, LR scheduler or None)``.
        **kwargs: Keyword arguments of ``transformers.Trainer``.

    Raises:
        ValueError: If no zeroth-order optimizer is given, or ``gradient_accumulation_steps`` > 1 (a
            zeroth-order step evaluates one batch at several points; there is nothing to accumulate).
    """

    def __init__(self, *args: Any, optimizers=(None, None), **kwargs: Any):
        zo, scheduler = optimizers
        if zo is None or not getattr(zo, "is_zeroth_order", False):
            raise ValueError("ZeroOrderTrainer needs optimizers=(zeroth-order optimizer, scheduler or None), e.g. "
                             f"(helene.Helene(model.named_parameters()), None); got optimizer {type(zo).__name__}")
        self.zo_optimizer = zo
        super().__init__(*args, optimizers=(_TrainerFacingOptimizer(zo), scheduler), **kwargs)
        self._check_accumulation()

    def _check_accumulation(self) -> None:
        steps = self.args.gradient_accumulation_steps
        if steps != 1:
            raise ValueError(f"gradient_accumulation_steps must be 1 for zeroth-order training, got {steps}: each "
                             "step evaluates one batch at perturbed parameters; use a larger batch instead")

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Drops the accelerator's loss scaler (``fp16=True`` on a GPU), then returns the optimizer as usual.

        A zeroth-order step runs no backward, so no loss is ever scaled; the optimizer wrapper that
        ``accelerator.prepare`` builds next (right after this call) would still call ``GradScaler.step``, which
        fails ("Attempted step but _scale is None"). fp16 autocast of the forwards stays on.

        Args:
            model: As in ``Trainer.create_optimizer``.
        """
        self.accelerator.scaler = None
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """Tells the optimizer the run's length (HELENE's annealing horizon), then builds the scheduler as usual.

        Args:
            num_training_steps: The run's ``max_steps``.
            optimizer: As in ``Trainer.create_scheduler``.
        """
        self._check_accumulation()
        if hasattr(self.zo_optimizer, "set_total_steps"):
            self.zo_optimizer.set_total_steps(int(num_training_steps))
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One zeroth-order step on ``inputs``; returns its loss (detached, on ``args.device``).

        Args:
            model: The (possibly wrapped) model.
            inputs: The batch.
            num_items_in_batch: Ignored: the closure's loss is the per-batch mean (see the class docstring).
        """
        model.eval()
        inputs = self._prepare_inputs(inputs)
        world = self.accelerator.num_processes

        def closure() -> torch.Tensor:
            with torch.no_grad(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs)
            loss = loss.detach().float()
            if self.args.n_gpu > 1:
                loss = loss.mean()  # torch.nn.DataParallel returns one loss per device
            if world > 1:
                loss = self.accelerator.reduce(loss, reduction="mean")
            return loss

        loss = torch.as_tensor(self.zo_optimizer.step(closure), dtype=torch.float32).detach()
        # A step skipped for a non-finite loss leaves θ and the optimizer's state as they were; the LR schedule
        # stays too, as peftplug.lightning holds it and as the Trainer holds it after a step the loss scaler
        # skipped: the flag the Trainer reads for that (accelerator.optimizer_step_was_skipped) is this one.
        if hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = not bool(torch.isfinite(loss))
        return loss.to(self.args.device)

    def _get_grad_norm(self, model, grad_norm=None):
        # There are no gradients: without this the Trainer would log a gradient norm of 0.
        return None

    def _clip_grad_norm(self, model):
        return None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds the optimizer's counters (steps, skips, forward passes) to the training logs.

        Args:
            logs: What the ``Trainer`` logs.
            *args: Passed on to ``Trainer.log``.
            **kwargs: Passed on to ``Trainer.log``.
        """
        counters = getattr(self.zo_optimizer, "counters", None)
        if "loss" in logs and callable(counters):
            logs = {**logs, **{name: float(value) for name, value in counters().items()}}
        super().log(logs, *args, **kwargs)
