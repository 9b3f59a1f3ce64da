"""Ctrl-C and SIGTERM during training: finish the optimizer step, write a checkpoint, stop cleanly.

:class:`GracefulInterrupt` (``peftplug fit`` adds it to every run) takes over SIGINT and SIGTERM while the training
loop runs (a signal the process was started with ignored, as ``nohup`` and a background ``&`` do for SIGINT,
stays ignored). The first signal only sets a flag; the current optimizer step finishes — the current batch, and with
``accumulate_grad_batches`` > 1 the rest of its accumulation window, since a checkpoint holds no accumulated
gradients (and a zeroth-order step perturbs the parameters in place, so a checkpoint taken inside a step would hold
perturbed weights) — and at that boundary, where Lightning's ``ModelCheckpoint`` saves too, a checkpoint
``last.ckpt`` is written into the run's checkpoint folder (when training ends, if the signal came after the last
batch boundary, e.g. during the final validation) and the trainer stops, without the validation pass
Lightning runs before every early stop (one that was due after that batch anyway still runs). ``peftplug fit --config ...
--ckpt_path last`` then resumes exactly: optimizer, LR scheduler, loops, the training loader's position
(:mod:`peftplug.data.resumable`) and the RNG states (:mod:`peftplug.resume`). A second signal aborts at once
(nothing more is written; ``peftplug`` exits with 130, or 143 if it was SIGTERM: :func:`abort_status`). What is lost:
on Ctrl-C or SIGTERM nothing; on SIGKILL or a lost machine everything since the last periodic checkpoint. The stop outranks the recipe's
``min_epochs``/``min_steps``, which Lightning would otherwise enforce by training on.

Under DDP the flag is all-reduced at each optimizer-step boundary (one scalar), so all ranks stop after the same
batch and write the checkpoint together.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAST = "last.ckpt"


def interrupt_checkpoint_path(trainer: Any) -> Path:
    """Where the interrupt checkpoint goes: ``last.ckpt`` in the first ``ModelCheckpoint``'s folder, else in
    ``<default_root_dir>/checkpoints``.

    Args:
        trainer: The trainer.
    """
    callback = trainer.checkpoint_callback
    folder = getattr(callback, "dirpath", None)
    return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / LAST


class SignalAbort(KeyboardInterrupt):
    """The abort a second signal raises: a ``KeyboardInterrupt`` (Lightning tears down as for Ctrl-C) that names
    the signal, so that ``peftplug fit`` exits with the shell's status for it (:func:`abort_status`).

    Args:
        signum: The signal received.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def abort_status(stop: SystemExit) -> int | None:
    """The exit status of a run aborted by a signal: ``128 + signal number`` (130 for Ctrl-C), else ``None``.

    Lightning answers a ``KeyboardInterrupt`` during ``fit``/``validate``/``test``/``predict`` by tearing down and
    calling ``exit(1)`` inside its handler, so the ``SystemExit`` carries the interrupt as its ``__context__``; a
    status of 1 told scripts the run had failed, where a shell reports 130 for a command Ctrl-C ended. A SIGTERM that
    :class:`GracefulInterrupt` does not handle (``validate``/``test``/``predict``, a fit's sanity check) sets
    Lightning's flag, on which its loops raise ``SIGTERMException``: a ``SystemExit`` without a code, status 0, as if
    the command had finished.

    Args:
        stop: The ``SystemExit`` that ended the command.
    """
    if isinstance(stop, SIGTERMException):
        return 128 + int(signal.SIGTERM)
    interrupt = stop.__context__
    if stop.code != 1 or not isinstance(interrupt, KeyboardInterrupt):
        return None
    return 128 + int(getattr(interrupt, "signum", signal.SIGINT))


class GracefulInterrupt(Callback):
    """Stops training at the next batch boundary after SIGINT/SIGTERM and writes a resumable checkpoint there.

    After the fit, :attr:`signal_received` is the signal that stopped it (``None`` if none) and
    :attr:`checkpoint_path` the checkpoint written.
    """

    def __init__(self) -> None:
        self.signal_received: int | None = None
        self.checkpoint_path: Path | None = None
        self._previous: dict[int, Any] = {}

    # ---------------------------------------------------------------- signal handlers
    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_received is not None:
            # The second signal: the user wants out now. Lightning's KeyboardInterrupt path tears down (and gives
            # SIGINT back); the exception names the signal for the exit status (abort_status).
            self._restore_handlers()
            print(f"peftplug: {signal.Signals(signum).name} received again: aborting now, without a checkpoint",
                  file=sys.stderr, flush=True)
            raise SignalAbort(signum)
        self.signal_received = signum
        print(f"peftplug: {signal.Signals(signum).name} received: finishing the current optimizer step (with gradient "
              "accumulation, its last micro-batch), then writing a checkpoint and stopping (send it again to abort "
              "at once)", file=sys.stderr, flush=True)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                # Ignored by whoever started us (nohup, a background shell's `&` for SIGINT): leave it ignored,
                # as Python itself does for SIGINT, instead of turning a signal the launcher shut off into a stop.
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Acts as if ``signum`` had been received (for tests and for code that decides to stop a run).

        Args:
            signum: The signal to record.
        """
        self.signal_received = signum

    # ---------------------------------------------------------------- Lightning hooks
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Takes over SIGINT and SIGTERM (after Lightning installed its own SIGTERM handler); on a resume, applies
        the training loader's saved position if Lightning loaded the loader too early to
        (:func:`peftplug.resume.restore_loader_position`), so that the resumed run trains the batches the
        interrupted one had not."""
        from peftplug.resume import restore_loader_position

        self.signal_received, self.checkpoint_path = None, None
        restore_loader_position(trainer)
        self._install_handlers()

    @staticmethod
    def _accumulating(trainer: Any) -> bool:
        """Whether the batch that just ended left gradients accumulated for a later optimizer step (Lightning's own
        test: the window is full, or it is the epoch's last batch, else it accumulates)."""
        if trainer.accumulate_grad_batches <= 1:
            return False
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())

    def _any_rank_signalled(self, trainer: Any) -> bool:
        flag = torch.tensor(0.0 if self.signal_received is None else 1.0, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="sum")
        return bool(flag.item() > 0)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """At the optimizer-step boundary after a signal: writes the checkpoint and asks the trainer to stop.

        Inside a gradient-accumulation window (``accumulate_grad_batches`` > 1) it waits for the window's last
        micro-batch: a checkpoint holds no accumulated gradients, so one written mid-window would resume with them
        lost and the run would no longer equal the uninterrupted one. Every rank has the same window, so the ranks
        still all-reduce the flag at the same batches.
        """
        if trainer.should_stop or self._accumulating(trainer) or not self._any_rank_signalled(trainer):
            return
        if self.signal_received is None:  # another rank got it
            self.signal_received = signal.SIGTERM
        self._write_checkpoint(trainer)
        # Lightning ignores should_stop until the recipe's min_epochs / min_steps are met ("Training will
        # continue..."): the run would go on past the checkpoint it just announced. A stop the user asked for outranks
        # the minimum (the resumed run rebuilds its trainer from the recipe, minimums included).
        trainer.fit_loop.min_epochs = None
        trainer.fit_loop.epoch_loop.min_steps = None
        self._stop_without_early_stop_validation(trainer)

    def _write_checkpoint(self, trainer: Any) -> None:
        """Writes ``last.ckpt`` (:func:`interrupt_checkpoint_path`) on every rank and says so on rank zero.

        Args:
            trainer: The trainer, at an optimizer-step boundary.
        """
        path = interrupt_checkpoint_path(trainer)
        checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        for callback in checkpoints:
            if callback.save_last and callback.dirpath and Path(callback.dirpath) == path.parent:
                # This file is now the callback's "last" (recorded in the checkpoint's callback state): the resumed
                # run then overwrites it instead of writing last-v1.ckpt beside a stale last.ckpt.
                callback.last_model_path = str(path)
        trainer.save_checkpoint(path)
        self.checkpoint_path = path
        # ModelCheckpoint would otherwise save again when the stopped epoch "ends" (on_validation_end,
        # on_train_epoch_end, and with save_last on_train_end if it had saved nothing yet): a checkpoint marked as the
        # end of an epoch that was cut short, one epoch ahead, newer than this one and so what `--ckpt_path last` takes.
        for callback in checkpoints:
            callback._last_global_step_saved = trainer.global_step
            callback._last_checkpoint_saved = callback._last_checkpoint_saved or str(path)
        if trainer.is_global_zero:
            print(f"peftplug: stopped at step {trainer.global_step}; checkpoint written to {path} (resume with "
                  "--ckpt_path last or this path)", file=sys.stderr, flush=True)

    @staticmethod
    def _stop_without_early_stop_validation(trainer: Any) -> None:
        """Sets ``trainer.should_stop``, skipping the validation that Lightning runs only because of it.

        Lightning validates before every early stop (``_should_check_val_fx`` is true once ``should_stop`` is set), so
        a Ctrl-C waited for a pass over the whole validation set after the checkpoint had been written. That pass is
        skipped unless validation was due after this batch anyway (``val_check_interval``, the epoch's end): a resumed
        run fast-forwards past a validation due at its checkpoint's batch, so that one would never run otherwise.

        Args:
            trainer: The trainer.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        try:  # Lightning 2.6's private loop API: another release without it just validates, as before
            due = epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)  # before should_stop forces it
        except (AttributeError, TypeError):
            due = True
        trainer.should_stop = True
        if not due and hasattr(epoch_loop, "_skip_next_val"):
            epoch_loop._skip_next_val = True  # read (and cleared) by this batch's on_advance_end

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Writes the announced checkpoint if the signal came after the last batch boundary; gives SIGINT and
        SIGTERM back.

        A signal during the final validation (or after the last step's ``on_train_batch_end``) met no further batch
        boundary: the run exited with 130/143 and skipped ``evaluate_after_fit`` like a stopped run, yet wrote no
        checkpoint, and with ``enable_checkpointing: false`` the finished training was lost. The loops are at the
        end of the run here (``ModelCheckpoint`` saves here too), so the checkpoint resumes to a fit with nothing
        left to train.
        """
        # checkpoint_path is the same on every rank (set by the all-reduced boundary), so all ranks all-reduce here.
        if self.checkpoint_path is None and self._any_rank_signalled(trainer):
            if self.signal_received is None:  # another rank got it
                self.signal_received = signal.SIGTERM
            self._write_checkpoint(trainer)
        self._restore_handlers()

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        """Ends ``predict`` after the batch in which a SIGTERM came, as Lightning's other loops do.

        Lightning's SIGTERM handler only sets a flag, which its prediction loop never reads: ``kill PID`` was
        ignored until every batch was predicted. The ``SIGTERMException`` it raises elsewhere exits 143 here too
        (:func:`abort_status`).
        """
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Gives SIGINT and SIGTERM back if training ended by an exception."""
        self._restore_handlers()


__all__ = ["GracefulInterrupt", "SignalAbort", "abort_status", "interrupt_checkpoint_path"]
