"""Steering-vector benchmark: concept shift vs perplexity on the real stories260K model, and generation overhead.

Run from the repo root::

    .venv/bin/python -m benchmarks.steering.stories260k            # full (~5-10 min on 2 shared cores)
    .venv/bin/python -m benchmarks.steering.stories260k --quick    # ~1-2 min
    .venv/bin/python -m benchmarks.steering.stories260k --report   # the page from the committed results

The raw results go to ``benchmarks/steering/results/stories260k.json`` (a JSON beside any other ``--out``) and the
page docs/benchmarks/steering.md (+ steering.png) is rendered from that file.

Concept: happy vs sad. Vectors are extracted (CAA, block output, answer tokens) from contrastive pairs:
``repe`` = the representation-engineering happiness/sadness scenario lists in ``<data-dir>/steering/repe``
(paired by index), ``stories`` = short TinyStories-style sentence pairs built here from templates (the model
was trained on children's stories only). Evaluation uses held-out story openings and a held-out story,
neither seen during extraction.

Metrics, for each layer x multiplier (all positions steered):

- ``logit shift``: mean over prompts ending in "felt"/"was very" of log P(happy words) - log P(sad words) for
  the next token, minus the same quantity unsteered (nats);
- ``happy - sad words``: per 50-token sampled continuation (fixed seeds, same for every setting), the count of
  happy-list words minus sad-list words;
- ``ppl ratio``: perplexity of a held-out story under steering / unsteered.

Throughput: greedy generation tokens/s of the unwrapped model vs the same model with a steering adapter
(2 blocks, ``positions="all"`` and ``"generated"``), interleaved repeats, medians; reported as a ratio measured
in one run (the cores are shared, absolute numbers are noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common.pages import (
    outputs,
    render_results,
    require_results,
    write_json,
    write_page,
)
from benchmarks.common.paths import DOCS, data_dir, results_dir
from benchmarks.common.provenance import provenance

PAGE = DOCS / "steering.md"
RESULTS = results_dir("steering") / "stories260k.json"
#: The settings a result file records (and the page reads back).
SETTINGS = ("quick", "read", "samples", "repeats", "throughput_only")
HAPPY = ("happy", "smiled", "smile", "smiles", "laughed", "laugh", "glad", "joy", "fun", "love", "loved", "excited",
         "proud", "good", "nice", "great")
SAD = ("sad", "cried", "cry", "cries", "crying", "upset", "angry", "scared", "tears", "hurt", "sorry", "lonely",
       "bad", "mad", "afraid", "frown")
NAMES = ("Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Tim", "Sara", "Jack", "Lucy", "Sam")
TEMPLATES = (
    ("{n} was very happy.", "{n} was very sad."),
    ("{n} smiled and laughed.", "{n} cried and cried."),
    ("{n} felt happy and glad.", "{n} felt sad and upset."),
    ("{n} had a happy day with mom.", "{n} had a sad day with mom."),
)
NEXT_WORD_PROMPTS = (
    "Once upon a time, there was a little girl named Amy. She felt",
    "Once upon a time, there was a boy named Leo. He was very",
    "The puppy found a big bone in the yard. He felt",
    "Mom gave Zoe a new red hat. Zoe was very",
    "The bird sat in the tall tree. It felt",
    "Kate and her friend went to the beach. They were very",
)
STORY_PROMPTS = (
    "Once upon a time, there was a little girl named Amy.",
    "One day, a boy named Leo went to the park.",
    "There was a big dog who lived in a small house.",
    "Zoe and her dad made a cake.",
)
HELD_OUT = (
    (
        "Once upon a time, there was a little cat named Fluffy. Fluffy liked to play with a ball of yarn. "
        "One day, Fluffy saw a bird in the garden. She wanted to catch it, but the bird flew away. "
        "Fluffy went back inside and took a long nap in the sun."
    ),
    (
        "Ben had a red truck. He took it to the park every day. At the park, he met a girl named Sue. "
        "Sue had a blue car. They played with the truck and the car in the sand. When it was time to go home, "
        "Ben and Sue said goodbye and promised to play again soon."
    ),
)


def story_pairs() -> list[tuple[str, str]]:
    """Template pairs in the model's own domain (children's stories)."""
    return [(p.format(n=n), q.format(n=n)) for n in NAMES for p, q in TEMPLATES]


def repe_pairs(data_dir: Path, limit: int) -> list[tuple[str, str]]:
    """Happiness/sadness scenarios of representation-engineering, paired by index."""
    base = data_dir / "steering" / "repe" / "emotions"
    happy = json.loads((base / "happiness.json").read_text())
    sad = json.loads((base / "sadness.json").read_text())
    return list(zip(happy, sad))[:limit]


def word_ids(tokenizer, words) -> list[int]:
    """First token of each word as it appears after a space."""
    ids = set()
    for w in words:
        toks = tokenizer(w)["input_ids"]
        ids.add(toks[1] if toks and toks[0] == tokenizer.bos_token_id else toks[0])
    return sorted(ids)


def logit_score(model, tokenizer, happy_ids, sad_ids) -> float:
    """Mean over prompts of log P(happy first tokens) - log P(sad first tokens) at the next position."""
    batch = tokenizer(list(NEXT_WORD_PROMPTS), return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits[:, -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return float((logp[:, happy_ids].logsumexp(-1) - logp[:, sad_ids].logsumexp(-1)).mean())


def word_counts(model, tokenizer, samples: int, new_tokens: int) -> tuple[float, float]:
    """Happy-minus-sad word count and happy words per continuation, sampled with fixed seeds."""
    batch = tokenizer(list(STORY_PROMPTS) * samples, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=True, top_k=0, temperature=1.0,
                             pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    happy = sad = 0
    for text in texts:
        words = re.findall(r"[a-z]+", text.lower())
        happy += sum(w in HAPPY for w in words)
        sad += sum(w in SAD for w in words)
    return (happy - sad) / len(texts), happy / len(texts)


def held_out_nll(model, tokenizer) -> float:
    """Mean token NLL of the held-out stories."""
    total, count = 0.0, 0
    for text in HELD_OUT:
        ids = tokenizer([text], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        total += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / count


def sweep(model, tokenizer, pairs, layers, multipliers, samples, new_tokens, label, read, method="caa", log=print,
          with_words=True):
    """Layer x multiplier sweep of one vector set; returns rows of metrics (multiplier 0 is the baseline)."""
    import steering

    happy_ids, sad_ids = word_ids(tokenizer, HAPPY), word_ids(tokenizer, SAD)
    base_logit = logit_score(model, tokenizer, happy_ids, sad_ids)
    base_nll = held_out_nll(model, tokenizer)
    base_words = word_counts(model, tokenizer, samples, new_tokens) if with_words else (float("nan"),) * 2
    rows = []
    for layer in layers:
        pm = steering.train_steering_vector(model, tokenizer, pairs, method=method, layers=[layer], read=read,
                                            prompt="She was very happy.", steps=40, lr=0.05, progress=False)
        steer = pm.base_model
        norm = float(steer.get_vectors()[layer].norm())
        for mult in multipliers:
            steer.set_multiplier(mult)
            if mult == 0:
                logit, nll, words = base_logit, base_nll, base_words
            else:
                logit = logit_score(pm, tokenizer, happy_ids, sad_ids)
                nll = held_out_nll(pm, tokenizer)
                words = word_counts(pm, tokenizer, samples, new_tokens) if with_words else (float("nan"),) * 2
            rows.append({"method": label, "layer": layer, "multiplier": mult, "vector_norm": norm,
                         "logit_shift": logit - base_logit, "happy_minus_sad": words[0], "happy": words[1],
                         "ppl_ratio": float(torch.tensor(nll - base_nll).exp())})
            log(f"  {label} layer {layer} x{mult:+g}: logit shift {logit - base_logit:+.3f}, "
                f"happy-sad {words[0]:+.2f}, ppl x{rows[-1]['ppl_ratio']:.3f}")
        model = pm.unload()  # back to the plain model for the next layer
    return rows


def throughput(model, tokenizer, prompts, new_tokens, repeats, layers) -> dict:
    """Generation tokens/s without vs with a steering adapter.

    Timed on one torch thread by the process's CPU time (``time.process_time``): on the shared, oversubscribed
    cores wall time mostly measures the neighbours, CPU time much less so. The variants run in turn, ``repeats``
    rounds (the order rotates each round); each variant's speed is its median round, and the overhead is the
    median of the per-round paired ratios (best-round ratio reported alongside).
    """
    import copy

    import peft

    import steering

    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
           "pad_token_id": tokenizer.pad_token_id}
    hidden = model.config.hidden_size
    wrapped = {}
    for name, positions in (("steer_all", "all"), ("steer_generated", "generated")):
        cfg = steering.SteeringConfig(layers=layers, positions=positions, multiplier=1.0, task_type="CAUSAL_LM")
        pm = peft.get_peft_model(copy.deepcopy(model), cfg)
        pm.base_model.set_vectors({layer: torch.randn(hidden) * 0.1 for layer in layers})
        wrapped[name] = pm

    def run(m, disabled=False):
        # disable_adapter() itself walks the model (PEFT's status check): entered outside the timed region, so
        # the "disabled" variant measures PeftModel.generate with the steering layers switched off.
        with torch.no_grad(), (m.disable_adapter() if disabled else contextlib.nullcontext()):
            start = time.process_time()
            m.generate(**batch, **gen)
            return len(prompts) * new_tokens / (time.process_time() - start)

    variants = {"base": lambda: run(model), "peft_disabled": lambda: run(wrapped["steer_all"], disabled=True),
                **{name: (lambda pm=pm: run(pm)) for name, pm in wrapped.items()}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for f in variants.values():
            f()  # warm-up
        speeds = {name: [] for name in variants}
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                speeds[name].append(variants[name]())
    finally:
        torch.set_num_threads(threads)
    out = {name: statistics.median(values) for name, values in speeds.items()}
    for name in ("peft_disabled", *wrapped):
        key = name.split("_", 1)[1]
        out["overhead_" + key] = statistics.median(b / s - 1 for b, s in zip(speeds["base"], speeds[name]))
        out["best_" + key] = max(speeds["base"]) / max(speeds[name]) - 1
    # Steering layers alone: the same PeftModel with vs without its adapter, paired per round.
    out["vs_disabled_all"] = statistics.median(d / s - 1 for d, s in zip(speeds["peft_disabled"], speeds["steer_all"]))
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["method"].startswith("caa/")]
    sets = sorted({r["method"] for r in rows})
    fig, axes = plt.subplots(len(sets), 3, figsize=(14, 3.6 * len(sets)), squeeze=False)
    for i, method in enumerate(sets):
        sub = [r for r in rows if r["method"] == method]
        for layer in sorted({r["layer"] for r in sub}):
            pts = sorted((r["multiplier"], r) for r in sub if r["layer"] == layer)
            xs = [p for p, _ in pts]
            for j, key in enumerate(("logit_shift", "happy_minus_sad", "ppl_ratio")):
                axes[i][j].plot(xs, [r[key] for _, r in pts], marker="o", label=f"layer {layer}")
        for j, title in enumerate(("log P(happy)-log P(sad) shift [nats]", "happy - sad words / continuation",
                                   "held-out perplexity ratio")):
            axes[i][j].set_title(f"{method}: {title}", fontsize=9)
            axes[i][j].set_xlabel("multiplier")
            axes[i][j].grid(alpha=0.3)
        axes[i][2].axhline(1.2, color="red", lw=0.8, ls="--")
        axes[i][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def best_setting(rows, max_ppl=1.2):
    """Per vector set: the (layer, multiplier) with the largest logit shift at <= 20% perplexity cost."""
    out = {}
    for method in sorted({r["method"] for r in rows}):
        ok = [r for r in rows if r["method"] == method and r["ppl_ratio"] <= max_ppl and r["multiplier"] > 0]
        if ok:
            out[method] = max(ok, key=lambda r: r["logit_shift"])
    return out


def monotone(rows, method, layer) -> bool:
    pts = sorted((r["multiplier"], r["logit_shift"]) for r in rows if r["method"] == method and r["layer"] == layer)
    return all(b[1] > a[1] for a, b in itertools.pairwise(pts))


def write_report(path: Path, rows, tput, args, elapsed) -> None:
    """Writes the page and its plot.

    Args:
        path: The page.
        rows: :func:`sweep` rows.
        tput: Throughput by model.
        args: The run's settings (:data:`SETTINGS`).
        elapsed: The run's wall seconds.
    """
    if rows:
        plot(rows, path.with_suffix(".png"))
    lines = ["# Steering vectors: concept shift, perplexity cost, generation overhead", "",
             (f"Generated by `python -m benchmarks.steering.stories260k{' --quick' if args.quick else ''}` "
             f"({elapsed:.0f} s on the shared 2-core CPU; numbers are from one run)."), ""]
    caa = [r for r in rows if r["method"].startswith("caa/")]
    others = [r for r in rows if not r["method"].startswith("caa/")]
    if rows:
        lines += ["## stories260K (real llama2.c model), concept happy vs sad", "",
                  ("One block output steered, all positions. Vector sets: `caa/stories` = CAA from 48 template "
                  "sentence pairs in the model's domain (\"Lily was very happy.\" / \"... sad.\"), read at "
                  f"`{args.read}`; `caa/repe` = CAA from the representation-engineering happiness/sadness "
                  "scenario lists (adult scenarios, paired by index), mean over tokens. `logit shift`: change of "
                  "log P(happy words) - log P(sad words) for the next token after 6 held-out prompts ending in "
                  "\"felt\"/\"was very\" (nats); `happy-sad`: happy minus sad words per sampled 50-token "
                  f"continuation ({4 * args.samples} = 4 held-out openings x {args.samples} samples, fixed "
                  "seeds); `ppl`: perplexity ratio on 2 held-out stories vs unsteered. Multipliers are in units of the extracted vector."), "",
                  "![sweep](steering.png)", ""]
        best = best_setting(caa)
        lines += ["### Best setting within a 20% perplexity budget", "",
                  "| pairs | layer | multiplier | |v| | logit shift | happy-sad | ppl ratio | logit shift monotone in m |",
                  "|---|---|---|---|---|---|---|---|"]
        for method, r in best.items():
            lines.append(f"| {method} | {r['layer']} | {r['multiplier']:g} | {r['vector_norm']:.2f} | "
                         f"{r['logit_shift']:+.3f} | {r['happy_minus_sad']:+.2f} | {r['ppl_ratio']:.3f} | "
                         f"{'yes' if monotone(caa, method, r['layer']) else 'no'} |")
        if others:
            lines += ["", "### Generators compared (story pairs, block 3)", "",
                      ("`pca_diff` is repeng's centred PCA of the differences: for uniform template pairs the "
                       "differences hardly vary except along their mean, so its axis is nearly orthogonal to the "
                       "concept and tiny after scaling; `pca_center` is dominated by the mean difference (close to "
                       "CAA). `vector_prompt` uses the steering prompt \"She was very happy.\" before the positive "
                       "texts; `trainable` is trained 40 steps with the preference (BiPO-style) objective."), "",
                      "| method | |v| | multiplier | logit shift | ppl ratio |", "|---|---|---|---|---|"]
            for r in others:
                if r["multiplier"] != 0:
                    lines.append(f"| {r['method']} | {r['vector_norm']:.2f} | {r['multiplier']:g} | "
                                 f"{r['logit_shift']:+.3f} | {r['ppl_ratio']:.3f} |")
        lines += ["", "### Full CAA sweep", "", ("| pairs | layer | multiplier | logit shift | happy-sad | "
                  "happy words | ppl ratio |"), "|---|---|---|---|---|---|---|"]
        for r in caa:
            lines.append(f"| {r['method']} | {r['layer']} | {r['multiplier']:+g} | {r['logit_shift']:+.3f} | "
                         f"{r['happy_minus_sad']:+.2f} | {r['happy']:.2f} | {r['ppl_ratio']:.3f} |")
    else:
        lines += [("Concept sweep skipped (--throughput-only)." if args.throughput_only else
                   "stories260K not found under the data directory: sweep skipped."), ""]
    lines += ["", "## Generation throughput with vs without steering", "",
              ("Greedy generation on one torch thread, tokens per CPU-second (process CPU time: on the shared, "
               "oversubscribed cores wall time mostly measures the neighbours), median of the interleaved rounds "
               f"({args.repeats} rounds, order rotated each round). overhead = base / variant - 1, median of the "
               "per-round paired ratios (target <= 3%); in brackets the ratio of the best rounds. Steering at 2 "
               "blocks. `PEFT, disabled`: the same PeftModel inside `disable_adapter()` (entered outside the "
               "timing), i.e. PeftModel.generate with the steering layers switched off; `steering vs disabled`: "
               "what the steering layers and position bookkeeping add on top of it."), "",
              ("| model | batch x new tokens | base tok/s | PEFT, disabled | overhead | steered (all) | overhead | "
               "steering vs disabled | steered (generated) | overhead |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in tput.items():
        lines.append(f"| {name} | {t['shape']} | {t['base']:.0f} | {t['peft_disabled']:.0f} | "
                     f"{t['overhead_disabled']:+.1%} ({t['best_disabled']:+.1%}) | {t['steer_all']:.0f} | "
                     f"{t['overhead_all']:+.1%} ({t['best_all']:+.1%}) | {t['vs_disabled_all']:+.1%} | "
                     f"{t['steer_generated']:.0f} | {t['overhead_generated']:+.1%} ({t['best_generated']:+.1%}) |")
    lines.append("")
    write_page(path, "\n".join(lines))


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the page from a result file. Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        write_report(page, record["rows"], record["tput"], SimpleNamespace(**record["settings"]), record["elapsed"])

    return render_results(results, render_page)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="default: peftplug.datadir.default_data_dir()")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--read", default="mean", choices=("mean", "last", "answer"),
                        help="where the story-pair CAA vectors are read (the sweep's vector set)")
    parser.add_argument("--samples", type=int, default=None, help="sampled continuations per story opening")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved throughput rounds")
    parser.add_argument("--throughput-only", action="store_true", help="skip the concept sweep (throughput table only)")
    parser.add_argument("--out", default=None, help="page to write (default: docs/benchmarks/steering.md)")
    parser.add_argument("--report", action="store_true", help="render the page from the result file; measure nothing")
    args = parser.parse_args(argv)
    out, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, out), results)
        return 0
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    start = time.time()
    import steering  # noqa: F401
    from peftplug.tiny import char_tokenizer, tiny_model

    data_root = Path(args.data_dir) if args.data_dir else data_dir()
    rows, tput = [], {}
    layers = [1, 2, 3] if args.quick else [1, 2, 3, 4]
    multipliers = [-2, 0, 1, 2, 4] if args.quick else [-2, -1, 0, 1, 2, 3, 4]
    samples, new_tokens, repeats = (2, 50, 7) if args.quick else (6, 50, 30)
    args.repeats = args.repeats or repeats
    repeats = args.repeats
    samples = args.samples = args.samples or samples
    have_model = (data_root / "stories260K" / "stories260K.bin").is_file()
    if have_model and args.throughput_only:
        from steering.stories260k import load_stories260k

        model, tok = load_stories260k(data_root)
        tput["stories260K (dim 64, 5 blocks)"] = dict(
            throughput(model, tok, list(STORY_PROMPTS) * 2, 32, repeats, [1, 2]), shape="8 x 32")
    elif have_model:
        from steering.stories260k import load_stories260k

        model, tok = load_stories260k(data_root)
        print(f"stories260K: story pairs (CAA, read {args.read})")
        rows += sweep(model, tok, story_pairs(), layers, multipliers, samples, new_tokens, "caa/stories", args.read)
        print("stories260K: repe happiness/sadness scenario pairs (CAA, mean over tokens)")
        rows += sweep(model, tok, repe_pairs(data_root, 48 if args.quick else 200), [2], [-4, 0, 4, 8],
                      samples, new_tokens, "caa/repe", "mean")
        print("stories260K: generators compared at block 3 (story pairs; no word sampling)")
        for method in (["pca_diff", "vector_prompt"] if args.quick else
                       ["pca_diff", "pca_center", "vector_prompt", "trainable"]):
            rows += sweep(model, tok, story_pairs(), [3], [0, 1, 2, 3], samples, new_tokens, method,
                          "last" if method != "trainable" else None, method=method, with_words=False)
        model, tok = load_stories260k(data_root)  # a fresh copy for timing
        tput["stories260K (dim 64, 5 blocks)"] = dict(
            throughput(model, tok, list(STORY_PROMPTS) * 2, 32, repeats, [1, 2]), shape="8 x 32")
        print("stories260K", {k: round(v, 3) for k, v in tput["stories260K (dim 64, 5 blocks)"].items()
                              if k != "shape"})
    else:
        print(f"stories260K not found under {data_root}: skipping the concept sweep")
    for label, overrides in (("random tiny Llama (dim 64, 2 blocks)", {}),
                             ("random small Llama (dim 256, 4 blocks)",
                              {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                               "num_attention_heads": 8, "num_key_value_heads": 4})):
        model, tok = tiny_model("llama", **overrides), char_tokenizer()
        tok.padding_side = "left"
        tput[label] = dict(throughput(model, tok, ["Once upon a time"] * 8, 32, repeats, [0, 1]), shape="8 x 32")
        print(label, {k: round(v, 3) for k, v in tput[label].items() if k != "shape"})
    write_json(results, {"settings": {k: getattr(args, k) for k in SETTINGS}, "rows": rows, "tput": tput,
                         "elapsed": time.time() - start, "provenance": provenance(("steering", "benchmarks/steering"))})
    report(results, out)
    print(f"wrote {out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
