"""Steering SmolLM2-135M-Instruct, measured the way EasyEdit2 measures it: generations on held-out prompts.

Run from the repo root (resumable: finished settings are cached, the doc is rewritten after each)::

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m benchmarks.steering.llm            # all settings
    .venv/bin/python -m benchmarks.steering.llm --report-only                            # doc from the cache
    .venv/bin/python -m benchmarks.steering.llm --budget-minutes 30                      # stop after 30 min

On a GPU without the classifier: N processes share one ``--out-dir``, generate and measure everything but the
concept score, then the score is added here from the stored generations::

    python -m benchmarks.steering.llm --device cuda --no-score --skip-overhead --shard I/N --out-dir OUT   # each I
    python -m benchmarks.steering.llm --device cuda --no-score --shard 0/N --out-dir OUT    # overhead, GPU alone
    .venv/bin/python -m benchmarks.steering.llm --rescore --out-dir OUT --classifier-dir runs/steering_llm/classifier

What runs, in this order (so that a partial run already compares every method):

1. the concept scorer: an OFTv2 sentiment classifier on all-MiniLM-L6-v2, trained on SST-2 by
   ``benchmarks/steering/llm_classifier.py`` (its dev accuracy is reported);
2. the unsteered model and EasyEdit2's *prompt* baseline (a steering instruction before each user message),
   both directions;
3. vector methods -- CAA and PCA-center on EasyEdit2-style SST-2 rows, vector-prompt on EasyEdit2
   ``{input, output, prompt}`` rows, a trained (preference / BiPO-like) vector on the same rows -- over layers x
   multipliers x both directions (more positive: ``+m``, more negative: ``-m``). Every vector is rescaled to the
   norm of the CAA vector of its layer, so a multiplier means the same length for every method and only the
   direction differs; ``positions="all"`` (EasyEdit2's default).

Per setting: greedy generations (``--new-tokens``, default 40) on the held-out openers in the chat template, scored
by :func:`steering.evaluate.evaluate_steering` (positive rate, perplexity under the unsteered model, fluency,
distinct-n, share of factual answers kept). Then the steered vs unsteered generation throughput (interleaved).
Results: ``runs/steering_llm/<concept>/results/*.json``; report: ``docs/benchmarks/steering_llm.md`` + plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.device import parse_shard, resolve_device
from benchmarks.common.pages import write_json
from benchmarks.common.paths import DOCS, SCRATCH, data_dir
from benchmarks.common.timing import interleaved
from benchmarks.steering import llm_data as data
from benchmarks.steering.llm_classifier import load_scorer, train_classifier
from benchmarks.steering.llm_report import write_report

MODEL = "smollm2-135m-instruct"
VECTOR_METHODS = ("caa", "pca_center", "vector_prompt", "trainable")


@dataclass(frozen=True)
class Setting:
    """One steered setting: a method, a layer (``None`` for the baselines) and a signed multiplier."""

    method: str
    layer: int | None = None
    multiplier: float = 0.0

    @property
    def direction(self) -> int:
        return 0 if self.multiplier == 0 else (1 if self.multiplier > 0 else -1)

    @property
    def key(self) -> str:
        if self.layer is None:
            return self.method if self.method == "unsteered" else f"{self.method}_{'pos' if self.direction > 0 else 'neg'}"
        return f"{self.method}_L{self.layer}_{self.multiplier:+g}"


def settings_in_order(layers: list[int], multipliers: list[float], extra_layer: int | None) -> list[Setting]:
    """Every setting, the most informative first: baselines, then each method at the main layer and middle
    multiplier both ways, then the other multipliers, then the second layer, then CAA at the extra layer."""
    out = [Setting("unsteered"), Setting("prompt", None, 1.0), Setting("prompt", None, -1.0)]
    mid, rest = multipliers[len(multipliers) // 2], [m for i, m in enumerate(multipliers) if i != len(multipliers) // 2]
    for layer in layers:
        for m in [mid, *sorted(rest, reverse=True)]:
            for method in VECTOR_METHODS:
                out += [Setting(method, layer, m), Setting(method, layer, -m)]
    if extra_layer is not None:
        for m in [mid, *rest]:
            out += [Setting("caa", extra_layer, m), Setting("caa", extra_layer, -m)]
    return out


def shard_of(plan: list[Setting], shards: int) -> dict[str, int]:
    """``{setting key: shard}``: the settings that share a vector (same method and layer) in one shard, the
    baselines (unsteered, prompt) in shard 0, the vector groups then spread greedily (each to the least-loaded
    shard, by setting count, in plan order). A function of the plan only, so every process agrees.

    Args:
        plan: The settings (:func:`settings_in_order`).
        shards: Number of shards (>= 1).
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    groups: dict[tuple, list[Setting]] = {}
    for s in plan:
        groups.setdefault(("baselines",) if s.layer is None else (s.method, s.layer), []).append(s)
    load = [0] * shards
    out = {}
    for name, members in groups.items():
        shard = 0 if name == ("baselines",) else min(range(shards), key=lambda i: (load[i], i))
        load[shard] += len(members)
        out.update({s.key: shard for s in members})
    return out


def concept_scorer(args):
    """``(texts -> P(concept), metadata)`` of ``args.concept``: the trained sentiment classifier (sst2, happy_sad;
    trained first when not cached) or, for weddings (a topic), the wedding-word scorer."""
    if args.concept == "weddings":
        return data.wedding_scorer, {"kind": "keywords", "words": list(data.WEDDING_WORDS)}
    classifier = Path(args.classifier_dir or Path(args.out_dir) / "classifier")
    train_classifier(Path(args.data_dir), classifier)
    return load_scorer(classifier)


def rescore(root: Path, scorer, meta: dict) -> int:
    """Re-scores the cached generations whose concept scores came from another classifier; returns how many.

    The concept score is a cheap function of the stored generations, so a better classifier (or one trained while
    the generations ran) updates every finished setting without generating again.

    Args:
        root: ``runs/steering_llm/<concept>``.
        scorer: ``texts -> P(positive)``.
        meta: The classifier's metadata (recorded in each result).
    """
    from steering.evaluate import concept_summary

    count = 0
    for path in sorted((root / "results").glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("classifier") == meta and result.get("scored", True):
            continue
        result["scores"] = [float(x) for x in scorer(result["generations"])]
        result.update(concept_summary(result["scores"]), classifier=meta, scored=True)
        _save_json(path, result)
        count += 1
    return count


def _save_json(path: Path, obj) -> None:
    write_json(path, obj)


class Bench:
    """The model, prompts, scorer and vector cache of one benchmark run."""

    def __init__(self, args):
        from peftplug.loading import load_model, load_tokenizer
        from steering import evaluate as ev

        self.args, self.data, self.ev = args, data, ev
        self.root = Path(args.out_dir) / args.concept
        self.device = torch.device(args.device)
        start = time.time()
        if args.no_score:  # generations and every other metric now; --rescore adds the concept scores later
            self.scorer, self.classifier_meta = None, None
        else:
            self.scorer, self.classifier_meta = concept_scorer(args)
            _save_json(self.root / "classifier.json", self.classifier_meta)
            rescored = rescore(self.root, self.scorer, self.classifier_meta)
            if rescored:
                print(f"re-scored {rescored} cached settings with this scorer", flush=True)
            if "dev_accuracy" in self.classifier_meta:
                print(f"classifier: dev accuracy {self.classifier_meta['dev_accuracy']:.3f} "
                      f"({time.time() - start:.0f} s)", flush=True)
        self.tokenizer = load_tokenizer(args.model)
        self.model = load_model(args.model).to(self.device).eval()
        self.peft_model = None
        self.prompts = ev.chat_prompts(self.tokenizer, data.OPENERS[: args.prompts])
        self.questions = ev.chat_prompts(self.tokenizer, [q for q, _ in data.FACTS])
        self.answers = [list(a) for _, a in data.FACTS]
        self.rows = data.concept_rows(Path(args.data_dir), args.concept, n=args.pairs)
        self.vp_rows = data.vector_prompt_rows(Path(args.data_dir), concept=args.concept, n=args.pairs // 2)
        baseline = self.root / "facts_baseline.json"
        if not baseline.is_file():
            base = ev.generate(self.model, self.tokenizer, self.questions, max_new_tokens=24, batch_size=args.batch)
            right = [ev.answer_is_right(t, a) for t, a in zip(base.texts, self.answers)]
            _save_json(baseline, {"correct": right, "answers": base.texts})
        self.fact_baseline = json.loads(baseline.read_text())["correct"]
        print(f"facts answered right unsteered: {sum(self.fact_baseline)}/{len(self.fact_baseline)}", flush=True)
        # Only the questions answered right unsteered can be "kept": the others are not asked again (half the cost).
        keep = [i for i, ok in enumerate(self.fact_baseline) if ok]
        self.facts = [self.data.FACTS[i] for i in keep]
        self.questions = [self.questions[i] for i in keep]
        self.answers = [self.answers[i] for i in keep]

    # ---------------------------------------------------------------------------------------------- vectors
    def vector(self, method: str, layer: int) -> torch.Tensor:
        """The (cached) vector of ``method`` at ``layer``, rescaled to the CAA vector's norm there."""
        import steering

        path = self.root / "vectors" / f"{method}_L{layer}.pt"
        if path.is_file():
            return torch.load(path, map_location="cpu", weights_only=True)["vector"]
        start = time.time()
        model = self.peft_model or self.model  # extraction disables any adapter: the unsteered model is read
        if method == "trainable":
            # Trained in an adapter of its own (kept, inactive between its settings).
            self.peft_model = steering.train_steering_vector(
                model, self.tokenizer, self.rows, method="trainable", layers=[layer], progress=False,
                adapter_name=f"trainable_L{layer}", use_chat_template=True, batch_size=8,
                steps=self.args.train_steps, lr=self.args.train_lr)
            raw = self.peft_model.base_model.get_vectors(f"trainable_L{layer}")[layer]
        elif method == "vector_prompt":
            rows = steering.vector_prompt_rows(self.tokenizer, self.vp_rows, use_chat_template=True)
            raw = steering.caa_vectors(model, self.tokenizer, rows, [layer], batch_size=16, progress=False)[layer]
        else:
            rows = steering.caa_rows(self.tokenizer, self.rows, use_chat_template=True)
            if method == "caa":
                raw = steering.caa_vectors(model, self.tokenizer, rows, [layer], batch_size=16, progress=False)[layer]
            else:
                raw = steering.pca_vectors(model, self.tokenizer, rows, [layer], mode="center", read="answer",
                                           batch_size=16, progress=False)[layer]
        raw = raw.detach().float().cpu()
        norm = raw.norm() if method == "caa" else self.vector("caa", layer).norm()
        vec = raw / raw.norm().clamp_min(1e-12) * norm
        info = {"vector": vec, "raw_norm": torch.tensor(float(raw.norm())),
                "seconds": torch.tensor(time.time() - start)}
        from peftplug.fileio import atomic_write

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(info, tmp))
        print(f"vector {method} L{layer}: raw norm {float(raw.norm()):.2f}, {time.time() - start:.0f} s", flush=True)
        return vec

    def steered_model(self, setting: Setting):
        """The PEFT model with only ``setting``'s adapter active, at its multiplier."""
        import steering

        name = f"{setting.method}_L{setting.layer}"
        vec = self.vector(setting.method, setting.layer)
        pm = self.peft_model
        if pm is None or name not in pm.base_model.peft_config:
            pm = steering.steering_adapter(self.model if pm is None else pm, {setting.layer: vec}, adapter_name=name,
                                           method=setting.method)
            self.peft_model = pm
        pm.base_model.set_vectors({setting.layer: vec}, name)
        pm.base_model.set_adapter(name)
        pm.base_model.set_multiplier(setting.multiplier, adapter_name=name)
        return pm

    # ---------------------------------------------------------------------------------------------- settings
    def run(self, setting: Setting) -> dict:
        ev, args = self.ev, self.args
        common = {"scorer": self.scorer, "max_new_tokens": args.new_tokens, "batch_size": args.batch}
        if self.questions:  # none when the unsteered model answers none right (a tiny test model)
            common.update(questions=self.questions, answers=self.answers,
                          question_baseline=[True] * len(self.questions))
        start = time.time()
        if setting.method in ("unsteered", "prompt"):
            model = self.peft_model or self.model
            with ev.unsteered(model):
                if setting.method == "unsteered":
                    result = ev.evaluate_steering(model, self.tokenizer, self.prompts, **common)
                else:
                    instruction = self.data.INSTRUCTIONS[args.concept][setting.direction]
                    openers = self.data.OPENERS[: args.prompts]
                    steered_questions = ev.chat_prompts(self.tokenizer, [q for q, _ in self.facts],
                                                        instruction=instruction) if self.facts else None
                    result = ev.evaluate_steering(
                        model, self.tokenizer, ev.chat_prompts(self.tokenizer, openers, instruction=instruction),
                        reference_prompts=self.prompts, steered_questions=steered_questions, **common)
                    result["instruction"] = instruction
        else:
            result = ev.evaluate_steering(self.steered_model(setting), self.tokenizer, self.prompts, **common)
        result.update(classifier=self.classifier_meta, scored=self.scorer is not None, device=str(self.device),
                      method=setting.method, layer=setting.layer,
                      multiplier=setting.multiplier,
                      direction=setting.direction, key=setting.key, seconds=round(time.time() - start, 1))
        return result

    def overhead(self, setting: Setting, rounds: int | None = None) -> dict:
        """Steered vs unsteered generation tokens/s, interleaved rounds, medians (one run)."""
        pm = self.steered_model(setting)
        prompts = self.prompts[: self.args.batch]

        def step(which):
            if which == "unsteered":
                with self.ev.unsteered(pm):
                    gen = self.ev.generate(pm, self.tokenizer, prompts, self.args.new_tokens, self.args.batch)
            else:
                gen = self.ev.generate(pm, self.tokenizer, prompts, self.args.new_tokens, self.args.batch)
            return gen.new_tokens / gen.seconds

        rounds = rounds or self.args.overhead_rounds
        times = interleaved(["unsteered", "steered"], step, rounds=rounds, steps_per_round=1,
                            warmup=1 if self.device.type == "cuda" else 0)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"setting": setting.key, "batch": len(prompts), "new_tokens": self.args.new_tokens,
                "device": str(self.device), "threads": torch.get_num_threads(),
                "tokens_per_second": med, "runs": times, "ratio": med["steered"] / med["unsteered"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=str(data_dir()))
    parser.add_argument("--out-dir", default=str(SCRATCH / "steering_llm"))
    parser.add_argument("--classifier-dir", default=None, help="default: OUT_DIR/classifier")
    parser.add_argument("--doc", default=str(DOCS / "steering_llm.md"))
    parser.add_argument("--concept", default="sst2", choices=["sst2", "happy_sad", "weddings"])
    parser.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)  # the tests pass a tiny model
    parser.add_argument("--device", type=resolve_device, default="cpu", help="cpu, cuda (cuda:N) or auto")
    parser.add_argument("--no-score", action="store_true",
                        help="no concept scorer: store generations and every other metric; --rescore scores later")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="run only shard I of N (settings sharing a vector together; baselines and the "
                             "overhead measurement in shard 0); N processes may share one --out-dir")
    parser.add_argument("--overhead-rounds", type=int, default=2)
    parser.add_argument("--skip-overhead", action="store_true",
                        help="no overhead measurement (e.g. while other shards share the GPU; rerun shard 0 after)")
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 15])
    parser.add_argument("--extra-layer", type=int, default=6, help="a third layer, CAA only (-1: none)")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--train-lr", type=float, default=0.05)
    parser.add_argument("--budget-minutes", type=float, default=None, help="start no new setting after this")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--rescore", action="store_true",
                        help="re-score the cached generations with the classifier in --classifier-dir, then report")
    args = parser.parse_args(argv)

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS") or 1))  # set but empty: 1
    if not Path(args.data_dir).is_dir():
        print(f"skipped: no shared data directory at {args.data_dir}", file=sys.stderr)
        return 0
    root = Path(args.out_dir) / args.concept
    extra = None if args.extra_layer < 0 else args.extra_layer
    plan = settings_in_order(args.layers, sorted(args.multipliers), extra)
    report = lambda: write_report(root, plan, Path(args.doc), vars(args))
    if args.rescore:
        scorer, meta = concept_scorer(args)  # the classifier is trained only when not cached
        _save_json(root / "classifier.json", meta)
        dev = f" (dev accuracy {meta['dev_accuracy']:.3f})" if "dev_accuracy" in meta else ""
        print(f"re-scored {rescore(root, scorer, meta)} settings{dev}")
    if args.report_only or args.rescore:
        report()
        return 0
    shard, shards = args.shard
    mine = shard_of(plan, shards)
    # Sharded or unscored processes write results only: the report comes from --rescore / --report-only after.
    if shards > 1 or args.no_score:
        report = lambda: None
    overhead_here = shard == 0 and not args.skip_overhead
    overhead_setting = Setting("caa", args.layers[0], sorted(args.multipliers)[len(args.multipliers) // 2])
    start = time.time()
    bench = Bench(args)
    for i, setting in enumerate(plan):
        path = root / "results" / f"{setting.key}.json"
        if path.is_file() or mine[setting.key] != shard:
            continue
        if args.budget_minutes is not None and time.time() - start > 60 * args.budget_minutes:
            print(f"budget reached: {len(plan) - i} settings not run", flush=True)
            break
        result = bench.run(setting)
        _save_json(path, result)
        rate = f"positive rate {result['positive_rate']:.3f}" if "positive_rate" in result else "unscored"
        print(f"[{i + 1}/{len(plan)}] {setting.key}: {rate}, ppl "
              f"{result['perplexity']:.2f}, kept {result.get('instruction_kept', float('nan')):.2f} "
              f"({result['seconds']:.0f} s)",
              flush=True)
        if overhead_here and shards == 1 and i == 2 * len(VECTOR_METHODS) + 2 and not (root / "overhead.json").is_file():
            _save_json(root / "overhead.json", bench.overhead(overhead_setting))
        report()
    if overhead_here and not (root / "overhead.json").is_file() and (
            args.budget_minutes is None or time.time() - start <= 60 * args.budget_minutes):
        _save_json(root / "overhead.json", bench.overhead(overhead_setting))
    report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
