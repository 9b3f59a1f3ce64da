"""The SmolLM2 section of docs/benchmarks/prompt_transfer.md, rendered from the cached runs of
:mod:`benchmarks.prompt_transfer.llm` (whatever has finished; what has not is listed as pending)."""

from __future__ import annotations

import math
import os
import statistics

from benchmarks.common.pages import read_json, write_section
from benchmarks.prompt_transfer.llm_cache import SECTION, TITLE, slug, target_folder, variant_name


def collect(args) -> dict:
    """Reads every cached result of this run's sources, targets, seeds and methods."""
    work = args.work
    res = {"sources": {}, "zero": {}, "runs": {}, "pending": []}
    for name in args.source_list:
        r = read_json(os.path.join(work, "sources", f"{name}.json"))
        res["sources"][name] = r
        if r is None:
            res["pending"].append(f"source {name}")
    for target in args.target_list:
        for seed in args.seed_list:
            z = read_json(os.path.join(work, "zero_shot", f"{target}-{seed}.json"))
            if z is not None:
                res["zero"].setdefault(target, []).append(z["acc"])
            for method in args.method_list:
                r = read_json(os.path.join(target_folder(args, target, seed, method), slug(method) + ".json"))
                if r is None:
                    res["pending"].append(f"{target} seed {seed} {method}")
                else:
                    res["runs"].setdefault(method, {}).setdefault(target, []).append(r)
    res["decomposition"] = read_json(os.path.join(work, "decomposition", "decomposition.json"))
    return res


def collect_variants(args) -> dict:
    """The finished runs at other optimisation settings than ``args``' (sensitivity checks; see
    :func:`benchmarks.prompt_transfer_llm.variant_name`): ``{variant: {method: {target: [result, ...]}}}``, where
    ``""`` is the default settings' folder (listed when ``args`` is itself a variant)."""
    own = {method: variant_name(args, method) for method in args.method_list}
    found: dict = {}
    for target in args.target_list:
        for seed in args.seed_list:
            folder = os.path.join(args.work, "targets", target, str(seed))
            names = [""] + sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))) \
                if os.path.isdir(folder) else []
            for name in names:
                for method in args.method_list:
                    if name == own[method]:
                        continue  # this page's own run of the method
                    r = read_json(os.path.join(folder, name, slug(method) + ".json"))
                    if r is not None:
                        found.setdefault(name, {}).setdefault(method, {}).setdefault(target, []).append(r)
    return found


def sensitivity(res, variants: dict, args) -> list[str]:
    """A table of the runs at other settings next to the same method and target at ``args``' settings: does the
    verdict hinge on the one lr / temperature the main table uses?"""
    if not variants:
        return []
    seeds = len(args.seed_list)
    lines = ["### Sensitivity checks (other settings, same targets and seeds)", "",
             (f"Each row is one method on one target at settings other than this page's (lr {args.lr}, attention "
              f"lr {args.attention_lr}, temperature {args.temperature}), cached apart under "
              "`targets/<target>/<seed>/<settings>/`; `max attention` is each seed's largest source weight "
              "(1.0 = one-hot, 0.25 = uniform over four sources)."), "",
             "| settings | method | target | accuracy | at this page's settings | zero-shot | max attention per seed |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(variants):
        for method, by_target in variants[name].items():
            for target, runs in by_target.items():
                here = [r["acc"] for r in res["runs"].get(method, {}).get(target, [])]
                zero = res["zero"].get(target, [])
                att = [f"{max(r['attention'].values()):.2f}" for r in runs if r.get("attention")]
                lines.append(f"| {name or 'defaults'} | {method} | {target} | {_cell([r['acc'] for r in runs], seeds)} "
                             f"| {_cell(here, seeds)} | {_cell(zero, seeds)} | "
                             f"{' / '.join(att) or '—'} |")
    return lines


def _cell(values: list[float], seeds: int) -> str:
    if not values:
        return "pending"
    m = 100 * statistics.mean(values)
    s = 100 * statistics.stdev(values) if len(values) > 1 else float("nan")
    done = "" if len(values) == seeds else f" ({len(values)}/{seeds} seeds)"
    return f"{m:.1f} ± {s:.1f}{done}" if not math.isnan(s) else f"{m:.1f}{done}"


def verdict(res, args) -> list[str]:
    """PCT > SPoT > PT on the target average by more than the pooled seed std, on complete cells only."""
    seeds = len(args.seed_list)
    complete = [t for t in args.target_list
                if all(len(res["runs"].get(m, {}).get(t, [])) == seeds for m in ("PT", "SPoT", "PCT"))]
    if len(complete) < len(args.target_list) or seeds < 2:
        return [(f"**Verdict pending**: PT, SPoT and PCT have finished every seed on {len(complete)} of "
                f"{len(args.target_list)} targets (a verdict needs all targets and >= 2 seeds).")]
    avg = {m: statistics.mean(statistics.mean(r["acc"] for r in res["runs"][m][t]) for t in complete)
           for m in ("PT", "SPoT", "PCT")}
    variances = [statistics.variance([r["acc"] for r in res["runs"][m][t]]) for m in ("PT", "SPoT", "PCT")
                 for t in complete]
    pooled = math.sqrt(statistics.mean(variances))
    pct_spot, spot_pt = avg["PCT"] - avg["SPoT"], avg["SPoT"] - avg["PT"]
    ok = pct_spot > pooled and spot_pt > pooled
    return [(f"Average over targets: PT {100 * avg['PT']:.1f}, SPoT {100 * avg['SPoT']:.1f}, PCT "
            f"{100 * avg['PCT']:.1f}; pooled seed std {100 * pooled:.1f} points. PCT − SPoT {100 * pct_spot:+.1f}, "
            f"SPoT − PT {100 * spot_pt:+.1f}."),
            "",
            ("**Goal met**: PCT beats SPoT and SPoT beats PT by more than the pooled seed std." if ok else
             "**Goal not met**: the ordering PCT > SPoT > PT does not hold by more than the pooled seed std; see "
             "the checks below (source prompts against their zero-shot, each method against the target's "
             "zero-shot, how peaked PCT's attention is).")]


def checks(res, args) -> list[str]:
    """The short "why" checks the verdict points to, from the finished runs: which source prompts beat zero-shot on
    their own task (one that does not has nothing to transfer), and whether target training moves off zero-shot."""
    lines = []
    # A source trained without its zero-shot or test evaluation cannot be placed either way: it is left out.
    measured = {n: r for n, r in res["sources"].items() if r and "test_acc" in r and "zero_shot_acc" in r}
    weak = [n for n, r in measured.items() if r["test_acc"] <= r["zero_shot_acc"]]
    strong = [n for n in measured if n not in weak]
    unmeasured = [n for n in res["sources"] if n not in measured]
    if measured:
        lines.append(f"- Source prompts above zero-shot on their own task: {', '.join(strong) or 'none'}"
                     + (f"; not above it: {', '.join(weak)} (such a prompt has nothing to transfer)" if weak else "")
                     + (f"; not measured (or not trained yet): {', '.join(unmeasured)}" if unmeasured else "") + ".")
    seeds = len(args.seed_list)
    for t in args.target_list:
        zero = res["zero"].get(t, [])
        cells = {m: [r["acc"] for r in res["runs"].get(m, {}).get(t, [])] for m in args.method_list}
        done = {m: v for m, v in cells.items() if v}
        if not zero or not done:
            continue
        z = statistics.mean(zero)
        best = max(done, key=lambda m: statistics.mean(done[m]))
        # Means over the seeds finished so far: a cell on fewer seeds than zero-shot's says so.
        lines.append(f"- {t}: zero-shot {100 * z:.1f}; "
                     + ", ".join(f"{m} {100 * (statistics.mean(v) - z):+.1f}"
                                 + ("" if len(v) == seeds else f" ({len(v)}/{seeds} seeds)") for m, v in done.items())
                     + f" points vs zero-shot; best {best}.")
    for m in ("PCT", "PCT w/o contrastive"):
        runs = [r for rs in res["runs"].get(m, {}).values() for r in rs if r.get("attention")]
        if runs:
            # A softmax that has collapsed onto one source is single-source transfer, whatever its design says.
            peaked = sum(max(r["attention"].values()) >= 0.95 for r in runs)
            chosen = sorted({max(r["attention"], key=r["attention"].get) for r in runs})
            lines.append(f"- {m} attention: one source holds ≥ 0.95 of the weight in {peaked} of {len(runs)} runs "
                         f"(argmax sources: {', '.join(chosen)}).")
    return (["### Checks", ""] + lines) if lines else []


def render(args) -> str:
    res = collect(args)
    seeds = len(args.seed_list)
    lines = [f"## SmolLM2-135M-Instruct (prompt-based classification, {'smoke run' if args.smoke else 'CPU'})",
             "",
             ("Generated by `python -m benchmarks.prompt_transfer.llm` from the runs cached "
             f"under `{os.path.relpath(args.work)}` (regenerate with `--stage report`). Sources: {', '.join(args.source_list)} "
             f"({'16' if args.smoke else '512'}-shot splits, seed 42, {args.source_steps} steps of batch "
             f"{args.batch_size}); held-out targets: {', '.join(args.target_list)} (k=16 per class; BoolQ drawn from "
             f"SuperGLUE val per seed); seeds {args.seeds}; {args.steps} target steps of batch {args.batch_size}; "
             f"prompts cut to {args.max_length} tokens (the first field loses its tail); ≤ {args.eval_size} test "
             f"examples per task; lr {args.lr} (prompt, residual), {args.attention_lr} (PCT attention), attention "
             f"temperature {args.temperature}."), "",
             ("Methods: PT (prompt tuning, vocabulary init), SPoT (PT's prompt as task embedding → nearest source "
             "prompt by cosine of token means → prompt tuning from it), PCT and its two ablations. ATTEMPT's "
             "instance-level mixture is not run: it is not cheap in our attention module (PEFT gives a prompt "
             "encoder no access to the input; see docs/prompt_transfer.md). The MiniLM section above is the fast "
             "variant."), "",
             *([("**Results pending**: no target run has finished yet; the code path is built and tested (tiny "
                "Llama end to end, templates on the real tokenizer)."), ""] if not res["runs"] else []),
             "### Source prompts", "", "| source | zero-shot | its own prompt | CPU s |", "|---|---|---|---|"]
    for name, r in res["sources"].items():
        if r is None:
            lines.append(f"| {name} | pending | pending | |")
        else:
            lines.append(f"| {name} | {r.get('zero_shot_acc', float('nan')):.3f} | {r.get('test_acc', float('nan')):.3f} "
                         f"| {r.get('cpu_s', 0):.0f} |")
    lines += ["", "### Target accuracy (mean ± std over seeds)", "",
              "| method | " + " | ".join(args.target_list) + " |", "|---" * (len(args.target_list) + 1) + "|"]
    lines.append("| zero-shot | " + " | ".join(_cell(res["zero"].get(t, []), seeds) for t in args.target_list) + " |")
    for m in args.method_list:
        runs = res["runs"].get(m, {})
        lines.append(f"| {m} | " + " | ".join(_cell([r["acc"] for r in runs.get(t, [])], seeds)
                                               for t in args.target_list) + " |")
    lines += [""] + verdict(res, args)
    found = checks(res, args)
    if found:
        lines += [""] + found
    other = sensitivity(res, collect_variants(args), args)
    if other:
        lines += [""] + other
    pct = res["runs"].get("PCT", {})
    if pct:
        names = sorted({k for runs in pct.values() for r in runs for k in r["attention"]})
        lines += ["", "### Learned PCT attention over sources (mean over seeds)", "",
                  "| target | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for t, runs in pct.items():
            lines.append(f"| {t} | " + " | ".join(f"{statistics.mean(r['attention'][n] for r in runs):.3f}"
                                                  for n in names) + " |")
    spot = res["runs"].get("SPoT", {})
    if spot:
        lines += ["", "SPoT's retrieved source (one per seed): "
                  + "; ".join(f"{t}: {', '.join(r['spot_source'] for r in runs)}" for t, runs in spot.items())]
    lines += ["", "### Trainable parameters and cost per target run", "",
              ("Counted as the paper counts its 0.035%: the parameters of one target prompt (the frozen `P_0`/`S_k` "
              "are shared by all targets)."), "", "| method | trainable | % of the model | CPU s per run (mean) |",
              "|---|---|---|---|"]
    for m in args.method_list:
        runs = [r for rs in res["runs"].get(m, {}).values() for r in rs]
        if runs:
            lines.append(f"| {m} | {runs[0]['trainable']:,} | {100 * runs[0]['trainable'] / runs[0]['base_params']:.4f}% "
                         f"| {statistics.mean(r['cpu_s'] for r in runs):.0f} |")
    if res["pending"]:
        lines += ["", f"### Not finished yet ({len(res['pending'])})", "", ", ".join(res["pending"])]
    return "\n".join(lines)


def write_report(args) -> str:
    """Regenerates the section in ``args.out`` (atomically, the rest of the page kept) and prints it."""
    section = render(args)
    write_section(args.out, SECTION, section, TITLE)
    print(section, flush=True)
    return section
