"""HELENE vs MeZO (ZO-SGD) vs ZO-Adam vs AdamW on real offline tasks with all-MiniLM-L6-v2.

    .venv/bin/python -m benchmarks.helene.minilm.bench [--quick] [--data-dir DIR] [--out docs/benchmarks/helene.md]
    .venv/bin/python -m benchmarks.helene.minilm.bench --only full   # the full-finetuning section alone
    .venv/bin/python -m benchmarks.helene.minilm.bench --report      # the page from the committed results

Settings (all on all-MiniLM-L6-v2 with a fresh classification head, classification-head protocol, no prompts):

- ``head``: every parameter of the pooler and the classifier (149k) on cached features of the frozen encoder —
  cheap enough on 2 CPU cores for the thousands of steps zeroth-order methods need;
- ``top``: full finetuning of the last transformer block + pooler + classifier (1.9M parameters), the lower
  five blocks frozen and cached, the last block evaluated for the [CLS] query only (exact, checked);
- ``lora``: PEFT LoRA (r=8) on every linear layer of the last block + the classifier;
- ``full``: true full finetuning, every parameter (22.7M, embeddings included) trainable, the whole Hugging Face
  forward each step. ~1 s per step on one core, so it runs only with ``--only full`` (a short budget, MeZO /
  HELENE / ZO-Adam / AdamW) and its section is merged into the existing page; a later full regeneration keeps it.

Reported: steps to reach MeZO's final training loss, test accuracy after the fixed step budget, extra memory
over plain inference, wall time per step. Keeps the raw results in ``benchmarks/helene/results/helene_minilm.json``
(and ``helene_minilm_full.json``) and renders ``docs/benchmarks/helene.md`` and ``helene_*.png`` from them.
Numbers come from one run on shared CPU cores: compare ratios within the run, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.pages import outputs, read_json, render_results, write_json
from benchmarks.common.paths import DOCS, data_dir, results_dir
from benchmarks.common.provenance import provenance
from benchmarks.helene.minilm import data, runs
from benchmarks.helene.minilm.report import merge_full_section, write_report

PAGE = DOCS / "helene.md"
RESULTS = results_dir("helene") / "helene_minilm.json"
FULL_RESULTS = results_dir("helene") / "helene_minilm_full.json"

# Per-optimizer grids (lr; eps = 1e-3 unless given). Chosen around MeZO's published ranges and rescaled to the
# size of each setting; each optimizer gets the same number of points.
GRIDS = {
    "head": {
        "MeZO": [{"lr": lr, "eps": 1e-3} for lr in (1e-3, 3e-3, 1e-2)] + [{"lr": 3e-3, "eps": 1e-2}],
        "HELENE": [{"lr": lr, "eps": 1e-3, "lam": 1.0} for lr in (3e-4, 1e-3, 3e-3)] + [{"lr": 1e-3, "eps": 1e-2, "lam": 1.0}],
        "ZO-Adam": [{"lr": lr, "eps": 1e-3} for lr in (3e-4, 1e-3, 3e-3)] + [{"lr": 1e-3, "eps": 1e-2}],
        "AdamW": [{"lr": lr} for lr in (1e-3, 3e-3)],
    },
    "top": {
        "MeZO": [{"lr": lr, "eps": 1e-3} for lr in (1e-3, 3e-3)],
        "HELENE": [{"lr": lr, "eps": 1e-3, "lam": 1.0} for lr in (3e-4, 1e-3)],
        "ZO-Adam": [{"lr": lr, "eps": 1e-3} for lr in (3e-5, 1e-4)],
        "AdamW": [{"lr": lr} for lr in (1e-4, 3e-4)],
    },
    # Full finetuning (22.7M parameters, ~1 s/step): the top setting's grids for MeZO and HELENE (a 12-step probe
    # put 3× larger — MeZO 1e-2, HELENE 3e-3 — past the divergence edge); ZO-Adam's shifted up one point (3e-5 did
    # not move in the probe); AdamW only at the lr selected on top.
    "full": {
        "MeZO": [{"lr": lr, "eps": 1e-3} for lr in (1e-3, 3e-3)],
        "HELENE": [{"lr": lr, "eps": 1e-3, "lam": 1.0} for lr in (3e-4, 1e-3)],
        "ZO-Adam": [{"lr": lr, "eps": 1e-3} for lr in (1e-4, 3e-4)],
        "AdamW": [{"lr": 3e-4}],
    },
    "lora": {
        "MeZO": [{"lr": lr, "eps": 1e-3} for lr in (3e-3, 1e-2)],
        "HELENE": [{"lr": lr, "eps": 1e-3, "lam": 1.0} for lr in (1e-3, 3e-3)],
        "ZO-Adam": [{"lr": lr, "eps": 1e-3} for lr in (1e-4, 3e-4)],
        "AdamW": [{"lr": lr} for lr in (1e-3, 3e-3)],
    },
}
for _key, _grid in GRIDS.items():
    if _key != "full":  # full: the four optimizers of the issue only (CPU budget)
        _grid["HELENE-curv"] = _grid["HELENE"]
FULL_OPTIMIZERS = ("MeZO", "HELENE", "ZO-Adam", "AdamW")
# HELENE's switches, each changed alone from the selected HELENE configuration.
ABLATIONS = {
    "paper (agnb, layer clip, anneal)": {},
    "annealing off": {"anneal": False},
    "clip none": {"clip": "none"},
    "clip per-coordinate (Sophia-like)": {"clip": "coordinate"},
    "estimator agnb_layer": {"hessian": "agnb_layer"},
    "estimator curvature (HiZOO-like)": {"hessian": "curvature"},
    "floor λ = 0.1": {"lam": 0.1},
    "floor λ = 10": {"lam": 10.0},
    # Floor far above any h: u = m/(γλ), i.e. annealed momentum SGD; lr scaled so that lr/λ is unchanged.
    "no Hessian (floor λ=1e4 always active, lr×1e4)": "no_hessian",
}


def head_problem(model, task: data.Task, caches: dict, batch: int) -> runs.Problem:
    """The ``head`` setting: pooler + classifier on frozen [CLS] features."""
    with torch.no_grad():
        feats = {s: data.top_cls(model, *caches[s]) for s in ("train", "test")}
    model.requires_grad_(False)
    for module in (data.bert_of(model).bert.pooler, data.bert_of(model).classifier):
        module.requires_grad_(True)
    n = len(task.train[1])
    return runs.Problem(
        f"head / {task.name}", "head", model, lambda s, idx: data.head_logits(model, feats[s][idx]),
        torch.tensor(task.train[1]), torch.tensor(task.test[1]), batch,
        torch.arange(n) if n <= 256 else torch.randperm(n, generator=torch.Generator().manual_seed(0))[:256],
        sum(p.numel() for p in model.parameters()))


def top_problem(model, task: data.Task, caches: dict, batch: int, setting: str) -> runs.Problem:
    """The ``top`` (full finetuning of the last block) or ``lora`` setting on the cached prefix."""
    if setting == "lora":
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, modules_to_save=["classifier"],
            target_modules=r".*encoder\.layer\.5\..*(query|key|value|dense)"))
    else:
        model.requires_grad_(False)
        bert = data.bert_of(model)
        for module in (bert.bert.encoder.layer[-1], bert.bert.pooler, bert.classifier):
            module.requires_grad_(True)
    n = len(task.train[1])
    return runs.Problem(
        f"{setting} / {task.name}", setting, model,
        lambda s, idx: data.head_logits(model, data.top_cls(model, caches[s][0][idx], caches[s][1][idx])),
        torch.tensor(task.train[1]), torch.tensor(task.test[1]), batch,
        torch.arange(n) if n <= 64 else torch.randperm(n, generator=torch.Generator().manual_seed(0))[:64],
        sum(p.numel() for p in model.parameters()))


def full_problem(model, tokenizer, task: data.Task, batch: int, test_len: int = 32) -> runs.Problem:
    """The ``full`` setting: every parameter trainable, the whole Hugging Face forward.

    Texts are tokenized once (padded to the token budget); each batch is cut to its longest text, which gives the
    same logits as padding to the budget (padding is masked) at a fraction of the cost.

    Args:
        model: ``BertForSequenceClassification`` (all of it is trained).
        tokenizer: Its tokenizer.
        task: The task.
        batch: Minibatch size.
        test_len: Token budget of the test texts (the other settings' cached test prefixes use 32).
    """
    model.requires_grad_(True)
    enc = {"train": tokenizer(task.train[0], padding="max_length", truncation=True, max_length=task.max_len,
                              return_tensors="pt"),
           "test": tokenizer(task.test[0], padding="max_length", truncation=True, max_length=test_len,
                             return_tensors="pt")}

    def forward(split, idx):
        ids, mask = enc[split]["input_ids"][idx], enc[split]["attention_mask"][idx]
        length = int(mask.sum(1).max())
        return model(input_ids=ids[:, :length], attention_mask=mask[:, :length]).logits

    n = len(task.train[1])
    return runs.Problem(
        f"full / {task.name}", "full", model, forward, torch.tensor(task.train[1]), torch.tensor(task.test[1]),
        batch, torch.arange(n) if n <= 64 else torch.randperm(n, generator=torch.Generator().manual_seed(0))[:64],
        sum(p.numel() for p in model.parameters()))


def summarize(problem: runs.Problem, best: dict[str, dict], all_runs: dict[str, list], infer_s: float) -> dict:
    """Table rows for one problem: the metrics of each optimizer's selected configuration."""
    mezo = best["MeZO"]
    target = mezo["final_loss"]
    initial = mezo["curve"][0][1]
    if not target < initial:  # MeZO made no progress (or diverged): "steps to MeZO's loss" would be meaningless
        target = None
    mezo_steps = runs.steps_to_reach(mezo["curve"], target) if target is not None else None
    param_bytes = problem.total_params * 4
    trainable_bytes = mezo["trainable"] * 4
    rows = []
    for name, r in best.items():
        steps = runs.steps_to_reach(r["curve"], target)
        rows.append({
            "optimizer": name, "hp": r["hp"], "final_loss": r["final_loss"], "acc": r["acc"], "steps_to_mezo": steps,
            "speedup": (mezo_steps / steps) if steps else None, "step_ms": 1e3 * r["step_time"],
            "step_vs_forward": r["step_time"] / infer_s, "extra_mb": r["extra_bytes"] / 2**20,
            "mem_ratio": (param_bytes + r["extra_bytes"]) / param_bytes,
            "extra_vs_trainable": r["extra_bytes"] / trainable_bytes,
        })
    return {"problem": problem.name, "setting": problem.setting, "trainable": mezo["trainable"],
                "total": problem.total_params, "rows": rows, "mezo_target": target, "mezo_steps": mezo_steps,
                "curves": {n: r["curve"] for n, r in best.items()},
                "sweep": [(n, r["hp"], r["final_loss"], r["acc"]) for n, rs in all_runs.items() for r in rs]}


def bench_problem(problem: runs.Problem, grids: dict, steps: int, eval_every: int, log,
                  names=runs.OPTIMIZERS) -> dict:
    """Sweeps every optimizer in ``names`` on one problem and summarizes."""
    best, all_runs = {}, {}
    for name in names:
        t0 = time.time()
        b, rs = runs.sweep(problem, name, grids[name], steps, eval_every)
        best[name], all_runs[name] = b, rs
        log(f"  {problem.name:32s} {name:8s} best {b['hp']} loss {b['final_loss']:.4f} acc {b['acc']:.3f} "
            f"({time.time() - t0:.0f}s)")
    return summarize(problem, best, all_runs, runs.inference_time(problem))


def rerun_with(problem: runs.Problem, hps: dict, steps: int, eval_every: int) -> dict:
    """Runs each optimizer once with given hyper-parameters (other seeds reuse the seed-42 choice)."""
    best = {n: runs.run(problem, n, hps[n], steps, eval_every) for n in runs.OPTIMIZERS}
    return summarize(problem, best, {n: [b] for n, b in best.items()}, runs.inference_time(problem))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None, help="default: peftplug.datadir.default_data_dir()")
    ap.add_argument("--out", default=None, help="page to write, its result files beside it (default: "
                    "docs/benchmarks/helene.md with benchmarks/helene/results/helene_minilm*.json)")
    ap.add_argument("--report", action="store_true", help="render the page from the result files; measure nothing")
    ap.add_argument("--quick", action="store_true", help="fewer steps, one seed, no top/LoRA sweeps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: tiny ops on shared cores slow down 30x with 2 spinning threads)")
    ap.add_argument("--seeds", default="13,21,42", help="SST-2 k=16 seeds (all five: 13,21,42,87,100)")
    ap.add_argument("--head-steps", type=int, default=None)
    ap.add_argument("--top-steps", type=int, default=None)
    ap.add_argument("--only", choices=["full"], default=None,
                    help="run only the full-finetuning setting and merge its section into the existing --out page")
    ap.add_argument("--full-steps", type=int, default=None, help="steps of the full setting (default 80)")
    ap.add_argument("--n-test", type=int, default=None,
                    help="held-out examples each accuracy is measured on (default 400; --quick: 200)")
    ap.add_argument("--draws", default=None,
                    help="comma-separated probe counts of the estimator study (default 1,100,1000; --quick: 1,100)")
    args = ap.parse_args(argv)
    page, results_file = outputs(args.out, PAGE, RESULTS)
    full_file = outputs(args.out, PAGE, FULL_RESULTS)[1]
    if args.report:
        if not report(results_file, full_file, page):
            raise SystemExit(f"no result file at {results_file}: run the benchmark first")
        return
    args.out = str(page)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data_root = Path(args.data_dir) if args.data_dir else data_dir()
    if not (data_root / "k-shot" / "SST-2").is_dir():
        print(f"skipped: shared data not found at {data_root} (pass --data-dir)")
        return
    started = time.time()
    lines: list[str] = []

    def log(msg: str) -> None:
        print(f"[{time.time() - started:5.0f}s] {msg}", flush=True)
        lines.append(msg)

    quick = args.quick
    if args.only == "full":
        run_full(data_root, full_file, page, args, started, log, lines)
        return
    head_steps = args.head_steps or (300 if quick else 1000)
    top_steps = args.top_steps or (40 if quick else 150)
    seeds = [42] if quick else [int(s) for s in args.seeds.split(",")]
    n_test = args.n_test or (200 if quick else 400)
    batch = 16

    model, tok = data.load_minilm(2)
    err = data.check_top_forward(model, tok, ["a gripping , funny film .", "dull and lifeless"], 32)
    log(f"cached-prefix [CLS]-only path vs Hugging Face forward: max |Δlogit| = {err:.2e}")
    results, extras = [], {"check": err}

    tasks = [data.sst2_task(data_root, 16, s, n_test) for s in seeds]
    if not quick:
        tasks.append(data.sst2_task(data_root, 512, 42, n_test))
    caches = {}
    test_cache = data.cache_prefix(model, tok, tasks[0].test[0], 32)
    for t in tasks:
        caches[t.name] = {"train": data.cache_prefix(model, tok, t.train[0], t.max_len), "test": test_cache}
    log(f"cached SST-2 prefixes ({time.time() - started:.0f}s)")

    # head setting: sweeps on SST-2 k=16 seed 42 and k=512; other k=16 seeds reuse seed 42's choice (MeZO's
    # protocol).
    chosen = None
    for t in sorted(tasks, key=lambda t: "seed=42" not in t.name):
        problem = head_problem(model, t, caches[t.name], batch)
        if chosen is None or "k=512" in t.name:
            summary = bench_problem(problem, GRIDS["head"], head_steps, max(1, head_steps // 50), log)
            if chosen is None:
                chosen = {r["optimizer"]: r["hp"] for r in summary["rows"]}
                seed42_problem = problem
        else:
            summary = rerun_with(problem, chosen, head_steps, max(1, head_steps // 50))
            log(f"  {problem.name:32s} reran with seed-42 choices")
        results.append(summary)

    if not quick:
        bbc = data.bbc_task(16, n_test, max_len=64)
        bmodel, _ = data.load_minilm(5)
        bcache = {"train": data.cache_prefix(bmodel, tok, bbc.train[0], 64),
                  "test": data.cache_prefix(bmodel, tok, bbc.test[0], 64)}
        log(f"cached BBC prefixes ({time.time() - started:.0f}s)")
        results.append(bench_problem(head_problem(bmodel, bbc, bcache, batch), GRIDS["head"], head_steps,
                                     max(1, head_steps // 50), log))

    # HELENE's switches on the seed-42 head problem, from the selected HELENE configuration.
    base_hp = chosen["HELENE"]
    ablations = []
    for label, change in ABLATIONS.items():
        if change == "no_hessian":
            change = {"lam": 1e4 * base_hp.get("lam", 1.0), "lr": 1e4 * base_hp["lr"]}
        r = runs.run(seed42_problem, "HELENE", {**base_hp, **change}, head_steps, max(1, head_steps // 50))
        ablations.append({"label": label, "hp": {**base_hp, **change}, "final_loss": r["final_loss"], "acc": r["acc"],
                              "curve": r["curve"], "skipped": r["skipped"]})
        log(f"  ablation {label:45s} loss {r['final_loss']:.4f} acc {r['acc']:.3f}")
    extras["ablations"] = ablations
    extras["mezo_head_target"] = results[0]["mezo_target"]

    # Estimator instrumentation against backprop references on the head (k=512 data when available).
    from benchmarks.helene.minilm.estimators import instrument

    est_task = tasks[-1]
    with torch.no_grad():
        feats = data.top_cls(model, *caches[est_task.name]["train"])
    bert = data.bert_of(model)
    head = torch.nn.Sequential(bert.bert.pooler.dense, torch.nn.Tanh(), bert.classifier)
    seed42_problem.reset()
    y = torch.tensor(est_task.train[1])
    draws = tuple(int(d) for d in args.draws.split(",")) if args.draws else (1, 100) if quick else (1, 100, 1000)
    extras["estimators_task"] = est_task.name
    extras["estimators_init"] = instrument(head, feats, y, batch, draws)
    opt = torch.optim.AdamW(head.parameters(), lr=chosen["AdamW"]["lr"])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        idx = torch.randint(0, len(y), (batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(feats[idx]), y[idx]).backward()
        opt.step()
    for p in head.parameters():
        p.grad = None
    extras["estimators_trained"] = instrument(head, feats, y, batch, draws)
    seed42_problem.reset()
    log(f"estimator instrumentation done ({time.time() - started:.0f}s)")

    # top and lora settings (seed 42; a fresh model each, so the head setting's model stays untouched).
    t42 = next(t for t in tasks if "k=16 seed=42" in t.name)
    for setting in ("top", "lora"):
        smodel, _ = data.load_minilm(2)
        problem = top_problem(smodel, t42, caches[t42.name], batch, setting)
        grids = GRIDS[setting] if not quick else {k: v[:1] for k, v in GRIDS[setting].items()}
        results.append(bench_problem(problem, grids, top_steps, max(1, top_steps // 15), log))

    extras["elapsed_s"] = time.time() - started
    extras["settings"] = {"quick": quick, "head_steps": head_steps, "top_steps": top_steps, "batch": batch,
                              "seeds": seeds, "n_test": n_test, "threads": args.threads,
                              "median_head_step_ms": statistics.median(r["step_ms"] for r in results[0]["rows"])}
    log(f"writing {page} ({time.time() - started:.0f}s)")
    write_json(results_file, {"results": results, "extras": extras, "grids": GRIDS, "log": lines,
                              "provenance": provenance(("helene", "benchmarks/helene"))})
    report(results_file, full_file, page)


def report(results: Path = RESULTS, full: Path = FULL_RESULTS, page: Path = PAGE) -> bool:
    """Renders the page from the result files: the main run's, then the full-finetuning section's. Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The main run's JSON.
        full: The ``--only full`` run's JSON (its section is kept as it is when absent).
        page: The Markdown page.

    """

    def render_page(record) -> None:
        write_report(page, record["results"], record["extras"], record["grids"], record["log"])
        full_record = read_json(full)
        if full_record is not None:
            merge_full_section(page, full_record["summary"], full_record["settings"], full_record["log"])

    return render_results(results, render_page)


def run_full(data_root: Path, results: Path, page: Path, args, started: float, log, lines: list[str]) -> None:
    """The ``full`` setting alone (SST-2 k=16 seed 42); keeps its result and merges its section into ``page``."""
    steps = args.full_steps or (20 if args.quick else 80)
    grids = GRIDS["full"] if not args.quick else {k: v[-1:] for k, v in GRIDS["full"].items()}
    task = data.sst2_task(data_root, 16, 42, args.n_test or (200 if args.quick else 400))
    model, tok = data.load_minilm(2)
    problem = full_problem(model, tok, task, 16)
    summary = bench_problem(problem, grids, steps, max(1, steps // 10), log, FULL_OPTIMIZERS)
    command = "python -m benchmarks.helene.minilm.bench --only full" + (" --quick" if args.quick else "") + (
        f" --full-steps {args.full_steps}" if args.full_steps else "")
    settings = {"command": command, "steps": steps, "batch": 16, "n_test": len(task.test[1]),
                "threads": args.threads, "elapsed_s": time.time() - started,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"merging the full section into {page} ({time.time() - started:.0f}s)")
    write_json(results, {"summary": summary, "settings": settings, "log": lines,
                         "provenance": provenance(("helene", "benchmarks/helene"))})
    merge_full_section(page, summary, settings, lines)


if __name__ == "__main__":
    main()
