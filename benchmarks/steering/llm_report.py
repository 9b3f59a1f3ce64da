"""The report of benchmarks/steering/llm.py: docs/benchmarks/steering_llm.md and its plot, from the cached results.

Rewritten after every finished setting, so a partial run documents what finished and lists what has not run.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common.fmt import fmt
from peftplug.fileio import atomic_write, atomic_write_text

PPL_BUDGET = 1.2
KEPT_BUDGET = 0.9
GOAL = 0.3
LABELS = {"caa": "CAA", "pca_center": "PCA-center", "vector_prompt": "vector-prompt", "trainable": "trained (preference)",
          "prompt": "prompt baseline", "unsteered": "unsteered"}


CONCEPT_DATA = {
    "sst2": ("{pairs} EasyEdit2-style SST-2 rows (shared question, matching = positive sentence, not-matching = "
             "negative sentence)"),
    "happy_sad": ("{pairs} happy/sad rows from the representation-engineering emotion scenarios (matching = a "
                  "happiness scenario, not-matching = a sadness one)"),
    "weddings": "8 wedding / non-wedding minimal pairs written in `benchmarks/steering/llm_data.py`",
}


def _device_text(result: dict) -> str:
    device, threads = str(result.get("device", "cpu")), int(result.get("threads", 1))
    return ("CPU, " + ("one thread" if threads == 1 else f"{threads} threads")) if device == "cpu" else device


def load_results(root: Path) -> dict[str, dict]:
    """``{setting key: result}`` of the finished settings.

    Args:
        root: ``runs/steering_llm/<concept>``.
    """
    out = {}
    for path in sorted((root / "results").glob("*.json")):
        result = json.loads(path.read_text())
        out[result["key"]] = result
    return out


def is_scored(result: dict) -> bool:
    """Whether a result carries concept scores (a ``--no-score`` run leaves them to ``--rescore``)."""
    return result.get("scored", True) and "positive_rate" in result


def _fmt(x, digits: int = 3) -> str:
    return fmt(x, f".{digits}f", none="–", nan="–")


def _derived(result: dict, base: dict) -> dict:
    return {"delta": result["positive_rate"] - base["positive_rate"],
            "ppl_ratio": result["perplexity"] / base["perplexity"],
            "kept": result.get("instruction_kept", float("nan"))}


def within_budget(d: dict) -> bool:
    """Perplexity ratio <= 1.2 and instruction accuracy kept >= 0.9."""
    return d["ppl_ratio"] <= PPL_BUDGET and d["kept"] >= KEPT_BUDGET


def best_settings(results: dict, base: dict) -> dict:
    """Per (method, direction): the finished setting inside the budgets that moves the positive rate most that way."""
    best = {}
    for r in results.values():
        if r["method"] == "unsteered":
            continue
        d = _derived(r, base)
        if not within_budget(d):
            continue
        key = (r["method"], r["direction"])
        if key not in best or d["delta"] * r["direction"] > best[key][1]["delta"] * r["direction"]:
            best[key] = (r, d)
    return best


def plot(results: dict, base: dict, path: Path) -> None:
    """Positive rate vs perplexity ratio, one marker per method (filled: inside the instruction budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {"caa": "o", "pca_center": "s", "vector_prompt": "^", "trainable": "D", "prompt": "*"}
    for method, marker in markers.items():
        rows = [r for r in results.values() if r["method"] == method]
        for kept_ok in (True, False):
            pts = [(_derived(r, base)["ppl_ratio"], r["positive_rate"]) for r in rows
                   if (r.get("instruction_kept", 0) >= KEPT_BUDGET) == kept_ok]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=60 if method == "prompt" else 36,
                           label=LABELS[method] if kept_ok else None, facecolors=None if kept_ok else "none",
                           edgecolors=f"C{list(markers).index(method)}", color=f"C{list(markers).index(method)}")
    ax.axhline(base["positive_rate"], color="grey", lw=0.8, ls="--", label="unsteered")
    ax.axvline(PPL_BUDGET, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("perplexity ratio (steered generation under the unsteered model / unsteered)")
    ax.set_ylabel("positive rate (classifier)")
    ax.set_title("SmolLM2-135M-Instruct, SST-2 sentiment: concept vs perplexity\n(hollow: instruction kept < 0.9)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def write_report(root: Path, plan: list, doc: Path, args: dict) -> None:
    """Writes the markdown report (and the plot) from what has finished.

    Args:
        root: ``runs/steering_llm/<concept>``.
        plan: The benchmark's settings, in run order.
        doc: Markdown output path.
        args: The benchmark's arguments (recorded in the report).
    """
    found = load_results(root)
    # Unscored results (--no-score) have no concept numbers: never shown as scores, only counted.
    results = {k: r for k, r in found.items() if is_scored(r)}
    unscored = sorted(k for k in found if k not in results)
    lines = ["# Steering SmolLM2-135M-Instruct (EasyEdit2-style evaluation)", "",
             ("Generated by `benchmarks/steering/llm.py` (resumable; this page is rewritten from the cached results "
             "after every setting). How to read it and what it means: [docs/steering.md](../steering.md)."), ""]
    if unscored:
        lines += [(f"**{len(unscored)} settings are generated but not scored yet** (run with `--no-score`); they are "
                   "left out below until `python -m benchmarks.steering.llm --rescore` scores them."), ""]
    base = results.get("unsteered")
    if base is None:
        lines += ["Nothing has finished yet." if not unscored else "Nothing is scored yet.", ""]
        atomic_write_text(doc, "\n".join(lines))
        return
    clf = root / "classifier.json"
    clf_meta = json.loads(clf.read_text()) if clf.is_file() else None
    if clf_meta is None and (root.parent / "classifier" / "classifier.json").is_file():
        clf_meta = json.loads((root.parent / "classifier" / "classifier.json").read_text())
    facts_path = root / "facts_baseline.json"
    facts = "?"
    if facts_path.is_file():
        right = json.loads(facts_path.read_text())["correct"]
        facts = f"{len(right)} ({sum(right)} answered right unsteered)"
    lines += [
        "## Setup", "",
        (f"- Model: SmolLM2-135M-Instruct (fp32, {_device_text(base)}). Prompts: {base['n_prompts']} held-out neutral "
        "openers in the chat template (`benchmarks/steering/llm_data.py`; none appears in any training row), "
        f"greedy, {base['max_new_tokens']} new tokens at most."),
        (f"- Concept data: {CONCEPT_DATA.get(root.name, root.name).format(pairs=args['pairs'])} "
        "in the chat template, read at the answer tokens (EasyEdit2's CAA). "
        f"Vector-prompt: {args['pairs'] // 2} `{{input, output, prompt}}` rows. Trained vector: preference "
        f"(BiPO-like) objective, {args['train_steps']} Adam steps, lr {args['train_lr']}, batch 8."),
        ("- Every vector is rescaled to the norm of the CAA vector at its layer: multiplier `m` adds a vector of "
        "length `m·‖v_CAA(L)‖` at every token (EasyEdit2's `positions=all`), so methods differ only in direction."),
    ]
    if clf_meta and clf_meta.get("kind") == "keywords":
        lines.append("- Concept score: 1 when the generation contains a wedding word "
                     f"({', '.join(clf_meta['words'])}), else 0; positive rate = share of generations that do.")
    elif clf_meta and "dev_accuracy" in clf_meta:
        texts = (f"{clf_meta['n_train']} SST-2 train texts of ≥ {clf_meta['min_words']} words" if "min_words" in clf_meta
                 else f"{clf_meta['n_train']} SST-2 train rows, phrase fragments included")
        lines.append(f"- Concept score: a sentiment classifier trained here ({clf_meta['adapter']} on "
                     f"all-MiniLM-L6-v2, {texts}, {clf_meta['epochs']} epoch, {clf_meta['train_seconds']:.0f} s): "
                     f"**dev accuracy {clf_meta['dev_accuracy']:.3f}** on the 872 GLUE dev sentences. "
                     "Positive rate = share of generations it scores ≥ 0.5.")
    lines += [
        ("- Perplexity: of each generation under the unsteered model, conditioned on the original prompt (the prompt "
         "baseline's instruction is not in the condition); ratio = steered / unsteered mean perplexity. Fluency = "
         "EasyEdit2's n-gram entropy (bits); distinct-n as EasyEdit2."),
        (f"- Instruction following: {facts} short factual questions (greedy, 24 tokens); *kept* = share of those "
         "answered right unsteered that stay right under steering (only those are asked again)."), "",
        "## Unsteered", "",
        (f"positive rate **{_fmt(base['positive_rate'])}**, mean P(positive) {_fmt(base['concept_mean'])}, perplexity "
        f"{_fmt(base['perplexity'], 2)}, fluency {_fmt(base['fluency'], 2)}, distinct-1/2/3 "
        f"{_fmt(base['distinct_1'], 2)}/{_fmt(base['distinct_2'], 2)}/{_fmt(base['distinct_3'], 2)}, mean new tokens "
        f"{_fmt(base['mean_new_tokens'], 1)}."), "",
    ]
    best = best_settings(results, base)
    lines += ["## Best setting per method inside the budgets", "",
              (f"Budgets: perplexity ratio ≤ {PPL_BUDGET}, instruction accuracy kept ≥ {KEPT_BUDGET}. Goal: a vector "
              f"method moves the positive rate by ≥ +{GOAL} (more positive) and ≤ −{GOAL} (more negative)."), "",
              "| method | direction | setting | positive rate | Δ vs unsteered | ppl ratio | kept | fluency |",
              "|---|---|---|---|---|---|---|---|"]
    for method in ("prompt", "caa", "pca_center", "vector_prompt", "trainable"):
        for direction in (1, -1):
            arrow = "more positive" if direction > 0 else "more negative"
            prompt_row = results.get(f"prompt_{'pos' if direction > 0 else 'neg'}")
            if method == "prompt" and (method, direction) not in best and prompt_row is not None:
                # The baseline has one setting per direction: shown even outside the budgets (it is the reference).
                d = _derived(prompt_row, base)
                lines.append(f"| {LABELS[method]} | {arrow} | instruction ✗ (outside the budgets) | "
                             f"{_fmt(prompt_row['positive_rate'])} | {d['delta']:+.3f} | {d['ppl_ratio']:.3f} | "
                             f"{_fmt(d['kept'], 2)} | {_fmt(prompt_row['fluency'], 2)} |")
                continue
            if (method, direction) not in best:
                ran = [r for r in results.values() if r["method"] == method and r["direction"] == direction]
                note = "none inside the budgets" if ran else "not run yet"
                lines.append(f"| {LABELS[method]} | {arrow} | {note} ({len(ran)} finished) | | | | | |")
                continue
            r, d = best[(method, direction)]
            where = "instruction" if method == "prompt" else f"L{r['layer']}, m={r['multiplier']:+g}"
            lines.append(f"| {LABELS[method]} | {arrow} | {where} | {_fmt(r['positive_rate'])} | "
                         f"**{d['delta']:+.3f}** | {d['ppl_ratio']:.3f} | {_fmt(d['kept'], 2)} | {_fmt(r['fluency'], 2)} |")
    lines += ["", *_verdict(best, results, base), ""]
    lines += ["## Every finished setting", "",
              "| setting | positive rate | Δ | ppl | ppl ratio | fluency | dist-1/2/3 | kept | new tokens | s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in plan:
        r = results.get(s.key)
        if r is None:
            continue
        d = _derived(r, base)
        flag = "" if within_budget(d) else " ✗"
        lines.append(f"| {s.key}{flag} | {_fmt(r['positive_rate'])} | {d['delta']:+.3f} | {_fmt(r['perplexity'], 2)} | "
                     f"{d['ppl_ratio']:.3f} | {_fmt(r['fluency'], 2)} | {_fmt(r['distinct_1'], 2)}/"
                     f"{_fmt(r['distinct_2'], 2)}/{_fmt(r['distinct_3'], 2)} | {_fmt(d['kept'], 2)} | "
                     f"{_fmt(r['mean_new_tokens'], 1)} | {r['seconds']:.0f} |")
    lines += ["", ("✗ = outside a budget. Settings are named `<method>_L<layer>_<multiplier>`. `s` = wall seconds of the "
                   "setting on shared, busy cores at low priority: not a speed measurement."), ""]
    missing = [s.key for s in plan if s.key not in results]
    if missing:
        lines += ["## Not run yet", "",
                  f"{len(missing)} of {len(plan)} settings have not run: " + ", ".join(f"`{k}`" for k in missing) + ".",
                  ("Resume with `OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.steering.llm` "
                  "(finished settings are skipped)."), ""]
    overhead = root / "overhead.json"
    if overhead.is_file():
        o = json.loads(overhead.read_text())
        tps = o["tokens_per_second"]
        lines += ["## Generation overhead", "",
                  (f"Greedy generation, batch {o['batch']} × {o['new_tokens']} new tokens, KV cache, "
                   f"{_device_text(o)}; "
                  f"unsteered and steered ({o['setting']}) interleaved, medians of {len(o['runs']['steered'])} rounds "
                  f"in one run: unsteered {tps['unsteered']:.1f} tokens/s, steered {tps['steered']:.1f} tokens/s, "
                  f"**ratio {o['ratio']:.3f}**. The machine is shared: only the interleaved ratio means "
                  "anything."), ""]
    if len(results) > 1:
        plot(results, base, doc.with_suffix(".png"))
        lines += ["## Concept vs perplexity", "", f"![positive rate vs perplexity ratio]({doc.with_suffix('.png').name})",
                  ""]
    lines += _examples(results, base, best)
    atomic_write_text(doc, "\n".join(lines))


def _verdict(best: dict, results: dict, base: dict) -> list[str]:
    vector = [k for k in best if k[0] not in ("prompt",)]
    up = max((best[k][1]["delta"] for k in vector if k[1] > 0), default=None)
    down = min((best[k][1]["delta"] for k in vector if k[1] < 0), default=None)
    out = []
    if up is None and down is None:
        return ["No vector setting inside the budgets has finished yet."]
    rate = base.get("positive_rate")
    room = {1: None if rate is None else 1.0 - rate, -1: rate}
    parts = []
    for direction, shift, name in ((1, up, "more positive"), (-1, down, "more negative")):
        if shift is None:
            parts.append(f"{name}: no setting inside the budgets")
        elif shift * direction >= GOAL:
            parts.append(f"{name}: **met** ({shift:+.3f})")
        elif room[direction] is not None and room[direction] < GOAL:
            # A rate is bounded by 0 and 1: a goal larger than the room left is not a test of the method.
            bound = " — the bound itself" if abs(shift) >= room[direction] - 1e-9 else ""
            parts.append(f"{name}: cannot be met on these prompts (the unsteered rate {rate:.3f} leaves "
                         f"{room[direction]:.3f}); best {shift:+.3f}{bound}")
        else:
            parts.append(f"{name}: **not met** ({shift:+.3f})")
    out.append(f"Goal ±{GOAL} (best vector setting inside the budgets): " + "; ".join(parts) + ".")
    for direction, name in ((1, "more positive"), (-1, "more negative")):
        prompt_row = results.get(f"prompt_{'pos' if direction > 0 else 'neg'}")
        if prompt_row is None:
            continue
        p_d = _derived(prompt_row, base)
        beats = [k[0] for k in vector if k[1] == direction and (
            best[k][1]["delta"] * direction > p_d["delta"] * direction
            or best[k][1]["ppl_ratio"] < p_d["ppl_ratio"] or best[k][1]["kept"] > p_d["kept"])]
        out.append(f"{name}: vector methods whose best in-budget setting beats the prompt baseline (Δ {p_d['delta']:+.3f}, "
                   f"ppl ratio {p_d['ppl_ratio']:.3f}, kept {p_d['kept']:.2f}) on at least one axis (shift, "
                   f"perplexity or kept): {', '.join(LABELS[m] for m in beats) or 'none'}.")
    return out


def _examples(results: dict, base: dict, best: dict) -> list[str]:
    """Generations of the unsteered model and of CAA's best settings, first openers."""
    lines = ["## Example generations (first three openers)", ""]
    shown = [("unsteered", base)]
    for direction in (1, -1):
        for method in ("caa", "prompt"):
            if (method, direction) in best:
                shown.append((best[(method, direction)][0]["key"], best[(method, direction)][0]))
    for key, r in shown:
        lines.append(f"**{key}**")
        lines.append("")
        for text in r["generations"][:3]:
            lines.append("> " + text.replace("\n", " ").strip()[:300])
            lines.append(">")
        lines.pop()
        lines.append("")
    return lines
