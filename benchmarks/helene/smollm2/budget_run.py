"""One run at a budget of forward passes (:class:`benchmarks.helene.smollm2.budget.BudgetSpec`), and its replay.

A run is the grid's run (:func:`benchmarks.helene.smollm2.runs.execute`: PeftModule + Lightning, the journal of
closure values that makes an interrupted zeroth-order run resume bit for bit) with :class:`BudgetHooks` added:

- after every step the optimizer's own ``forward_passes`` counter is recorded in the step's row (first-order
  AdamW: one forward per step), beside its loss and wall time;
- at the first step whose counter reaches each of the spec's ``tests`` budgets the test set is evaluated (the last
  one is the grid's own ``trainer.test`` after the stop, so the last budget's point *is* the result's ``test_acc``);
- the run stops at the step whose counter reaches the budget;
- HELENE's annealing horizon ("auto": 10% of the run) is told the planned steps to the budget, not the upper bound
  Lightning's ``max_steps`` is set to.

The result (``benchmarks/helene/results/helene_budget/runs/<run_id>.json``) is the grid's (commit, seconds,
threads, per-step losses and timings, dev curve, closure values, peak RSS, ...) plus ``tests`` (one point per
budget: forward passes, step, accuracy, loss, wall seconds of the training steps so far) and ``cpu_flags``.

:func:`replay` runs a recorded result again from its journal of closure values and its seed alone: the optimizer
steps answer from the journal (no training forwards), the dev points are recomputed and checked on the way, the
test points and final test accuracy recomputed at the end and compared with the record.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.common.device import to_device
from benchmarks.common.provenance import cpu_flags
from benchmarks.helene.smollm2 import budget, runs
from benchmarks.helene.smollm2.budget import BudgetSpec
from benchmarks.helene.smollm2.journal import ReplayMismatch, partial_path


def forward_passes(trainer) -> int:
    """Forward passes over a training batch so far: a zeroth-order optimizer's own counter (closure calls, which a
    journal replay makes too), else the steps (one forward, plus its backward, each)."""
    opt = trainer.optimizers[0] if trainer.optimizers else None
    counter = getattr(opt, "forward_passes", None)
    return int(counter) if counter is not None else int(trainer.global_step)


@torch.no_grad()
def evaluate(module, loader) -> dict:
    """Loss and accuracy of ``module`` over ``loader``, computed as ``PeftModule``'s test epoch computes them (fp32
    sums of per-batch mean loss × batch size and of correct answers, divided once), so the value at the last budget
    equals ``trainer.test``'s bit for bit.

    Args:
        module: A PeftModule with ``task="prompt_cls"``.
        loader: Batches of :class:`peftplug.prompt_cls.PromptClassificationData`.
    """
    from peftplug.lightning import model_inputs

    training = module.model.training
    module.model.eval()
    zero = torch.zeros((), device=module.device)
    loss_sum, correct, count = zero.clone(), zero.clone(), zero.clone()
    for batch in loader:
        batch = to_device(batch, module.device)
        output = module(**model_inputs(batch))
        n = torch.tensor(batch["labels"].shape[0], device=module.device)
        loss_sum = loss_sum + (output.loss.detach().float() * n).float()
        correct = correct + (output.logits.argmax(-1) == batch["labels"]).sum().float()
        count = count + n.float()
    module.model.train(training)
    return {"acc": float(correct / count), "loss": float(loss_sum / count), "n": int(count)}


class BudgetHooks(runs.RunHooks):
    """The budget study's identity, files, test points, stop rule and forward-pass bookkeeping for one run.

    Args:
        spec: The run.
        results: Folder of result files (default :data:`benchmarks.helene.smollm2.budget.RUNS`).
        partial: Folder of journals (default :data:`benchmarks.helene.smollm2.budget.PARTIAL`).
    """

    def __init__(self, spec: BudgetSpec, results: Path | None = None, partial: Path | None = None) -> None:
        super().__init__(spec.run_spec())
        self.budget_spec = spec
        self.results = results
        self.partial = partial
        self.tests: list[dict] = []

    @property
    def run_id(self) -> str:
        """The budget run's name."""
        return self.budget_spec.run_id

    def settings(self) -> dict:
        """The budget spec's settings (a journal replays only with exactly these)."""
        return self.budget_spec.settings()

    def result_path(self) -> Path:
        """Where the finished run's result goes."""
        return (self.results or budget.RUNS) / f"{self.run_id}.json"

    def partial_path(self) -> Path:
        """Where the journal of the unfinished run goes."""
        return partial_path(self.partial or budget.PARTIAL, self.run_id)

    def resume(self, resumed: dict | None) -> None:
        """Keeps the test points a replayed journal has on record (they are not evaluated again)."""
        self.tests = list(resumed.get("tests", [])) if resumed else []

    def fields(self) -> dict:
        """Test points and the CPU's flags, in the journal and the result."""
        return {"tests": self.tests, "cpu_flags": cpu_flags(), "planned_steps": self.budget_spec.planned_steps()}

    def callbacks(self, module, data, recorder, flush) -> list:
        """The budget callback (after the recorder's, so that the step's row exists when it writes into it)."""
        import lightning as L

        spec, hooks = self.budget_spec, self

        class Budget(L.Callback):
            def on_train_start(self, trainer, pl_module):
                opt = trainer.optimizers[0]
                if hasattr(opt, "set_total_steps"):
                    # max_steps is an upper bound; HELENE's horizon follows the steps the budget is planned to take.
                    opt.set_total_steps(spec.planned_steps())

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                passes = forward_passes(trainer)
                if trainer.global_step > recorder.replayed and recorder.steps:
                    recorder.steps[-1]["forward_passes"] = passes
                on_record = {t["budget"] for t in hooks.tests}
                for target in spec.tests[:-1]:
                    if passes >= target and target not in on_record:
                        # A budget's point is the first step at which the counter reaches it.
                        point = evaluate(pl_module, data.test_dataloader())
                        hooks.tests.append({"budget": target, "forward_passes": passes, "step": trainer.global_step,
                                            "acc": point["acc"], "loss": point["loss"],
                                            "train_seconds": sum(r["time"] for r in recorder.steps)})
                        print(f"  {hooks.run_id}: test at {passes} forward passes (step {trainer.global_step}): "
                              f"{point['acc']:.4f}", flush=True)
                        if flush is not None:
                            flush()
                if passes >= spec.budget:
                    trainer.should_stop = True

        return [Budget()]


def execute(spec: BudgetSpec, results: Path | None = None, partial: Path | None = None) -> dict:
    """Runs ``spec`` to its budget (resuming from its journal when one is on disk) and writes its result.

    Args:
        spec: The run.
        results: Folder of result files (default: the committed one).
        partial: Folder of journals (default: the committed one).
    """
    hooks = BudgetHooks(spec, results, partial)
    result = runs.execute(spec.run_spec(), hooks)
    return finish(result, hooks)


def finish(result: dict, hooks: BudgetHooks) -> dict:
    """Adds the last budget's test point (the run's own ``trainer.test``) to a finished result and rewrites it."""
    spec = hooks.budget_spec
    steps = result["steps"]
    last = steps[-1] if steps else {}
    passes = last.get("forward_passes", 0)
    if passes < spec.budget:
        raise RuntimeError(f"{spec.run_id}: stopped at {passes} forward passes, short of its budget {spec.budget}")
    if not any(t["budget"] == spec.budget for t in result["tests"]):
        result["tests"].append({"budget": spec.budget, "forward_passes": passes, "step": last.get("step", 0),
                                "acc": result["test_acc"], "loss": result["test_loss"],
                                "train_seconds": sum(r["time"] for r in steps)})
        runs._write_json(hooks.result_path(), result)
    return result


def replay(recorded: dict, scratch: Path) -> dict:
    """Runs a recorded zeroth-order result again from its closure values and seed; returns what differs.

    The journal answers every optimizer step (no training forwards; the perturbation, restore and update passes
    run, since they are what moves the parameters), the dev points are recomputed and checked on the way (the first
    that differs ends the replay and is reported), and the test points and the final test accuracy are evaluated
    again.

    Args:
        recorded: A result JSON of this study.
        scratch: Folder for the replay's own files (the committed result is never touched).

    Returns:
        ``{"run_id", "same": bool, "differences": [...], "seconds"}``.
    """
    spec = BudgetSpec.from_settings(recorded["spec"])
    if "closure_values" not in recorded:
        raise ValueError(f"{spec.run_id}: no closure values on record (a first-order run cannot be replayed)")
    hooks = BudgetHooks(spec, scratch / "runs", scratch / "partial")
    # The record as a journal whose every step is on record, and none of its test points: all are evaluated again.
    journal = {"spec": spec.settings(), "run_id": spec.run_id, "device": runs.DEVICE, "segments": [],
               "journal": recorded["closure_values"], "steps": recorded["steps"], "val": recorded["val"],
               "tests": []}
    started = time.time()
    try:
        result = finish(runs._execute(spec.run_spec(), journal, hooks), hooks)
    except ReplayMismatch as err:
        return {"run_id": spec.run_id, "same": False, "differences": [str(err)], "seconds": time.time() - started}
    differences = []
    for key in ("test_acc", "test_loss", "val"):
        if result[key] != recorded[key]:
            differences.append(f"{key}: replayed {result[key]!r}, recorded {recorded[key]!r}")
    replayed = {t["budget"]: (t["forward_passes"], t["step"], t["acc"], t["loss"]) for t in result["tests"]}
    for t in recorded["tests"]:
        again = replayed.get(t["budget"])
        if again != (t["forward_passes"], t["step"], t["acc"], t["loss"]):
            differences.append(f"test at {t['budget']}: replayed {again}, recorded "
                               f"{(t['forward_passes'], t['step'], t['acc'], t['loss'])}")
    return {"run_id": spec.run_id, "same": not differences, "differences": differences,
            "seconds": time.time() - started}
