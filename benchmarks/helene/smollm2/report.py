"""docs/benchmarks/helene_llm.md from the committed runs of the SmolLM2 grid (:mod:`benchmarks.helene.smollm2.grid`;
whatever has finished)."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks.common.fmt import fmt
from benchmarks.common.pages import write_page
from benchmarks.common.paths import DOCS, data_dir
from benchmarks.common.provenance import CPU_FLAGS
from benchmarks.helene.smollm2 import runs
from benchmarks.helene.smollm2.diagnostics import projected_gradient_section
from benchmarks.helene.smollm2.grid import (
    FOLLOW_UPS,
    GRIDS,
    MAIN_STEPS,
    MAX_EXTENSIONS,
    MAX_TEST,
    PRIORITY,
    SEEDS,
    SWEEP_STEPS,
    selected_lr,
    sweep_on_record,
    sweep_score,
    sweep_specs,
    sweep_zero_shot_spec,
)
from benchmarks.helene.smollm2.journal import partial_path
from benchmarks.helene.smollm2.measure import MEMORY_MODES
from benchmarks.helene.smollm2.runs import CACHE, OPTIMIZERS, ZO_METHODS, RunSpec, load_result

DOC = DOCS / "helene_llm.md"
NAMES = {"zeroshot": "zero-shot", **{name: opt.label for name, opt in OPTIMIZERS.items()}}


def _memory_section() -> list[str]:
    """The peak-memory tables: RSS on CPU and, when measured on a GPU, allocated CUDA memory."""
    lines: list[str] = []
    for device in ("cpu", "cuda"):
        name = (lambda m: f"memory_{m}.json") if device == "cpu" else (lambda m: f"memory_cuda_{m}.json")
        mem = {m: json.loads((CACHE / name(m)).read_text()) for m in MEMORY_MODES if (CACHE / name(m)).is_file()}
        key = "peak_rss_mib" if device == "cpu" else "peak_cuda_mib"
        if not mem:
            if device == "cpu":
                lines.append("Not measured on CPU yet (`python -m benchmarks.helene.smollm2 memory`).")
            continue
        if device == "cpu":
            lines += [("CPU: peak RSS of the whole process (`ru_maxrss`), each mode in a fresh process, SST-2 k=16 "
                       "seed 42, batch 16, 3 steps (inference: 2 test batches of 32), same imports (Lightning + "
                       "PeftModule) in every mode."), ""]
        else:
            lines += ["", (f"GPU ({mem[next(iter(mem))].get('device', 'cuda')}): peak CUDA memory allocated by the "
                           "process (`torch.cuda.max_memory_allocated`), same modes and batches as the CPU table; "
                           "it counts the model, activations and optimizer state, not the CUDA context."), ""]
        inference = mem.get("inference", {}).get(key)
        lines += [f"| mode | trainable parameters | peak {'RSS' if device == 'cpu' else 'CUDA'} (MiB) | × inference |",
                  "|---|---|---|---|"]
        for mode in MEMORY_MODES:
            if mode in mem and mem[mode].get(key) is not None:
                value = mem[mode][key]
                ratio = "—" if not inference else f"{value / inference:.3f}"
                lines.append(f"| {mode} | {mem[mode].get('trainable', 0):,} | {value:.0f} | {ratio} |")
        if "helene_full" in mem:
            state = 2 * mem["helene_full"]["trainable"] * 4 / 2**20
            lines += ["", (f"HELENE keeps two fp32 state vectors (m, h) per trainable parameter: {state:.0f} MiB here, "
                      "included in its row.")]
    return lines


def _speed_section() -> list[str]:
    """ZO step breakdown tables, one per device measured (``speed.json`` on CPU, ``speed_cuda.json`` on a GPU)."""
    lines: list[str] = []
    for path in (CACHE / "speed.json", CACHE / "speed_cuda.json"):
        if not path.is_file():
            continue
        sp = json.loads(path.read_text())
        where = sp.get("device") or f"cpu: {sp['threads']} thread(s)"
        # Say what each number is: the step rows are medians of the steps after the first, the forward per batch
        # the fastest of its timed calls (measure.measure_speed), and a CPU timing needs the CPU's flags beside it.
        first = next(iter(sp["steps"].values()), [])
        timed_steps = max(len(first) - 1, 1) if first else 0
        flags = ("CPU flags " + (", ".join(sp["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS))
                 if "cpu_flags" in sp else "CPU flags not recorded (measured before the file kept them)")
        lines += ["", (f"**{where}** — full-parameter steps on random token ids, {sp['length']} tokens per row; "
                       "forward = `prompt_cls_forward` (decoder + label-word rows); step rows: medians of "
                       f"{timed_steps} steps after the first (which allocates the optimizer state); forward per batch "
                       "size: the fastest of its timed calls after one untimed call"
                       + (", timed with CUDA synchronisation" if where.startswith("cuda") else "")
                       + (f"; {flags}" if not where.startswith("cuda") else "") + "."), "",
                  "| method | batch | step (ms) | two forwards (ms) | perturb + restore + update (ms) | share of the step |",
                  "|---|---|---|---|---|---|"]
        over = {}
        for method, rows in sp["steps"].items():
            rows = rows[1:] or rows  # the first step allocates the optimizer state
            step = statistics.median(r["step"] for r in rows)
            fwd = statistics.median(r["forward"] for r in rows)
            over[method] = statistics.median(r["overhead"] for r in rows)
            lines.append(f"| {method} | 16 | {1e3 * step:.1f} | {1e3 * fwd:.1f} | {1e3 * (step - fwd):.1f} | "
                         f"{(step - fwd) / step:.1%} |")
        lines += ["", "Forward time per batch size and the share the (batch-independent) overhead would take:", "",
                  "| batch × tokens | forward (ms) | " + " | ".join(f"{m} overhead share" for m in over) + " |",
                  "|---|---|" + "---|" * len(over)]
        for b, fwd in sorted(sp["forward"].items(), key=lambda kv: int(kv[0])):
            shares = [f"{o / (o + 2 * fwd):.1%}" for o in over.values()]
            lines.append(f"| {b} × {sp['length']} | {1e3 * fwd:.1f} | " + " | ".join(shares) + " |")
        below = _batch_below(over, sp["forward"], 0.10)
        if below:
            lines += ["", "Smallest measured batch at which the overhead is below 10% of the step: "
                      + ", ".join(f"{m} {b if b else 'none up to ' + str(max(map(int, sp['forward'])))}"
                                  for m, b in below.items()) + "."]
        if sp.get("loadavg"):
            lines += ["", (f"Load average when measured: {', '.join(f'{x:.2f}' for x in sp['loadavg'])} "
                           f"(commit {sp.get('commit', '?')}).")]
    if not lines:
        lines.append("Not measured yet (`python -m benchmarks.helene.smollm2 speed`).")
    return lines


def _batch_below(over: dict[str, float], forward: dict, share: float) -> dict[str, int | None]:
    """Per method, the smallest measured batch whose overhead share ``o / (o + 2·forward)`` is below ``share``."""
    batches = sorted(forward, key=int)
    return {m: next((int(b) for b in batches if o / (o + 2 * forward[b]) < share), None) for m, o in over.items()}


def _majority(spec: dict) -> float | None:
    """Accuracy of always answering the most frequent label of ``spec``'s test set (``None`` without its data).

    The floor a classifier must clear: a zero-shot model can sit below it (RTE's does), and a run that only
    shifts its predictions towards one label rises to it without learning the task.
    """
    from peftplug.errors import DataError, MissingFileError
    from peftplug.prompt_cls import kshot_files, split_rows

    try:
        files = kshot_files(data_dir(), spec["task"], spec["k"], spec["split_seed"])
        rows = split_rows(spec["task"], files, spec["k"], spec["split_seed"], spec["max_test"])["test"]
    except (MissingFileError, DataError):
        return None
    return max(Counter(r["label"] for r in rows).values()) / len(rows)


def _fmt(x: float | None, digits: int = 3) -> str:
    return fmt(x, f".{digits}f")


def _mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)} seeds)"


def _final_loss(result: dict, last: int = 20) -> float | None:
    losses = [s["loss"] for s in result["steps"][-last:] if s["loss"] is not None]
    return sum(losses) / len(losses) if losses else None


def _smoothed(result: dict, window: int = 10) -> list[tuple[int, float]]:
    """(step, running mean of the training loss over the last ``window`` steps)."""
    out, buf = [], []
    for s in result["steps"]:
        if s["loss"] is None:
            continue
        buf = (buf + [s["loss"]])[-window:]
        out.append((s["step"], sum(buf) / len(buf)))
    return out


def _steps_to(curve: list[tuple[int, float]], target: float, below: bool = True) -> int | None:
    for step, value in curve:
        if (value <= target) if below else (value >= target):
            return step
    return None


def _overhead_share(result: dict) -> float | None:
    """Share of a step's wall time spent outside the decoder forwards (perturbation, update, Lightning)."""
    rows = result["steps"][2:]  # the first steps include lazy allocation of optimizer state
    total = sum(r["time"] for r in rows)
    return None if not rows or total == 0 else 1.0 - sum(r["forward_time"] for r in rows) / total


def _targets_section(main: dict[tuple[str, int, str], dict], zero: dict[str, dict], methods, seeds) -> list[str]:
    """The issue's accuracy target, per optimizer: beats zero-shot by more than its seed std on at least two tasks.

    A task counts only once every seed has finished (a std needs them); the verdict says how many tasks are in.
    With two seeds the std can be far below the test set's own sampling error, so each cell also gives the
    binomial standard error of an accuracy on that test set, sqrt(p(1 − p)/n) at the zero-shot p, and the last
    column counts the tasks beaten beyond both.
    """
    tasks = sorted({t for t, _, _ in main})
    lines = ["| optimizer | " + " | ".join(f"{t}: gain over zero-shot vs seed std (test-set SE)" for t in tasks)
             + " | tasks beaten beyond the std | beyond the std and the SE |", "|---|" + "---|" * (len(tasks) + 2)]
    for method in methods:
        cells, beaten, beaten_se, complete = [], 0, 0, 0
        for task in tasks:
            accs = [main[task, seed, method]["test_acc"] for seed in seeds if (task, seed, method) in main]
            base = zero.get(task, {}).get("test_acc")
            if len(accs) < len(seeds) or base is None:
                cells.append(f"{len(accs)} of {len(seeds)} seeds")
                continue
            gain, std = statistics.mean(accs) - base, statistics.stdev(accs)
            se = math.sqrt(base * (1.0 - base) / zero[task]["n_test"])
            complete += 1
            beaten += gain > std
            beaten_se += gain > max(std, se)
            cells.append(f"{gain:+.3f} vs {std:.3f} ({se:.3f}): {'yes' if gain > std else 'no'}")
        if complete or any(c != f"0 of {len(seeds)} seeds" for c in cells):
            lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + f" | {beaten} of {complete} complete | "
                         f"{beaten_se} of {complete} |")
    return lines


def _plot(main: dict[tuple[str, int, str], dict], zero: dict[str, dict], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for t, _, _ in main})
    if not tasks:
        return False
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    # One colour per optimizer, in registry order (so a new optimizer gets the next one).
    colors = {name: f"C{i}" for i, name in enumerate(OPTIMIZERS)}
    for col, task in enumerate(tasks):
        ax_loss, ax_acc = axes[0][col], axes[1][col]
        for (t, seed, method), result in sorted(main.items()):
            if t != task:
                continue
            per = OPTIMIZERS[method].forwards_per_step
            style = "-" if seed == 42 else "--"
            curve = _smoothed(result)
            ax_loss.plot([s * per for s, _ in curve], [v for _, v in curve], style, color=colors[method],
                         label=f"{NAMES[method]} s{seed}")
            ax_acc.plot([v["step"] * per for v in result["val"]], [v["acc"] for v in result["val"]], style,
                        color=colors[method], label=f"{NAMES[method]} s{seed}")
        if task in zero:
            ax_acc.axhline(zero[task]["test_acc"], color="k", lw=0.8, ls=":", label="zero-shot (test)")
        ax_loss.set_title(f"{task}: training loss (running mean of 10 steps)")
        ax_acc.set_title(f"{task}: dev accuracy (32 examples)")
        for ax in (ax_loss, ax_acc):
            ax.set_xlabel("forward passes over a training batch (AdamW: + one backward each)")
            ax.grid(alpha=0.3)
        ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _progress(spec: RunSpec) -> str:
    """`` — journal at step N of M ...`` for a run begun but not finished whose journal is on disk, else ``""``."""
    path = partial_path(runs.PARTIAL, spec.run_id)
    if not path.is_file():
        return ""
    steps = len(json.loads(path.read_text()).get("steps", []))
    return f" — journal at step {steps} of {spec.steps} (running, or stopped and resumable from it)"


def write_report(queue: list[tuple[RunSpec | None, str]], doc: Path | None = None) -> Path:
    """Writes the page from the queue's finished runs and lists the rest.

    Args:
        queue: ``benchmarks.helene.smollm2.grid.queue()``.
        doc: The page (default :data:`DOC`); its plot goes beside it.
    """
    doc = doc or DOC
    loaded = {spec.run_id: load_result(spec) for spec, _ in queue if spec is not None}
    finished = {run_id: r for run_id, r in loaded.items() if r is not None}
    results = [r for r in finished.values()]
    zero = {r["spec"]["task"]: r for r in results
            if r["spec"]["method"] == "zeroshot" and r["spec"]["max_test"] == MAX_TEST[r["spec"]["task"]]}
    sweep_zero = finished.get(sweep_zero_shot_spec().run_id)
    main = {(r["spec"]["task"], r["spec"]["split_seed"], r["spec"]["method"]): r for r in results
            if r["spec"]["purpose"] == "main" and r["spec"]["method"] != "zeroshot"}
    lines = [
        "# HELENE and MeZO on SmolLM2-135M-Instruct, MeZO's prompt-based protocol",
        "",
        (f"Generated by `python -m benchmarks.helene.smollm2 report` from the runs committed under "
        f"`benchmarks/helene/results/helene_llm/` (the newest finished {_newest(results)}) — **only what has finished "
        "is reported**; the last section lists the rest. Protocol, settings and resume command: the docstring of "
        "`benchmarks/helene/smollm2/grid.py`; method: [../helene.md](../helene.md)."),
        "",
        ("Setting: SmolLM2-135M-Instruct (fp32, 134.5M parameters, tied embeddings), LM-BFF/MeZO k-shot splits "
        "(k = 16 per class), the task as a plain-text prompt ending where the label word goes (`peftplug.prompt_cls`),"
        " loss = cross-entropy over the label words' logits at the answer position, accuracy = argmax over them. "
        "Zeroth-order runs train **all** parameters (eval mode, ε = 1e-3, batch 16 = the whole 32-example training "
        f"set in 2 steps, {MAIN_STEPS} steps); AdamW trains LoRA r = 8 (α 16, all linear layers of the blocks) on "
        "the same batches. One torch thread per process on a 2-core CPU shared with other jobs: wall times are "
        "indicative only."),
        "",
        "## Zero-shot",
        "",
        ("| task | template | label words | prompt tokens (mean / max, test) | test examples | test accuracy | "
         "majority class (test) |"),
        "|---|---|---|---|---|---|---|",
    ]
    majority = {task: _majority(r["spec"]) for task, r in zero.items()}
    for task, r in sorted(zero.items()):
        mean_len, max_len = r["token_lengths"]["test"]
        template = r["template"].replace("\n", "\\n").replace("|", "\\|")
        lines.append(f"| {task} | `{template}` | {' / '.join(r['label_words'])} | {mean_len:.1f} / {max_len} | "
                     f"{r['n_test']} | {r['test_acc']:.3f} | {_fmt(majority[task])} |")
    lines += ["", ("Majority class: the accuracy of always answering the test set's most frequent label — the "
                   "floor a trained classifier must clear (a prior shifted towards one label reaches it without "
                   "learning the task).")]
    probe_path = CACHE / "probe.json"
    if probe_path.is_file():
        lines += ["", ("Rendering probe (zero-shot accuracy on the 64 train + dev examples of split seed 42; chosen "
                  "before any training, test data untouched):"), "",
                  "| task | rendering | accuracy | prompt tokens (mean / max) |", "|---|---|---|---|"]
        for row in json.loads(probe_path.read_text()):
            lines.append(f"| {row['task']} | {row['format']} | {row['acc']:.3f} ({row['n']}) | "
                         f"{row['mean_tokens']:.1f} / {row['max_tokens']} |")

    lines += ["", f"## lr sweeps ({SWEEP_STEPS} steps, SST-2 split seed 42, test on a fixed 200)", "",
              "Selection: lowest mean training loss over the last 20 steps (a run with a non-finite loss is out). "
              + (f"Zero-shot on the same {sweep_zero.get('n_test', sweep_zero['spec']['max_test'])} test "
                 f"sentences: {sweep_zero['test_acc']:.3f}."
                 if sweep_zero else "Zero-shot on the same test sentences: not run yet."), "",
              *([("A row *on record* is an lr the sweep selected when it ran; that sweep's result files were lost "
                  "with the uncommitted `runs/` folder, and its generated table is kept in "
                  "[helene_llm_sweep.md](helene_llm_sweep.md)."), ""]
                if any(sweep_on_record(m) for m in PRIORITY) else []),
              "| optimizer | lr | final train loss | dev acc (end) | test acc | s/step | selected |",
              "|---|---|---|---|---|---|---|"]
    for method in PRIORITY:
        chosen = selected_lr(method)
        if sweep_on_record(method):
            lines.append(f"| {NAMES[method]} | {chosen:g} | [on record](helene_llm_sweep.md) | | | | **yes** |")
            continue
        for spec in sweep_specs(method):
            r = load_result(spec)
            if r is None:
                lines.append(f"| {NAMES[method]} | {spec.lr:g} | not run yet | | | | |")
                continue
            score = sweep_score(r)
            per_step = statistics.median(s["time"] for s in r["steps"]) if r["steps"] else None
            dev = r["val"][-1]["acc"] if r["val"] else None
            lines.append(f"| {NAMES[method]} | {spec.lr:g} | {'diverged' if score == float('inf') else _fmt(score)} | "
                         f"{_fmt(dev)} | {r['test_acc']:.3f} | {_fmt(per_step, 1)} | "
                         f"{'**yes**' if chosen == spec.lr else ''} |")

    lines += ["", f"## Core grid ({MAIN_STEPS} steps)", ""]
    if not main:
        lines.append("No run of the core grid has finished yet.")
    else:
        lines += [("| task | optimizer | lr | test accuracy (mean ± std over seeds) | vs zero-shot | final train loss "
                  "(seed 42) | steps to MeZO's final train loss | steps to MeZO's final dev acc | vs majority class |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for task in sorted({t for t, _, _ in main}):
            mezo = main.get((task, 42, "mezo"))
            mezo_loss = _final_loss(mezo, 10) if mezo else None
            mezo_acc = mezo["val"][-1]["acc"] if mezo and mezo["val"] else None
            for method in (*PRIORITY, *FOLLOW_UPS):
                runs = [main[k] for k in sorted(main) if k[0] == task and k[2] == method]
                if not runs:
                    continue
                accs = [r["test_acc"] for r in runs]
                base = zero.get(task, {}).get("test_acc")
                delta = "—" if base is None else f"{statistics.mean(accs) - base:+.3f}"
                r42 = main.get((task, 42, method))
                to_loss = to_acc = "—"
                if r42 and mezo_loss is not None:
                    hit = _steps_to(_smoothed(r42), mezo_loss)
                    to_loss = "not reached" if hit is None else str(hit)
                if r42 and mezo_acc is not None:
                    hit = _steps_to([(v["step"], v["acc"]) for v in r42["val"]], mezo_acc, below=False)
                    to_acc = "not reached" if hit is None else str(hit)
                floor = majority.get(task)
                above = "—" if floor is None else f"{statistics.mean(accs) - floor:+.3f}"
                lines.append(f"| {task} | {NAMES[method]} | {runs[0]['spec']['lr']:g} | {_mean_std(accs)} | {delta} | "
                             f"{_fmt(_final_loss(r42, 10)) if r42 else '—'} | {to_loss} | {to_acc} | {above} |")
        lines += ["", ("Target: MeZO and HELENE beat zero-shot by more than the seed std on at least two tasks "
                       f"(std over split seeds {', '.join(map(str, SEEDS))}; a task counts once every seed has "
                       "finished). In brackets the test-set SE, sqrt(p(1 − p)/n) at the zero-shot accuracy p on its n "
                       "test examples: with two seeds the std can be far below the test set's own sampling error."),
                  ""]
        lines += _targets_section(main, zero, PRIORITY, SEEDS)
        lines += projected_gradient_section(list(main.values()), NAMES)
        if _plot(main, zero, doc.with_name("helene_llm_curves.png")):
            lines += ["", "![curves](helene_llm_curves.png)"]

    lines += ["", "## Memory (measured)", ""]
    lines += _memory_section()
    lines += ["", "## Cost of a zeroth-order step", ""]
    lines += _speed_section()
    # Only CPU runs: on a GPU the forward hooks see kernel launches, not kernel time (no synchronisation inside a
    # step), so the split would be meaningless there; the speed table above synchronises.
    shares = [(r["run_id"], _overhead_share(r)) for r in results
              if r["spec"]["method"] in ZO_METHODS and r["steps"]
              and not r.get("device", "cpu").startswith("cuda")]
    if shares:
        lines += ["", ("Inside the benchmark runs (real batches; share of step wall time outside the decoder "
                  "forwards — perturbation, restore, update and Lightning's own bookkeeping):"), "",
                  "| run | median tokens per batch (width) | share |", "|---|---|---|"]
        for run_id, share in shares:
            r = finished[run_id]
            width = statistics.median(s["width"] for s in r["steps"])
            tokens = statistics.median(s["tokens"] for s in r["steps"])
            lines.append(f"| {run_id} | {tokens:.0f} ({16} × {width:.0f} padded) | {_fmt(share and 100 * share, 1)}% |")

    missing = [spec for spec, _ in queue if spec is not None and spec.run_id not in finished]
    blocked = [why for spec, why in queue if spec is None]
    lines += ["", "## What has not run yet", ""]
    # A blocked entry waits for an lr sweep, which the core grid needs too: the core is complete only without any.
    core_complete = not blocked and all(s.method in FOLLOW_UPS for s in missing)
    if not missing and not blocked:
        lines.append("Nothing: the core grid and its follow-ups are complete.")
    elif core_complete:
        lines.append("The core grid is complete; of its follow-ups (`run --phase followup`) these have not run:")
    lines += [f"- `{spec.run_id}`{_progress(spec)}" for spec in missing] + [f"- {b}" for b in blocked]
    lines += ["", "Resume (skips finished runs; a run with a journal replays it and goes on):", "",
              ("    OMP_NUM_THREADS=1 setsid nohup .venv/bin/python -m benchmarks.helene.smollm2 run "
              "> runs/helene_llm/queue.log 2>&1 &"), ""]
    lines += ["Grids: " + "; ".join(f"{NAMES[m]} {', '.join(f'{v:g}' for v in GRIDS[m])}" for m in PRIORITY)
              + f"; each extended a decade past its edge while the best point sits there (at most {MAX_EXTENSIONS}"
              " times).", ""]
    return write_page(doc, "\n".join(lines))


def _newest(results: list[dict]) -> str:
    """When the newest of ``results`` finished (start + seconds), so that the page depends on the results alone."""
    ends = [r["started"] + r["seconds"] for r in results if "started" in r and "seconds" in r]
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(max(ends))) if ends else "—"
