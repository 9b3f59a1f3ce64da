"""Steps whose loss is not finite are skipped whole: no parameter update and no LR schedule step.

A mixin for :class:`peftplug.lightning.PeftModule`. HF's ``Trainer`` (through accelerate) does the same for the
steps its gradient scaler skips: the optimizer does not step, so the schedule does not advance either — otherwise
a NaN batch during warmup would eat a warmup step that never trained, and every later step would run at the
learning rate of one step further on.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn

#: Checkpoint key of the count of skipped steps, so that a resumed run's count (logged, and said at the end) goes on
#: from the interrupted run's instead of from 0.
NONFINITE_KEY = "peftplug_nonfinite_steps"


class SkipsNonFiniteSteps:
    """Skips the optimizer update and the per-step LR scheduler step of a step whose loss was not finite.

    The host calls :meth:`_count_nonfinite` when it meets such a loss: first-order steps then drop their gradients
    in ``on_before_optimizer_step`` (so Adam's moments and weight decay do not move either) and hold the
    ``interval: step`` scheduler in ``lr_scheduler_step``; zeroth-order steps ask :meth:`_step_scheduler` with the
    outcome of their optimizer step. Epoch-interval schedulers step as usual at the epoch's end.
    """

    nonfinite_steps: int = 0
    _skip_update: bool = False
    _hold_scheduler: bool = False

    def _all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (one scalar all-reduce under DDP, so ranks agree).

        Args:
            loss: This rank's loss.
        """
        bad = (~torch.isfinite(loss.detach())).float()
        if self.trainer.world_size > 1:
            bad = self.trainer.strategy.reduce(bad, reduce_op="sum")
        return bad.item() == 0

    def _count_nonfinite(self, first_order: bool) -> None:
        """Counts and logs a skipped step; a first-order one also drops its update (see the class docstring).

        Under ``accumulate_grad_batches`` several micro-batches of one optimizer step may be non-finite: the step is
        counted once (the count is of skipped steps; it counted micro-batches, two for one skipped step).

        Args:
            first_order: Whether gradients of this step are still to reach the optimizer.
        """
        if not (first_order and self._skip_update):  # else this optimizer step is counted (and skipped) already
            self.nonfinite_steps += 1
        self._skip_update = first_order
        self.log("nonfinite_steps", float(self.nonfinite_steps), prog_bar=True)

    def _save_nonfinite(self, checkpoint: dict[str, Any]) -> None:
        """Adds the count of skipped steps to a checkpoint being written.

        Args:
            checkpoint: The checkpoint dict Lightning is about to write.
        """
        checkpoint[NONFINITE_KEY] = int(self.nonfinite_steps)

    def _restore_nonfinite(self, checkpoint: dict[str, Any]) -> None:
        """Continues the count of skipped steps from a checkpoint that a fit resumes from.

        Only a fit's resume (``trainer.fit(..., ckpt_path=...)``) takes it, as with the RNG states: a module loaded
        otherwise (``load_from_checkpoint``, ``validate``/``test`` with ``ckpt_path``) and fitted afresh later counts
        that fit's steps. A checkpoint from before the count was saved leaves it as it is.

        Args:
            checkpoint: The loaded checkpoint dict.
        """
        saved = checkpoint.get(NONFINITE_KEY)
        if saved is not None and self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            self.nonfinite_steps = int(saved)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drops the gradients of a step whose loss was not finite, so the optimizer skips every parameter.

        Args:
            optimizer: The optimizer about to step.
        """
        if self._skip_update:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self._skip_update = False
            # Lightning steps an ``interval: step`` scheduler right after this optimizer step: hold that one.
            self._hold_scheduler = self.hparams.lr_scheduler_interval == "step"

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's gradient clipping, except after :meth:`on_before_optimizer_step` dropped every gradient.

        There is nothing to clip then, and torch's ``clip_grad_value_`` (``gradient_clip_algorithm: value``) fails on
        a list of no gradients: a run whose loss turned NaN ended in a RuntimeError instead of skipping the step.

        Args:
            optimizer: The optimizer about to step.
            gradient_clip_val: ``trainer.gradient_clip_val``.
            gradient_clip_algorithm: ``trainer.gradient_clip_algorithm`` (``norm`` or ``value``).
        """
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's scheduler step, held once after a skipped update (Lightning asks only at the step's end for
        ``interval: step`` schedulers, at the epoch's end for ``epoch`` ones).

        Args:
            scheduler: The scheduler Lightning is about to step.
            metric: The monitored value for ``ReduceLROnPlateau``, else ``None``.
        """
        if self._hold_scheduler:
            self._hold_scheduler = False
            return
        super().lr_scheduler_step(scheduler, metric)

    def on_train_end(self) -> None:
        """Says on rank zero, in one line, how many steps were skipped for a non-finite loss.

        The count was only logged: with no logger and no progress bar (or a run nobody watches), a fit whose loss
        was NaN from some step on skipped every later step and exited 0 without a word, its adapter untrained.
        """
        super_end = getattr(super(), "on_train_end", None)
        if callable(super_end):
            super_end()
        if not self.nonfinite_steps or not self.trainer.is_global_zero:
            return
        steps = self.trainer.global_step
        print(f"peftplug: warning: {self.nonfinite_steps} optimizer step(s) had a non-finite loss (NaN/inf) and were "
              f"skipped without an update (the run is at step {steps}; the count includes those before a resume); "
              "check the learning rate and the data, or train in fp32", file=sys.stderr, flush=True)

    def _step_scheduler(self, stepped: bool) -> None:
        """Steps a zeroth-order run's scheduler once for a step whose update happened.

        Args:
            stepped: Whether the optimizer step's loss was finite (a non-finite one leaves the parameters as
                they were, so the schedule stays too).
        """
        scheduler = self.lr_schedulers()
        if stepped and scheduler is not None and not isinstance(
                scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
