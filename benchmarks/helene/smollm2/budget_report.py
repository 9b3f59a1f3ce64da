"""docs/benchmarks/helene_budget.md from the committed results of the equal-forward-pass comparison
(:mod:`benchmarks.helene.smollm2.budget`; whatever has finished, the rest listed as the queue)."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common.fmt import fmt
from benchmarks.common.pages import read_json, rewrite_marked_section, write_page
from benchmarks.common.paths import DOCS
from benchmarks.helene.smollm2 import budget, grid, runs
from benchmarks.helene.smollm2.budget import (
    BUDGET,
    GRIDS,
    NF4_GRIDS,
    SEEDS,
    SWEEP_BUDGET,
    TEST_BUDGETS,
    THIRD_SEED,
    THIRD_SEED_METHODS,
    load_result,
    queue,
    selected,
    sweep_score,
    sweep_specs,
)

DOC = DOCS / "helene_budget.md"
#: The method page with the "Beating MeZO" section (beside docs/benchmarks/).
HELENE_DOC = DOCS.parent / "helene.md"
PLOT = "helene_budget_curves.png"
LAUNCH = ("mkdir -p runs/helene_budget; for i in 0 1; do OMP_NUM_THREADS=1 setsid nohup .venv/bin/python -m "
          "benchmarks.helene.smollm2.budget_cli run --shard $i/2 --no-report > runs/helene_budget/shard$i.log 2>&1 & "
          "done")
#: Methods of each table, in the queue's order.
SST2_METHODS = ("fzoo4", "fzoo8", "helene_scalar", "helene_scalar_bc", "hizoo", "mezo", "mezo_rademacher", "zoadam")
#: The section of docs/helene.md ("Beating MeZO") this study's results render into.
DOC_SECTION = "helene-beating-mezo"
#: Optimizer state per trainable parameter (fp32 bytes): m, v for ZO-Adam; m, h for HELENE with a Hessian; m for
#: the scalar preconditioners (plus one float per group); none for MeZO and FZOO (see helene.md, "Cost per step").
STATE_BYTES = {"mezo": 0, "mezo_rademacher": 0, "fzoo4": 0, "fzoo8": 0, "zoadam": 8, "helene_scalar": 4,
               "helene_scalar_bc": 4, "hizoo": 8}
#: First-order references in a table (the second task's learnability check): their steps are a forward and a
#: backward each, so they get no forward-pass ratio and are not judged against the targets.
FIRST_ORDER = ("adamw_lora",)
#: The issue's targets: forward passes to MeZO's final accuracy as a share of MeZO's, and a stateless optimizer's
#: peak RSS as a multiple of MeZO's.
TARGET_RATIO, MOONSHOT_RATIO, STATELESS_RSS = 0.5, 0.2, 1.1
#: Two mean accuracies closer than this are the same count of correct answers: each run records its accuracy as a
#: float32 ratio (error ~1e-7), while one answer moves a mean over two seeds by 1 / (2 n_test) ≥ 5e-4. Compared as
#: plain floats, a tie in correct answers came out "below" MeZO's mean for most ways of splitting it over the seeds.
SAME_ACC = 1e-6


def _label(method: str) -> str:
    return runs.OPTIMIZERS[method].label


def _mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _runs(task: str, method: str, seeds: tuple[int, ...] = SEEDS) -> list[dict]:
    """The finished full-budget runs of ``method`` on ``task`` for ``seeds``, seed order."""
    lr, _ = selected(method)
    if lr is None:
        return []
    found = [load_result(budget.main_spec(task, seed, method, lr)) for seed in seeds]
    return [r for r in found if r is not None]


def _test_at(result: dict, point: int) -> float | None:
    return next((t["acc"] for t in result.get("tests", []) if t["budget"] == point), None)


def _mean_at(results: list[dict], point: int, seeds: int = len(SEEDS)) -> float | None:
    """Mean test accuracy at a budget over the seeds, once every one of the ``seeds`` runs has it."""
    values = [_test_at(r, point) for r in results]
    return statistics.mean(values) if len(values) == seeds and None not in values else None


def _forwards_to(results: list[dict], target: float | None, seeds: int = len(SEEDS)) -> int | None:
    """The first test budget whose mean over the ``seeds`` runs reaches ``target``."""
    if target is None:
        return None
    return next((b for b in TEST_BUDGETS if (m := _mean_at(results, b, seeds)) is not None
                 and m >= target - SAME_ACC), None)


def _forwards_per_step(results: list[dict]) -> float | None:
    """Measured: forward passes of the optimizer's counter over its steps, all seeds together."""
    passes = [r["steps"][-1].get("forward_passes") for r in results if r["steps"]]
    steps = [len(r["steps"]) for r in results if r["steps"]]
    return None if not passes or None in passes else sum(passes) / sum(steps)


def _memory_record(mode: str) -> dict | None:
    record = read_json(budget.CACHE / f"memory_{mode}.json")
    if record is None and mode in ("inference", "mezo"):  # the grid's fp32 measurements, same protocol
        record = read_json(runs.CACHE / f"memory_{'mezo_full' if mode == 'mezo' else mode}.json")
    return record


def _memory(mode: str) -> float | None:
    record = _memory_record(mode)
    return None if record is None else record.get("peak_rss_mib")


def _rss_cell(mode: str, reference: str) -> str:
    value, ref = _memory(mode), _memory(reference)
    if value is None:
        return "not measured"
    return f"{value:.0f} MiB" + (f" ({value / ref:.2f}×)" if ref else "")


def _table(task: str, methods, reference_rss: str = "inference") -> list[str]:
    """The headline table of ``task``: per optimizer, forwards per step, lr, test accuracy at each budget, forward
    passes to MeZO's final accuracy (ratio to MeZO's), peak RSS."""
    mezo = _runs(task, "mezo")
    target = _mean_at(mezo, BUDGET)
    own = _forwards_to(mezo, target)
    lines = ["| optimizer | forwards / step | lr | " + " | ".join(f"test acc @ {b} fwd" for b in TEST_BUDGETS)
             + " | forwards to MeZO's final acc (× MeZO's) | peak RSS (× inference) | seeds |",
             "|---|---|---|" + "---|" * len(TEST_BUDGETS) + "---|---|---|"]
    for method in methods:
        results = _runs(task, method)
        lr, _ = selected(method)
        cells = [_mean_std([v for r in results if (v := _test_at(r, b)) is not None]) for b in TEST_BUDGETS]
        reach = _forwards_to(results, target)
        if method in FIRST_ORDER:
            to = "first-order reference (forward + backward a step)"
        elif target is None or len(results) < len(SEEDS):
            to = "—"
        elif reach is None:
            to = f"not within {BUDGET}"
        else:
            to = f"{reach}" + (f" ({reach / own:.2f}×)" if own else "")
        per = _forwards_per_step(results)
        lines.append(f"| {_label(method)} | {fmt(per, '.2f') if per else runs.OPTIMIZERS[method].forwards_per_step} "
                     f"| {fmt(lr, 'g')} | " + " | ".join(cells) + f" | {to} | {_rss_cell(method, reference_rss)} | "
                     f"{len(results)} of {len(SEEDS)} |")
    lines += ["", ("MeZO's final accuracy (the target): " + (f"{target:.3f}" if target is not None else "not yet")
                   + f"; a budget is reached when the mean over seeds {SEEDS} is at least that. Forwards per step: "
                   "measured from the optimizers' counters where runs exist, else the planning number.")]
    return lines


def _third_seed() -> list[str]:
    """The headline pair on the third split seed: its own test points and the means over all three seeds, with
    forward passes to MeZO's three-seed final accuracy (empty until a third-seed run has finished)."""
    seeds = (*SEEDS, THIRD_SEED)
    runs_of = {m: _runs("sst2", m, seeds) for m in THIRD_SEED_METHODS}
    if not any(r["spec"]["split_seed"] == THIRD_SEED for found in runs_of.values() for r in found):
        return []
    target = _mean_at(runs_of["mezo"], BUDGET, len(seeds))
    own = _forwards_to(runs_of["mezo"], target, len(seeds))
    points = " | ".join(f"seed {THIRD_SEED} @ {b} fwd" for b in TEST_BUDGETS)
    means = " | ".join(f"{len(seeds)} seeds @ {b} fwd" for b in TEST_BUDGETS)
    lines = [f"| optimizer | lr | {points} | {means} | forwards to MeZO's {len(seeds)}-seed final acc (× MeZO's) |",
             "|---|---|" + "---|" * (2 * len(TEST_BUDGETS)) + "---|"]
    for method, results in runs_of.items():
        third = next((r for r in results if r["spec"]["split_seed"] == THIRD_SEED), None)
        cells = [_mean_std([v for r in results if (v := _test_at(r, b)) is not None]) if len(results) == len(seeds)
                 else "—" for b in TEST_BUDGETS]
        reach = _forwards_to(results, target, len(seeds))
        to = ("—" if target is None or len(results) < len(seeds) else f"not within {BUDGET}" if reach is None
              else f"{reach}" + (f" ({reach / own:.2f}×)" if own else ""))
        lines.append(f"| {_label(method)} | {fmt(selected(method)[0], 'g')} | {_points(third)} | {' | '.join(cells)} "
                     f"| {to} |")
    lines += ["", (f"MeZO's {len(seeds)}-seed final accuracy: " + (f"{target:.3f}" if target is not None else "not yet")
                   + f" (seeds {', '.join(map(str, seeds))}); the tables above keep the means over {SEEDS}.")]
    if own is not None and own < BUDGET:
        lines += ["", _against_mezos_budget(runs_of, target, own, len(seeds))]
    return lines


def _against_mezos_budget(runs_of: dict[str, list[dict]], target: float, own: int, seeds: int) -> str:
    """When MeZO's mean peaks before the full budget, the ratio to MeZO's own first reach is 1.00× or more by
    construction; says where each other optimizer reaches MeZO's final accuracy against MeZO's whole budget, and at
    which budgets its mean is above MeZO's."""
    parts = []
    mezo_at = {b: _mean_at(runs_of["mezo"], b, seeds) for b in TEST_BUDGETS}
    for method, results in runs_of.items():
        if method == "mezo" or len(results) < seeds:
            continue
        reach = _forwards_to(results, target, seeds)
        above = [b for b in TEST_BUDGETS
                 if (m := _mean_at(results, b, seeds)) is not None and mezo_at[b] is not None
                 and m > mezo_at[b] + SAME_ACC]
        where = "every test budget" if above == list(TEST_BUDGETS) else (
            f"{', '.join(map(str, above))} forward passes" if above else "no test budget")
        parts.append(f"{_label(method)} reaches it at " + (f"{reach} ({reach / BUDGET:.2f}× MeZO's {BUDGET})"
                                                           if reach else f"no test budget within {BUDGET}")
                     + f" and its mean is above MeZO's at {where}")
    return (f"MeZO's {seeds}-seed mean reaches its final accuracy already at {own} forward passes "
            "(it does not climb after), so "
            "the ratio to MeZO's own first reach is 1.00× or more by construction; against MeZO's budget instead: "
            + ("; ".join(parts) or "no other optimizer has every seed yet") + ".")


def _reproducibility() -> list[str]:
    """MeZO at 600 forward passes against the grid's 300-step MeZO runs (same protocol and seeds; the batch order
    of epochs after the first changed since, see the note it ends with)."""
    lines = []
    lr = grid.selected_lr("mezo")
    for seed in SEEDS:
        ours = load_result(budget.main_spec("sst2", seed, "mezo", lr))
        theirs = runs.load_result(runs.RunSpec("sst2", seed, "mezo", lr=lr, steps=grid.MAIN_STEPS,
                                               max_test=grid.MAX_TEST["sst2"]))
        if ours is None or theirs is None:
            lines.append(f"- seed {seed}: {'not run yet' if ours is None else 'no grid run on record'}")
            continue
        same = ours["test_acc"] == theirs["test_acc"]
        pairs = list(zip([s["loss"] for s in ours["steps"]], [s["loss"] for s in theirs["steps"]]))
        # Rounding (another CPU's kernels) moves a loss by ~1e-7; a different batch or step by far more.
        close = next((i for i, (a, b) in enumerate(pairs) if abs(a - b) > 1e-5), len(pairs))
        losses = ("identical" if all(a == b for a, b in pairs) else
                  f"within 1e-5 through step {close}, then apart" if close < len(pairs) else "within 1e-5")
        lines.append(f"- seed {seed}: {ours['test_acc']:.4f} here, {theirs['test_acc']:.4f} in the grid "
                     f"({'identical' if same else 'DIFFERENT'}; per-step losses {losses})")
    lines += ["", ("The grid's runs predate `peftplug.data.resumable` (commit b881b48): inside Lightning the former "
                   "training loader drew its epochs' orders differently from the second epoch on (2 steps an epoch "
                   "here), so the trajectories part at step 3; see that module's docstring.")]
    return lines


def _sweeps() -> list[str]:
    lines = [(f"| optimizer | lr | mean train loss, last third | test acc ({budget.SWEEP_MAX_TEST} examples) | "
              "selected |"), "|---|---|---|---|---|"]
    for method in (*GRIDS, *NF4_GRIDS):
        chosen, _ = selected(method)
        for spec in sweep_specs(method):
            r = load_result(spec)
            if r is None:
                if method in GRIDS or method == "mezo_nf4":
                    lines.append(f"| {_label(method)} | {spec.lr:g} | not run yet | | |")
                continue
            score = sweep_score(r)
            lines.append(f"| {_label(method)} | {spec.lr:g} | {'diverged' if score == float('inf') else fmt(score)} "
                         f"| {fmt(r['test_acc'])} | {'**yes**' if spec.lr == chosen else ''} |")
    return lines


def _nf4() -> list[str]:
    # Every test point, not only the last: on nf4 an lr can learn by 120 passes and lose it by 600.
    points = " | ".join(f"test acc @ {b} fwd" for b in TEST_BUDGETS)
    lines = [f"| run | lr | {points} | fp32 full-parameter counterpart @ {BUDGET} fwd | peak RSS (× nf4 inference) |",
             "|---|---|" + "---|" * len(TEST_BUDGETS) + "---|---|"]
    for method in NF4_GRIDS:
        results = _runs("sst2", method)
        if not results and method != "mezo_nf4":
            continue
        base = method.removesuffix("_nf4")
        full = [r["test_acc"] for r in _runs("sst2", base)]
        accs = [_mean_std([a for r in results if (a := _test_at(r, b)) is not None]) for b in TEST_BUDGETS]
        lines.append(f"| {_label(method)} | {fmt(selected(method)[0], 'g')} | {' | '.join(accs)} | "
                     f"{_mean_std(full)} | {_rss_cell(method, 'nf4_inference')} |")
    lines += ["", f"nf4 inference alone: {_rss_cell('nf4_inference', 'inference')} (× fp32 inference)."]
    return lines


def _follow_ups() -> list[str]:
    """Each follow-up run beside the queue's run it questions (same method and seed, the selected lr)."""
    points = " | ".join(f"test acc @ {b} fwd" for b in TEST_BUDGETS)
    queued = " | ".join(f"queue's run @ {b} fwd" for b in TEST_BUDGETS)
    lines = [f"| run | lr | {points} | queue's run: lr | {queued} | why |",
             "|---|---|" + "---|" * len(TEST_BUDGETS) + "---|" + "---|" * len(TEST_BUDGETS) + "---|"]
    for _, spec, why in budget.follow_ups():
        ours = load_result(spec)
        lr = selected(spec.method)[0]
        theirs = None if lr is None else load_result(budget.main_spec(spec.task, spec.split_seed, spec.method, lr))

        lines.append(f"| {_label(spec.method)}, seed {spec.split_seed} | {spec.lr:g} | {_points(ours)} | "
                     f"{fmt(lr, 'g')} | {_points(theirs)} | {why} |")
    return lines


def _points(result: dict | None) -> str:
    """A run's test accuracy at each budget as table cells ("not run yet" in the first while it has not)."""
    if result is None:
        return " | ".join(["not run yet"] + [""] * (len(TEST_BUDGETS) - 1))
    return " | ".join(fmt(_test_at(result, b)) for b in TEST_BUDGETS)


def _verdict(task: str, methods) -> list[str]:
    """What the finished runs of ``task`` say about the issue's targets (one line each; nothing before MeZO's
    runs have finished)."""
    mezo = _runs(task, "mezo")
    target = _mean_at(mezo, BUDGET)
    own = _forwards_to(mezo, target)
    if target is None or not own:
        return ["MeZO's runs at the full budget have not finished: no verdict yet."]
    reached, references, lines = [], [], []
    for method in methods:
        results = _runs(task, method)
        if method in FIRST_ORDER and results:
            references.append((method, results))
        if method == "mezo" or method in FIRST_ORDER or len(results) < len(SEEDS):
            continue
        reach, final = _forwards_to(results, target), _mean_at(results, BUDGET)
        ratio = None if reach is None else reach / own
        reached.append((method, ratio, final))
    done = ", ".join(_label(m) for m, _, _ in reached) or "none"
    wins = [(m, r, f) for m, r, f in reached
            if r is not None and r <= TARGET_RATIO and f is not None and f > target + SAME_ACC]
    lines.append(f"- MeZO's accuracy at {BUDGET} forward passes (the target): **{target:.3f}** (mean over seeds "
                 f"{', '.join(map(str, SEEDS))}). Optimizers with both seeds finished: {done}.")
    for method, results in references:
        lines.append(f"- First-order reference {_label(method)}: {_mean_std([r['test_acc'] for r in results])} after "
                     f"{len(results[0]['steps'])} steps (a forward and a backward each; not judged against the "
                     "targets).")
    if not reached:
        lines.append("- No zeroth-order optimizer besides MeZO has finished both seeds yet: no verdict on the targets.")
    elif wins:
        best = min(wins, key=lambda w: (w[1], -w[2]))
        lines.append(f"- **Target met** (MeZO's final accuracy in ≤ {TARGET_RATIO}× its forward passes and higher "
                     f"at the full budget): {', '.join(f'{_label(m)} ({r:.2f}×, {f:.3f})' for m, r, f in wins)}; "
                     f"moonshot (≤ {MOONSHOT_RATIO}×) {'met' if best[1] <= MOONSHOT_RATIO else 'not met'}.")
    else:
        near = [f"{_label(m)}: " + (f"{r:.2f}×" if r is not None else f"not within {BUDGET}")
                + (f", {f:.3f} at {BUDGET}" if f is not None else "") for m, r, f in reached]
        lines.append(f"- **Target not met** by the finished optimizers (MeZO's final accuracy in ≤ {TARGET_RATIO}× "
                     f"its forward passes and higher at the full budget){': ' + '; '.join(near) if near else ''}.")
    mezo_rss = _memory("mezo")
    for method in methods:
        record = _memory_record(method) or {}
        rss, params = record.get("peak_rss_mib"), record.get("trainable")
        if method == "mezo" or rss is None or mezo_rss is None:
            continue
        state = STATE_BYTES.get(method)
        if state == 0:
            cost = "; no optimizer state"
        elif params and state:
            cost = f"; its state: {state} B × {params / 1e6:.1f}M parameters = {state * params / 2**20:.0f} MiB"
        else:
            cost = ""
        check = (f" (target for a stateless one ≤ {STATELESS_RSS}×: {'met' if rss / mezo_rss <= STATELESS_RSS else 'not met'})"
                 if state == 0 else "")
        lines.append(f"- {_label(method)}: peak RSS {rss:.0f} MiB = {rss / mezo_rss:.2f}× MeZO's{check}{cost}.")
    return lines


def beating_mezo_section(plot: bool) -> str:
    """The body of docs/helene.md's "Beating MeZO" section: the SST-2 table, what it says about the targets, the
    curves, and the second task and nf4 tables once they have runs.

    Args:
        plot: Whether the page's curve plot exists (it is linked from docs/benchmarks/).
    """
    lines = [("Generated by `python -m benchmarks.helene.smollm2.budget_cli report` from the committed results "
              "(protocol, sweeps, queue and per-run details: [benchmarks/helene_budget.md](benchmarks/helene_budget.md))."),
             "", "**SST-2** (k=16, 600 forward passes = MeZO's 300 steps, full 872-sentence test set):", ""]
    lines += _table("sst2", SST2_METHODS) + [""] + _verdict("sst2", SST2_METHODS)
    if third := _third_seed():
        pair = " and ".join(map(_label, THIRD_SEED_METHODS))
        lines += ["", f"**Third split seed ({THIRD_SEED})**, {pair} only:", ""] + third
    if plot:
        lines += ["", f"![dev accuracy and training loss against forward passes and wall time](benchmarks/{PLOT})"]
    cr = ["adamw_lora", "mezo"] + (budget.best_new(2) or [])
    if any(_runs("cr", m) for m in cr):
        lines += ["", "**CR** (the second task):", ""] + _table("cr", cr) + [""] + _verdict("cr", cr)
    if any(_runs("sst2", m) for m in NF4_GRIDS):
        lines += ["", "**Zeroth-order on an nf4 base** (OFTv2 block 32):", ""] + _nf4()
    if any(load_result(spec) for _, spec, _ in budget.follow_ups()):
        lines += ["", "**Follow-ups outside the queue's rule** (an lr no sweep chose; not in the tables above):",
                  ""] + _follow_ups()
    return "\n".join(lines)


def write_doc_section(doc: Path, plot: bool) -> None:
    """Rewrites the "Beating MeZO" section of ``doc`` (docs/helene.md) between its markers.

    Args:
        doc: The method page.
        plot: Whether the curve plot exists.

    Raises:
        ValueError: If ``doc`` has no ``helene-beating-mezo`` markers (the table must not land at the page's end).
    """
    rewrite_marked_section(doc, DOC_SECTION, lambda: beating_mezo_section(plot))


def _queue_listing() -> list[str]:
    lines = ["| item | run | state |", "|---|---|---|"]
    for name, spec, why in queue():
        if spec is None:
            lines.append(f"| {name} | — | waiting: {why} |")
        else:
            lines.append(f"| {name} | `{spec.run_id}` | {'done' if load_result(spec) else 'pending'} |")
    return lines


def _plot(page: Path, results: list[dict]) -> bool:
    """Dev accuracy and training loss against forward passes and against wall time (SST-2 main runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {m: f"C{i}" for i, m in enumerate(SST2_METHODS)}
    for r in results:
        method, seed = r["spec"]["method"], r["spec"]["split_seed"]
        steps = r["steps"]
        passes = {0: 0, **{s["step"]: s.get("forward_passes", 0) for s in steps}}
        clock, total = {0: 0.0}, 0.0
        for s in steps:
            total += s["time"]
            clock[s["step"]] = total / 60
        style, label = {SEEDS[0]: "-", SEEDS[1]: "--"}.get(seed, ":"), f"{_label(method)} s{seed}"
        smooth = [statistics.mean(x["loss"] for x in steps[max(0, i - 9):i + 1] if x["loss"] is not None)
                  for i in range(len(steps))]
        for col, axis in enumerate((passes, clock)):
            axes[0][col].plot([axis[s["step"]] for s in steps], smooth, style, color=colors.get(method), label=label)
            axes[1][col].plot([axis.get(v["step"], 0) for v in r["val"]], [v["acc"] for v in r["val"]], style,
                              color=colors.get(method), label=label)
    for col, xlabel in enumerate(("forward passes over a training batch", "wall time of the training steps (min)")):
        axes[0][col].set_title("SST-2: training loss (running mean of 10 steps)")
        axes[1][col].set_title("SST-2: dev accuracy (32 examples)")
        for row in (0, 1):
            axes[row][col].set_xlabel(xlabel)
    axes[1][1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(page.parent / PLOT, dpi=80)
    plt.close(fig)
    return True


def write_report(page: Path | None = None, doc: Path | None = None) -> bool:
    """Writes the page (and its plot once runs have finished) from the committed results.

    Args:
        page: Another page to write (default: docs/benchmarks/helene_budget.md).
        doc: The method page whose "Beating MeZO" section to rewrite too (docs/helene.md), or ``None``; skipped
            when the file does not exist (a ``--check`` copy of docs/benchmarks/ has none beside it).

    Returns:
        True (the page always renders: with no results it lists the queue).
    """
    page = page or DOC
    finished = [load_result(s) for _, s, _ in queue() if s is not None]
    finished = [r for r in finished if r is not None]
    main = [r for r in finished if r["spec"]["purpose"] == "main"]
    lines = ["# Zeroth-order optimizers at equal forward passes (SmolLM2-135M-Instruct)", "",
             ("Generated by `python -m benchmarks.helene.smollm2.budget_cli report` from "
              "`benchmarks/helene/results/helene_budget/` (one JSON per finished run); the study: "
              "`benchmarks/helene/smollm2/budget.py`. Do not edit by hand."), "",
             (f"Protocol: MeZO's prompt protocol as in [the grid](helene_llm.md) — SST-2 k=16, split seeds "
              f"{' and '.join(map(str, SEEDS))}, batch 16, full parameters, ε = 1e-3, plain template, max_length 256, "
              f"the full 872-example test set — but every optimizer gets the same budget of **{BUDGET} forward "
              f"passes** over a training batch (MeZO's 300 steps), counted by the optimizer's own `forward_passes` "
              f"counter. Test set at the first step whose counter reaches {', '.join(map(str, TEST_BUDGETS))}; dev "
              f"set (32 examples) every ~{budget.DEV_EVERY} forward passes. Each new optimizer's lr from a sweep on "
              f"seed 42 at {SWEEP_BUDGET} forward passes (lowest mean training loss over the last third of the "
              "steps); MeZO, MeZO-Rademacher and ZO-Adam at the grid's selected lrs."), ""]
    if not finished:
        lines += ["**Not yet run.** Launch (one process per core, resumable; `queue` shows the state):", "",
                  f"    {LAUNCH}", ""]
    lines += ["## SST-2: the comparison", ""] + _table("sst2", SST2_METHODS)
    if third := _third_seed():
        lines += ["", f"### Third split seed ({THIRD_SEED})", "",
                  (f"The issue's \"seed {THIRD_SEED} if time allows\", for "
                   f"{', '.join(map(_label, THIRD_SEED_METHODS))} "
                   "(queue phase `seed21`, after the follow-ups), same settings as their mains."), ""] + third
    lines += ["", "Reproducibility: MeZO at 600 forward passes against the grid's recorded 300-step runs:", ""]
    lines += _reproducibility()
    plotted = _plot(page, main)
    if plotted:
        lines += ["", f"![curves]({PLOT})"]
    lines += ["", "## Second task: CR", "", ("AdamW-LoRA r=8 (the grid's settings: lr 1e-3, 300 steps, one forward "
              "and one backward each) checks that SmolLM2 learns CR from k=16; then MeZO and the two of the issue's "
              f"new optimizers ({', '.join(budget.BEST_CANDIDATES)}) with the best SST-2 accuracy at 600 forward passes, "
              "at their SST-2 lrs (full 1000-example test set)."),
              ""]
    cr = ["adamw_lora", "mezo"] + (budget.best_new(2) or [])
    lines += _table("cr", cr)
    lines += ["", "## Zeroth-order on an nf4 base (OFTv2 block 32, every linear layer)", ""] + _nf4()
    lines += ["", "## Follow-ups outside the queue's rule", "",
              ("Runs at an lr no sweep chose, added after reading the finished runs "
               "(`benchmarks.helene.smollm2.budget.follow_ups`); they test a reading of those runs and stay out of "
               "the comparison's tables."), ""] + _follow_ups()
    lines += ["", "## lr sweeps (SST-2, seed 42)", ""] + _sweeps()
    lines += ["", "## Queue", "", f"Launch: `{LAUNCH}`", "",
              ("Then `python -m benchmarks.helene.smollm2.budget_cli memory` (peak RSS, a fresh process per mode) and "
               "`report`. `budget_cli replay RUN_ID` runs a recorded zeroth-order result again from its closure values "
               "and seed (no training forwards) and says whether every dev and test point comes out identical."), ""]
    lines += _queue_listing()
    write_page(page, "\n".join(lines) + "\n")
    if doc is not None and doc.is_file():
        write_doc_section(doc, plotted)
    return True

