"""The SmolLM2 grid of the HELENE benchmark: which runs, in which order, at which lr (no I/O beyond reading results).

HELENE vs MeZO vs ZO-Adam vs AdamW-LoRA on SmolLM2-135M-Instruct with MeZO's prompt-based protocol; the commands
that work through this queue and write the page are in :mod:`benchmarks.helene.smollm2.cli`::

    .venv/bin/python -m benchmarks.helene.smollm2 run      # work through the queue (resumable), then write the page
    .venv/bin/python -m benchmarks.helene.smollm2 report   # docs/benchmarks/helene_llm.md from the committed runs
    .venv/bin/python -m benchmarks.helene.smollm2 memory   # peak RSS: inference vs ZO full-parameter vs AdamW
    .venv/bin/python -m benchmarks.helene.smollm2 speed    # ZO step breakdown: forwards vs perturbation passes
    .venv/bin/python -m benchmarks.helene.smollm2 probe    # zero-shot plain vs chat rendering on the seed-42 train+dev
    .venv/bin/python -m benchmarks.helene.smollm2 queue    # print the queue and what has finished
    .venv/bin/python -m benchmarks.helene.smollm2 run --phase followup   # after the core grid: MeZO with Rademacher z

Protocol: LM-BFF/MeZO k-shot splits (k=16 per class, split seeds 42 and 13), the task as a prompt the LM completes
with a label word (``peftplug.prompt_cls``), loss = cross-entropy over the label words at the answer position,
accuracy = argmax over them; test on a fixed subset of the k-shot test file (:data:`MAX_TEST`). Zeroth-order runs
train every parameter (the point of ZO: finetuning at inference memory); AdamW trains LoRA r=8 on the same data.
The lr of each optimizer comes from a 60-step sweep of 3 values on SST-2 seed 42 (lowest mean training loss over
the last 20 steps, non-finite runs excluded), extended a decade at a time (at most twice) while the best point sits
on the grid's edge; RTE uses the SST-2 choice. A new optimizer is an entry of
:data:`benchmarks.helene.smollm2.runs.OPTIMIZERS` plus its lr grid here (:data:`GRIDS`, :data:`PRIORITY`).

Every run is cached as one JSON under ``benchmarks/helene/results/helene_llm/runs/`` (committed, since the grid
spans sessions; see :mod:`benchmarks.helene.smollm2.runs`); ``run`` skips finished runs, so an interrupted queue
resumes where it stopped (a zeroth-order run from its journal, any other from its start). The page says exactly
which runs finished and lists the rest. Run it with one thread per process on a shared machine::

    OMP_NUM_THREADS=1 setsid nohup .venv/bin/python -m benchmarks.helene.smollm2 run > runs/helene_llm/queue.log 2>&1 &
"""

from __future__ import annotations

import math

from benchmarks.helene.smollm2.runs import RunSpec, load_result

TASKS = ("sst2", "rte")
SEEDS = (42, 13)
SWEEP_SEED, SWEEP_TASK, SWEEP_STEPS, MAIN_STEPS = 42, "sst2", 60, 300
MAX_TEST = {"sst2": 872, "rte": 277}  # every test example (an earlier SST-2 zero-shot used a fixed 500)
# RTE premises run to 256+ tokens (train mean 96 at 256); 128 cuts the longest premises (from their end) and halves
# the padded batch width, which is what a CPU step costs. SST-2 prompts are at most 58 tokens.
MAX_LENGTH = {"sst2": 256, "rte": 128}
SWEEP_MAX_TEST = 200
#: Three lr values per optimizer. MeZO's published full-parameter lrs are 1e-7…1e-6 for 1.3B–13B models; a model
#: 10x smaller tolerates larger steps. HELENE's momentum sums ~1/(1−β1) = 10 SPSA estimates, so its grid sits a
#: decade lower; Adam normalises per coordinate; LoRA's first-order lrs are the usual ones.
GRIDS = {
    "mezo": (1e-6, 1e-5, 1e-4),
    "helene": (1e-7, 1e-6, 1e-5),
    "helene_anneal": (1e-7, 1e-6, 1e-5),
    "zoadam": (1e-6, 1e-5, 1e-4),
    "adamw_lora": (1e-4, 3e-4, 1e-3),
}
PRIORITY = ("mezo", "helene", "helene_anneal", "zoadam", "adamw_lora")
#: Follow-up runs after the core grid: optimizer -> the optimizer whose selected lr it takes (no sweep of its own).
#: MeZO with Rademacher z has MeZO's expected update (E[z zᵀ] = I for both), so it runs at MeZO's lr, on the task
#: where MeZO learns: does the cheaper draw (docs/benchmarks/helene_llm.md, step cost) train as well?
FOLLOW_UPS = {"mezo_rademacher": "mezo"}
FOLLOW_UP_TASKS = ("sst2",)
#: Points a sweep may add beyond its grid's edge (see :func:`extension_specs`).
MAX_EXTENSIONS = 2
#: The lrs the sweeps selected when they ran (2026-11-30/12-01, CPU, every grid point and extension finished; the
#: generated table is kept in docs/benchmarks/helene_llm_sweep.md). Their result files sat in the uncommitted
#: runs/ folder and were lost with it, so these stand in for a sweep whose files are absent: the grid's 300-step
#: runs then start at once instead of repeating ~2.5 core-hours of sweeps. A sweep whose files are present (rerun,
#: or on a GPU) always takes precedence.
PINNED_LR = {"mezo": 1e-4, "helene": 1e-4, "helene_anneal": 1e-5, "zoadam": 1e-3, "adamw_lora": 1e-3}


def zero_shot_specs() -> list[RunSpec]:
    """Zero-shot per task on the grid's test set (the test file is the same for every split seed, so one run per
    task suffices), then on the sweeps' fixed test subset, against which the sweep accuracies are read."""
    return [RunSpec(task, SWEEP_SEED, "zeroshot", max_test=MAX_TEST[task], max_length=MAX_LENGTH[task])
            for task in TASKS] + [sweep_zero_shot_spec()]


def sweep_zero_shot_spec() -> RunSpec:
    """Zero-shot on the sweeps' test subset (SST-2, ``SWEEP_MAX_TEST`` examples)."""
    return RunSpec(SWEEP_TASK, SWEEP_SEED, "zeroshot", max_test=SWEEP_MAX_TEST, max_length=MAX_LENGTH[SWEEP_TASK])


def base_sweep_specs(method: str) -> list[RunSpec]:
    """The first three points of one optimizer's 60-step lr sweep (SST-2, seed 42): ``GRIDS[method]``."""
    return [_sweep_spec(method, lr) for lr in GRIDS[method]]


def _sweep_spec(method: str, lr: float) -> RunSpec:
    return RunSpec(SWEEP_TASK, SWEEP_SEED, method, lr=lr, steps=SWEEP_STEPS, purpose="sweep", max_test=SWEEP_MAX_TEST)


def extension_specs(method: str) -> list[RunSpec]:
    """The points added beyond the grid's edge while the best finished point sits on it.

    A sweep whose best lr is its largest (or smallest) value has not bracketed the optimum, and the selected lr is
    then an artefact of where the grid stopped. So once every point so far has finished, one more point a decade
    beyond that edge is added, at most ``MAX_EXTENSIONS`` times per optimizer; selection waits for them. A diverged
    point is never best, so a sweep that blows up at its top extends no further that way.
    """
    points = base_sweep_specs(method)
    added: list[RunSpec] = []
    while len(added) < MAX_EXTENSIONS:
        results = [load_result(s) for s in points]
        if any(r is None for r in results):
            break
        scores = [sweep_score(r) for r in results]
        best = min(range(len(points)), key=scores.__getitem__)
        if scores[best] == float("inf"):
            break
        lrs = [s.lr for s in points]
        if lrs[best] == max(lrs):
            nxt = _sweep_spec(method, float(f"{max(lrs) * 10:.6g}"))
        elif lrs[best] == min(lrs):
            nxt = _sweep_spec(method, float(f"{min(lrs) / 10:.6g}"))
        else:
            break
        added.append(nxt)
        points.append(nxt)
    return added


def sweep_specs(method: str) -> list[RunSpec]:
    """One optimizer's whole lr sweep: the grid and whatever edge extensions it has needed so far."""
    return base_sweep_specs(method) + extension_specs(method)


def sweep_score(result: dict) -> float:
    """Mean training loss over the last 20 steps (inf when a step was not finite)."""
    losses = [s["loss"] for s in result["steps"][-20:]]
    if result.get("nonfinite_steps") or not losses or any(v is None or not math.isfinite(v) for v in losses):
        return float("inf")
    return sum(losses) / len(losses)


def sweep_diverged(method: str) -> bool:
    """Whether every point of ``method``'s sweep has finished with a non-finite loss (no lr can be selected)."""
    results = [load_result(s) for s in sweep_specs(method)]
    return all(r is not None and sweep_score(r) == float("inf") for r in results)


def sweep_on_record(method: str) -> bool:
    """Whether ``method``'s lr comes from :data:`PINNED_LR` (no file of its sweep is present) rather than files."""
    return method in PINNED_LR and all(load_result(s) is None for s in base_sweep_specs(method))


def selected_lr(method: str) -> float | None:
    """The sweep's lr for ``method``, or ``None`` until every point of its sweep (extensions too) has finished.

    With no file of the sweep present, the lr it selected when it ran (:data:`PINNED_LR`).
    """
    if sweep_on_record(method):
        return PINNED_LR[method]
    results = [load_result(s) for s in sweep_specs(method)]
    if any(r is None for r in results):
        return None
    best = min(results, key=sweep_score)
    return best["spec"]["lr"] if sweep_score(best) < float("inf") else None


def queue() -> list[tuple[RunSpec | None, str]]:
    """Every run of the core grid in priority order: ``(spec, "")`` or ``(None, why it cannot start yet)``."""
    items: list[tuple[RunSpec | None, str]] = [(s, "") for s in zero_shot_specs()]
    swept = [method for method in PRIORITY if not sweep_on_record(method)]
    for method in swept:
        items += [(s, "") for s in base_sweep_specs(method)]
    # Edge extensions go after every grid point; they appear while shards are running, so shard_members gives
    # them a shard by optimizer rather than by position.
    for method in swept:
        items += [(s, "") for s in extension_specs(method)]
    # One selection per optimizer (each reads its sweep's files), shared by every (seed, task) of the grid.
    chosen = {method: selected_lr(method) for method in PRIORITY}
    waiting = {method: "every point of its lr sweep diverged (widen GRIDS downwards)" if sweep_diverged(method)
               else "waits for its lr sweep" for method in PRIORITY if chosen[method] is None}
    # Task-major: SST-2's runs are a third of RTE's cost, so a partial grid completes one task's seeds first.
    # Within a task optimizer-major: a task cut short still has both seeds (a mean ± std) of the optimizers first in
    # PRIORITY -- MeZO and HELENE, the two the accuracy target names.
    items += [_main_item(task, seed, method, chosen[method], waiting.get(method, ""))
              for task in TASKS for method in PRIORITY for seed in SEEDS]
    # Follow-ups last, so that they never move a core run's position (shard membership).
    items += [_main_item(task, seed, method, chosen[lr_of], f"waits for {lr_of}'s lr sweep")
              for method, lr_of in FOLLOW_UPS.items() for task in FOLLOW_UP_TASKS for seed in SEEDS]
    return items


def _main_item(task: str, seed: int, method: str, lr: float | None, why: str) -> tuple[RunSpec | None, str]:
    """One 300-step run as a queue item: ``(spec, "")``, or ``(None, why)`` while its lr is not known."""
    if lr is None:
        return None, f"{task} seed {seed} {method}: {why}"
    return RunSpec(task, seed, method, lr=lr, steps=MAIN_STEPS, max_test=MAX_TEST[task],
                   max_length=MAX_LENGTH[task]), ""


PHASES = ("all", "first", "main", "followup")


def in_phase(spec: RunSpec, phase: str) -> bool:
    """Whether ``spec`` belongs to ``phase``: ``first`` (zero-shot and every lr sweep), ``main`` (the 300-step core
    grid, whose lrs need the sweeps), ``followup`` (:data:`FOLLOW_UPS`) or ``all``."""
    if phase == "first":
        return spec.purpose == "sweep" or spec.method == "zeroshot"
    if phase == "main":
        return spec.purpose == "main" and spec.method in PRIORITY
    if phase == "followup":
        return spec.method in FOLLOW_UPS
    return True


def phase_specs(phase: str) -> list[RunSpec]:
    """The runnable runs of one phase (see :func:`in_phase`), in priority order."""
    return [s for s, _ in queue() if s is not None and in_phase(s, phase)]


def shard_members(phase: str, shard: tuple[int, int]) -> list[RunSpec]:
    """The runnable runs of ``phase`` that belong to shard ``(I, N)``, in priority order.

    Membership must not move while other shards finish runs, or two shards would take the same run (or none
    would). Every run of the queue except the sweeps' edge extensions has a fixed position — the queue lists the
    whole grid, runs still waiting for their lr included — and belongs to shard ``position % N``. Extensions appear
    in whatever order sweeps finish, so they are given by optimizer instead: all of one optimizer's extensions (a
    chain, each waiting for the one before) belong to shard ``PRIORITY.index(method) % N``.
    """
    index, count = shard
    mine, position = [], 0
    for spec, _ in queue():
        # An extension is a sweep point off its grid (the grid's own points are built from GRIDS' values exactly).
        if spec is not None and spec.purpose == "sweep" and spec.lr not in GRIDS[spec.method]:
            owner = PRIORITY.index(spec.method) % count
        else:
            owner, position = position % count, position + 1
        if spec is not None and owner == index and in_phase(spec, phase):
            mine.append(spec)
    return mine


def unfinished_sweep_points() -> int:
    """How many points of the lr sweeps have not finished (while any has not, an extension may still appear)."""
    return sum(load_result(s) is None for m in PRIORITY for s in sweep_specs(m))
