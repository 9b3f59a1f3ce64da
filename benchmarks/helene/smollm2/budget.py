"""Zeroth-order optimizers at equal forward passes (issue 27): which runs, in which order, at which lr.

The protocol is the SmolLM2 grid's (:mod:`benchmarks.helene.smollm2.grid`: MeZO's prompt protocol, SST-2 k=16,
split seeds 42 and 13, batch 16, full parameters, ε = 1e-3, plain template, max_length 256, the full 872-example
test set), but a run's length is a budget of **forward passes over a training batch**, counted by the optimizer's
own ``forward_passes`` counter, not a number of steps: MeZO's 300 steps are 600 forward passes, FZOO with N probes
spends N + 1 per step, HELENE with HiZOO's curvature 3 on its refresh steps. The test set is evaluated at the first
step whose counter reaches each of :data:`TEST_BUDGETS`, the 32-example dev set every ~:data:`DEV_EVERY` forward
passes. One run: :mod:`benchmarks.helene.smollm2.budget_run`; the commands: :mod:`benchmarks.helene.smollm2.budget_cli`;
the page: :mod:`benchmarks.helene.smollm2.budget_report`.

The queue, in the order the runs start (``--shard I/N`` processes share it without overlap):

1. ``sweep``: each new optimizer's lr on SST-2 seed 42 at a budget of :data:`SWEEP_BUDGET` forward passes
   (:data:`GRIDS`; selection = lowest mean training loss over the last third of the steps, non-finite runs excluded;
   a decade beyond the grid's edge while the best point sits on it, at most twice). MeZO, MeZO-Rademacher and
   ZO-Adam take the grid's selected lrs (:data:`FIXED_LR`), so they need no sweep.
2. ``main``: SST-2, both seeds, 600 forward passes, in the order FZOO with the better N, HELENE-scalar, MeZO,
   MeZO-Rademacher, ZO-Adam, then the rest (:data:`MAIN_ORDER`); seed 42 before 13 within each.
3. ``cr``: the second task. AdamW-LoRA r=8 with the grid's settings (lr 1e-3, 300 steps = 300 forward passes,
   each with a backward) checks that SmolLM2 learns CR from k=16; then MeZO and the two candidates
   (:data:`BEST_CANDIDATES`) with the best mean SST-2 test accuracy at 600 forward passes, at their SST-2 lrs.
4. ``nf4``: SmolLM2 in nf4 with an OFTv2 adapter (block 32, every linear layer), MeZO and the best new optimizer:
   an lr sweep of each on seed 42 (adapter parameters start at 0, so the full-parameter lrs need not carry over),
   then 600 forward passes on both seeds.
5. ``followup``: runs outside the rule above (an lr no sweep chose), each with why (:func:`follow_ups`); the page
   shows them in a table of their own, beside the queue's run they question, never in the comparison.
6. ``seed21``: a third split seed (:data:`THIRD_SEED`) for MeZO and the optimizer that met the target
   (:data:`THIRD_SEED_METHODS`), same settings as their mains; the tables keep the two-seed means of
   :data:`SEEDS`, and the page adds the three-seed means in a table of its own.

A queue position whose optimizer is not known yet (the better FZOO, the best optimizers) is a *slot*: it holds its
place in the queue while it waits, so the shard that owns it never changes when sweeps or runs finish elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from benchmarks.common.paths import results_dir
from benchmarks.helene.smollm2 import grid
from benchmarks.helene.smollm2.runs import OPTIMIZERS, RunSpec

#: Result files (one JSON per run) and journals of unfinished runs, committed (see docs/benchmarks/README.md).
CACHE = results_dir("helene") / "helene_budget"
RUNS = CACHE / "runs"
PARTIAL = CACHE / "partial"

SEEDS = (42, 13)
SWEEP_SEED = 42
#: MeZO's 300 steps at two forward passes each: the budget every optimizer gets.
BUDGET = 600
#: Full test-set evaluations: the moonshot (0.2×), target (0.5×) and full-budget points.
TEST_BUDGETS = (120, 300, 600)
SWEEP_BUDGET = 120
#: Dev-set evaluation every this many forward passes (rounded to whole steps of each optimizer).
DEV_EVERY = 60
MAX_TEST = {"sst2": 872, "cr": 1000}  # every test example
SWEEP_MAX_TEST = 200
#: The grid's first-order check (AdamW-LoRA r=8, lr 1e-3, 300 steps; one forward and one backward a step).
ADAMW_STEPS = 300
#: The new optimizers and their lr grids (3-4 values, seed 42, SWEEP_BUDGET forward passes). On SST-2 MeZO's
#: projected gradient c = (L+ − L−)/2ε has an rms of ~10 (grid, seed 42), so at its lr 1e-4 a coordinate moves
#: ~1e-3 a step. FZOO's step is normalised by σ: Σ(lᵢ − l0)uᵢ/(Nσ) has a per-coordinate size of ~1/√N, so lr
#: 2e-3 (N=4) to 3e-3 (N=8) is MeZO's per-coordinate step; the grid spans 1e-4..3e-3 (the issue's unswept probe ran
#: 1e-3 and 4e-3). HELENE-scalar's m/√s is O(1) per coordinate (m sums ~2-3 noisy estimates of c·z at β1 = 0.9), so
#: 3e-4 is MeZO's step size. HiZOO-style HELENE keeps the λ = 1 floor (curvature estimates ≪ 1), so it behaves like
#: the annealing-only ablation, whose grid selected 1e-5.
GRIDS = {
    "fzoo4": (1e-4, 3e-4, 1e-3, 3e-3),
    "fzoo8": (1e-4, 3e-4, 1e-3, 3e-3),
    "helene_scalar": (3e-5, 1e-4, 3e-4, 1e-3),
    "helene_scalar_bc": (3e-5, 1e-4, 3e-4, 1e-3),
    "hizoo": (1e-6, 1e-5, 1e-4),
}
#: ZO on nf4 + OFTv2: the adapter's rotation parameters start at 0 and are far fewer (the step moves ~1e-3 × lr/MeZO
#: lr per coordinate), so the grids reach higher.
NF4_GRIDS = {"mezo_nf4": (1e-4, 1e-3, 1e-2), "fzoo4_nf4": (1e-4, 1e-3, 1e-2), "fzoo8_nf4": (1e-4, 1e-3, 1e-2),
             "helene_scalar_nf4": (1e-4, 1e-3, 1e-2), "helene_scalar_bc_nf4": (1e-4, 1e-3, 1e-2),
             "hizoo_nf4": (1e-5, 1e-4, 1e-3)}
#: The baselines at the grid's selected lrs (MeZO-Rademacher runs at MeZO's, as in the grid's follow-up).
FIXED_LR_OF = {"mezo": "mezo", "mezo_rademacher": "mezo", "zoadam": "zoadam", "adamw_lora": "adamw_lora"}
NEW = tuple(GRIDS)
#: The optimizers this issue adds (FZOO at both N, HELENE's repaired default) compete for the CR and nf4 slots;
#: the bias-correction ablation and HiZOO (in the library before) are measured too but do not gate those phases,
#: so the second task and the 4-bit runs need not wait for their mains.
BEST_CANDIDATES = ("fzoo4", "fzoo8", "helene_scalar")
#: Main-phase order; "fzoo_best" / "fzoo_other" are slots filled once both FZOO sweeps have selected their lr.
MAIN_ORDER = ("fzoo_best", "helene_scalar", "mezo", "mezo_rademacher", "zoadam", "fzoo_other", "helene_scalar_bc",
              "hizoo")
SWEEP_SCORE_FRACTION = 1 / 3
MAX_EXTENSIONS = 2
#: The issue's "seed 21 if time allows", for the headline pair only (MeZO and FZOO N=8, which met the target on two
#: seeds): whether the ratio and the final accuracy hold on a third split. Queued after the follow-ups.
THIRD_SEED = 21
THIRD_SEED_METHODS = ("mezo", "fzoo8")
PHASES = ("all", "sweep", "main", "cr", "nf4", "followup", f"seed{THIRD_SEED}")


@dataclass(frozen=True)
class BudgetSpec:
    """The exact settings of one run at a budget of forward passes.

    Args:
        task: Prompt task (``sst2``, ``cr``).
        split_seed: k-shot split seed (also the optimizer's and the shuffle's seed).
        method: A key of :data:`benchmarks.helene.smollm2.runs.OPTIMIZERS`.
        lr: Learning rate.
        budget: Forward passes over a training batch (the optimizer's counter; AdamW: steps).
        purpose: ``main``, ``sweep`` (lr selection), ``cr``, ``nf4`` or ``followup`` (the phase it belongs to;
            the third seed's runs are ``main`` runs of another seed, queued in phase ``seed21``).
        tests: Forward-pass counts at which the test set is evaluated (the last is ``budget``).
        dev_every: Dev-set evaluation every ~this many forward passes.
        k: Shots per class.
        batch_size: Training batch size.
        eps: Zeroth-order perturbation scale.
        fmt: Prompt rendering, ``plain`` or ``chat``.
        max_test: Test examples used at most.
        max_length: Prompt tokens at most.
    """

    task: str
    split_seed: int
    method: str
    lr: float
    budget: int = BUDGET
    purpose: str = "main"
    tests: tuple[int, ...] = TEST_BUDGETS
    dev_every: int = DEV_EVERY
    k: int = 16
    batch_size: int = 16
    eps: float = 1e-3
    fmt: str = "plain"
    max_test: int = 872
    max_length: int = 256

    def __post_init__(self) -> None:
        if self.method not in OPTIMIZERS:
            raise ValueError(f"method: no optimizer {self.method!r}; known: {', '.join(OPTIMIZERS)}")
        if not (isinstance(self.budget, int) and self.budget >= 1):
            raise ValueError(f"budget must be an int >= 1 (forward passes), got {self.budget!r}")
        if not self.tests or list(self.tests) != sorted(set(self.tests)) or self.tests[-1] != self.budget:
            raise ValueError(f"tests must be increasing forward-pass counts ending at the budget {self.budget}, "
                             f"got {self.tests!r}")

    @property
    def run_id(self) -> str:
        """File name of the run's result."""
        base = f"{self.task}_k{self.k}_s{self.split_seed}_{self.method}_{self.fmt}"
        if self.max_length != 256:
            base += f"_L{self.max_length}"
        return f"{base}_lr{self.lr:g}_f{self.budget}_b{self.batch_size}_t{self.max_test}_{self.purpose}"

    @classmethod
    def from_settings(cls, settings: dict) -> BudgetSpec:
        """The spec whose :meth:`settings` these are (a result's or journal's ``spec``).

        Args:
            settings: The stored settings.
        """
        return cls(**{**settings, "tests": tuple(settings["tests"])})

    def settings(self) -> dict:
        """The settings as JSON stores them (tuples become lists): a journal is replayed only if they match."""
        out = asdict(self)
        out["tests"] = list(self.tests)
        return out

    @property
    def forwards_per_step(self) -> float:
        """The optimizer's planning number of forward passes per step."""
        return OPTIMIZERS[self.method].forwards_per_step

    def planned_steps(self) -> int:
        """Steps the budget takes at :attr:`forwards_per_step` (HELENE's annealing horizon is 10% of it)."""
        return math.ceil(self.budget / self.forwards_per_step)

    def max_steps(self) -> int:
        """An upper bound on the steps to the budget (every step makes at least ⌊forwards_per_step⌋ forwards);
        the run stops at the counter, not here."""
        return math.ceil(self.budget / max(1, math.floor(self.forwards_per_step)))

    def dev_steps(self) -> int:
        """Steps between two dev evaluations: ~:attr:`dev_every` forward passes."""
        return max(1, round(self.dev_every / self.forwards_per_step))

    def run_spec(self) -> RunSpec:
        """The grid's :class:`RunSpec` of the same run (what :func:`benchmarks.helene.smollm2.runs.build` takes)."""
        return RunSpec(self.task, self.split_seed, self.method, lr=self.lr, steps=self.max_steps(),
                       purpose=self.purpose, k=self.k, batch_size=self.batch_size, eps=self.eps, fmt=self.fmt,
                       max_test=self.max_test, eval_every=self.dev_steps(), max_length=self.max_length)


def result_path(spec: BudgetSpec):
    """Where the result JSON of ``spec`` lives."""
    return RUNS / f"{spec.run_id}.json"


def load_result(spec: BudgetSpec) -> dict | None:
    """The result of ``spec``, or ``None`` while it has not finished."""
    from benchmarks.common.pages import read_json

    return read_json(result_path(spec))


# ------------------------------------------------------------------------------------------------- lr sweeps
def _grid_of(method: str) -> tuple[float, ...]:
    return GRIDS.get(method) or NF4_GRIDS[method]


def _sweep_spec(method: str, lr: float) -> BudgetSpec:
    return BudgetSpec("sst2", SWEEP_SEED, method, lr, budget=SWEEP_BUDGET, purpose="sweep", tests=(SWEEP_BUDGET,),
                      max_test=SWEEP_MAX_TEST)


def sweep_score(result: dict) -> float:
    """Mean training loss over the last third of the steps (inf when a step was not finite)."""
    steps = result["steps"]
    losses = [s["loss"] for s in steps[-max(1, math.ceil(len(steps) * SWEEP_SCORE_FRACTION)):]]
    if result.get("nonfinite_steps") or not losses or any(v is None or not math.isfinite(v) for v in losses):
        return float("inf")
    return sum(losses) / len(losses)


def sweep_specs(method: str) -> list[BudgetSpec]:
    """One optimizer's lr sweep: its grid, then a decade beyond an edge while the best finished point sits there
    (at most :data:`MAX_EXTENSIONS` times; as :func:`benchmarks.helene.smollm2.grid.extension_specs`)."""
    points = [_sweep_spec(method, lr) for lr in _grid_of(method)]
    for _ in range(MAX_EXTENSIONS):
        results = [load_result(s) for s in points]
        if any(r is None for r in results):
            break
        scores = [sweep_score(r) for r in results]
        best = min(range(len(points)), key=scores.__getitem__)
        lrs = [s.lr for s in points]
        if scores[best] == float("inf") or min(lrs) < lrs[best] < max(lrs):
            break
        lr = max(lrs) * 10 if lrs[best] == max(lrs) else min(lrs) / 10
        points.append(_sweep_spec(method, float(f"{lr:.6g}")))
    return points


def selected(method: str) -> tuple[float | None, float]:
    """(lr, its sweep score) of ``method``: the sweep's best, ``(None, inf)`` until every point has finished or
    when all diverged; a baseline's fixed lr (score nan)."""
    if method in FIXED_LR_OF:
        return grid.selected_lr(FIXED_LR_OF[method]), float("nan")
    results = [load_result(s) for s in sweep_specs(method)]
    if any(r is None for r in results):
        return None, float("inf")
    best = min(results, key=sweep_score)
    score = sweep_score(best)
    return (best["spec"]["lr"], score) if score < float("inf") else (None, float("inf"))


def sweep_diverged(method: str) -> bool:
    """Whether every point of ``method``'s sweep has finished with a non-finite loss (no lr can be selected)."""
    if method in FIXED_LR_OF:
        return False
    results = [load_result(s) for s in sweep_specs(method)]
    return all(r is not None and sweep_score(r) == float("inf") for r in results)


def fzoo_order() -> tuple[str, str] | None:
    """(better, other) FZOO variant by sweep score once both sweeps have selected an lr, else ``None``."""
    scores = {m: selected(m) for m in ("fzoo4", "fzoo8")}
    if any(lr is None and not sweep_diverged(m) for m, (lr, _) in scores.items()):
        return None
    return tuple(sorted(scores, key=lambda m: scores[m][1]))  # type: ignore[return-value]


def best_new(count: int, task: str = "sst2") -> list[str] | None:
    """The ``count`` candidates (:data:`BEST_CANDIDATES`) with the highest mean test accuracy at the full budget on
    ``task`` (both seeds), once every candidate's main runs there have finished (``None`` before; one whose sweep
    diverged does not count)."""
    means = {}
    for method in BEST_CANDIDATES:
        lr, _ = selected(method)
        if lr is None:
            if sweep_diverged(method):
                continue
            return None
        results = [load_result(main_spec(task, seed, method, lr)) for seed in SEEDS]
        if any(r is None for r in results):
            return None
        means[method] = sum(r["test_acc"] for r in results) / len(results)
    return sorted(means, key=lambda m: -means[m])[:count]


# ------------------------------------------------------------------------------------------------- the queue
def main_spec(task: str, seed: int, method: str, lr: float) -> BudgetSpec:
    """One full-budget run (AdamW-LoRA: the grid's 300 steps, one test point)."""
    if method == "adamw_lora":
        return BudgetSpec(task, seed, method, lr, budget=ADAMW_STEPS, purpose="cr" if task == "cr" else "main",
                          tests=(ADAMW_STEPS,), dev_every=30, max_test=MAX_TEST[task])
    purpose = "nf4" if method.endswith("_nf4") else ("cr" if task == "cr" else "main")
    return BudgetSpec(task, seed, method, lr, purpose=purpose, max_test=MAX_TEST[task])


#: (item name ``<phase prefix>:<slot>:<point>``, spec or None, why it waits), in queue order.
Item = tuple[str, "BudgetSpec | None", str]


def _runs_of(prefix: str, slot: str, method: str | None, task: str, why: str,
             seeds: tuple[int, ...] = SEEDS) -> list[Item]:
    """One queue position per seed of ``seeds`` for ``method`` (``None``: not known yet, ``why``)."""
    items: list[Item] = []
    for seed in seeds:
        name = f"{prefix}:{slot}:s{seed}"
        if method is None:
            items.append((name, None, why))
            continue
        lr, _ = selected(method)
        waits = "" if lr is not None else (f"every point of {method}'s lr sweep diverged" if sweep_diverged(method)
                                           else f"waits for {method}'s lr sweep")
        items.append((name, None if lr is None else main_spec(task, seed, method, lr), waits))
    return items


def _sweep_items(slot: str, method: str | None, points: int, why: str = "") -> tuple[list[Item], list[Item]]:
    """(the grid's points, the edge extensions so far) of one sweep as queue items."""
    if method is None:
        return [(f"sweep:{slot}:p{i}", None, why) for i in range(points)], []
    specs = sweep_specs(method)
    return ([(f"sweep:{slot}:p{i}", s, "") for i, s in enumerate(specs[:points])],
            [(f"sweep:{slot}:x{i}", s, "") for i, s in enumerate(specs[points:])])


def queue() -> list[Item]:
    """Every run of the study in start order (see the module docstring); waiting ones as ``(name, None, why)``."""
    items: list[Item] = []
    sweeps = [_sweep_items(method, method, len(GRIDS[method])) for method in NEW]
    # Edge extensions appear while shards run, so they go after every grid point (shard_members gives them the
    # shard of their sweep's first point).
    items += [item for base, _ in sweeps for item in base] + [item for _, ext in sweeps for item in ext]
    order = fzoo_order()
    for slot in MAIN_ORDER:
        if slot.startswith("fzoo_"):
            method = None if order is None else order[0 if slot == "fzoo_best" else 1]
            items += _runs_of("sst2", slot, method, "sst2", "waits for both FZOO sweeps (fzoo4, fzoo8)")
        else:
            items += _runs_of("sst2", slot, slot, "sst2", "")
    best = best_new(2)
    why = f"waits for the candidates' SST-2 runs (the best ones: {', '.join(BEST_CANDIDATES)})"
    items += _runs_of("cr", "adamw_lora", "adamw_lora", "cr", "")
    items += _runs_of("cr", "mezo", "mezo", "cr", "")
    for rank in range(2):
        items += _runs_of("cr", f"best{rank + 1}", None if best is None else best[rank], "cr", why)
    nf4 = [("nf4-mezo", "mezo_nf4"), ("nf4-best", None if best is None else f"{best[0]}_nf4")]
    nf4_sweeps = [_sweep_items(slot, method, 3, why) for slot, method in nf4]
    items += [item for base, _ in nf4_sweeps for item in base] + [item for _, ext in nf4_sweeps for item in ext]
    for slot, method in nf4:
        items += _runs_of("nf4", slot, method, "sst2", why)
    # Appended last, so no earlier item changes shard; they never wait (their reasons: follow_ups()).
    items += [(name, spec, "") for name, spec, _ in follow_ups()]
    # After the follow-ups for the same reason (added once they were all queued).
    for method in THIRD_SEED_METHODS:
        items += _runs_of(f"seed{THIRD_SEED}", method, method, "sst2", "", seeds=(THIRD_SEED,))
    return items


def follow_ups() -> list[Item]:
    """Runs outside the queue's rule, added after reading finished runs (queue items ``followup:<slot>:s<seed>``).

    The nf4 mains at their sweep's lrs diverge: the training loss rises again (FZOO N=8 after its 0.657 at 120
    forward passes; MeZO, 0.557 at 120, from ~100 steps on), and MeZO's projected gradient on the rotation
    parameters is ≈ 4× the full-parameter one (docs/helene.md, "Two ways an early peak is lost"). Each follow-up
    changes one thing, the lr, to test that reading: FZOO N=8 at its fp32 lr (3e-3, a third of the sweep's 1e-2;
    its σ-normalised step does not scale with the gradient), MeZO at a tenth of its sweep's 1e-4; then the
    FZOO one on the second seed, since on seed 42 it ended above the full-precision run. Last, the scalar HELENE
    (the repaired default) at its grid's next smaller lr on both seeds: at the sweep's 1e-4 it peaks by 120 passes
    and falls (0.669 → 0.632), as every sweep-chosen lr that diverged or overfit here.
    """
    fzoo_why = "the sweep's 1e-2 peaks at 120 passes, then diverges: at FZOO N=8's fp32 lr instead"
    mezo_why = "at the sweep's 1e-4 the training loss rises after ~100 steps: a tenth of it"
    fzoo_s13_why = "FZOO N=8 at 3e-3 on seed 42 ended above its fp32 run: the second seed, so the nf4 row is a mean"
    helene_why = "the sweep's 1e-4 peaks at 120 passes and falls by 600: the grid's next smaller lr"
    # New entries go last, so the ones before keep their queue positions (and shards).
    runs_ = [("fzoo8-nf4-lr3e-3", "fzoo8_nf4", 3e-3, SEEDS[0], fzoo_why),
             ("mezo-nf4-lr1e-5", "mezo_nf4", 1e-5, SEEDS[0], mezo_why),
             ("fzoo8-nf4-lr3e-3", "fzoo8_nf4", 3e-3, SEEDS[1], fzoo_s13_why),
             *[("helene-scalar-lr3e-5", "helene_scalar", 3e-5, seed, helene_why) for seed in SEEDS]]
    return [(f"followup:{slot}:s{seed}", BudgetSpec("sst2", seed, method, lr, purpose="followup",
                                                   max_test=MAX_TEST["sst2"]), why)
            for slot, method, lr, seed, why in runs_]


def in_phase(name: str, phase: str) -> bool:
    """Whether the queue item ``name`` belongs to ``phase`` (one of :data:`PHASES`)."""
    kind, slot, _ = name.split(":")
    if phase == "all":
        return True
    if kind == "sweep":
        return phase == ("nf4" if slot.startswith("nf4") else "sweep")
    return kind == {"main": "sst2"}.get(phase, phase)


def shard_members(phase: str, shard: tuple[int, int]) -> list[BudgetSpec]:
    """The runnable runs of ``phase`` that belong to shard ``(I, N)``, in queue order.

    Every item except the sweeps' edge extensions has a fixed position (a waiting slot keeps its place) and
    belongs to shard ``position % N``; the extensions of one sweep (a chain, each waiting for the one before)
    belong to the shard of that sweep's first point.
    """
    index, count = shard
    mine, position, owner_of = [], 0, {}
    for name, spec, _ in queue():
        kind, slot, point = name.split(":")
        if kind == "sweep" and point.startswith("x"):
            owner = owner_of[slot]
        else:
            owner, position = position % count, position + 1
            owner_of.setdefault(slot, owner)
        if spec is not None and owner == index and in_phase(name, phase):
            mine.append(spec)
    return mine


def waiting(phase: str = "all") -> list[str]:
    """The items of ``phase`` that cannot start yet, with why."""
    return [f"{name}: {why}" for name, spec, why in queue() if spec is None and in_phase(name, phase)]
