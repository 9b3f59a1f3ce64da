"""PCT prompt transfer on a real LLM (SmolLM2-135M-Instruct, CPU), resumable: issue #16.

Every task is prompt-based classification (:mod:`peftplug.prompt_cls`: MeZO/LM-BFF templates, loss = cross-entropy
over the label words at the answer position). Stages, each cached under ``--work`` so that a killed run resumes
where it stopped and targets can be rerun alone:

1. sources: ``recipes/prompt_transfer/smollm2_sources.yaml`` through ``prompt_transfer.cli.train_sources``
   (Lightning), one source at a time (``<work>/sources/<name>/`` adapter + ``<name>.json`` with its test accuracy
   and the base model's zero-shot accuracy on the same rows); then the decompositions with and without the
   contrastive refinement (``<work>/decomposition``, ``<work>/decomposition_plain``);
2. targets (held out from the sources: refused by name otherwise), k=16 per class, per seed and method:
   ``PT`` (prompt tuning, vocabulary init), ``SPoT`` (PT's prompt as the task embedding, nearest source prompt by
   cosine of token means, then prompt tuning from it), ``PCT``, ``PCT w/o contrastive``, ``PCT w/o attention``;
   one JSON per finished run in ``<work>/targets/<target>/<seed>/``;
3. report: the SmolLM2 section of ``docs/benchmarks/prompt_transfer.md`` regenerated from whatever has finished,
   listing what has not (the MiniLM section above it is kept).

Sensitivity checks: ``--lr``, ``--attention-lr`` or ``--temperature`` at another value caches its target runs in a
sub-folder named after the values (``targets/rte/13/lr0.003/``, see :func:`variant_name`), never over the main runs;
the report lists them in a table next to the same method and target at the page's settings. Pass ``--out`` to keep
a check's own report off the docs page.

ATTEMPT's instance-level mixture is not run: its attention query comes from each input, but PEFT hands a prompt
encoder only the virtual-token indices, and an input-dependent prompt cannot be exported as one static
``PROMPT_TUNING`` prompt (see docs/prompt_transfer.md).

Run (background, niced, one thread): ``python -m benchmarks.prompt_transfer.llm [--stage sources|targets|report|all]
[--smoke]`` (``python -m benchmarks.prompt_transfer.minilm --model smollm2-135m-instruct ...`` is the same).

Device and sharding: ``--device cpu|cuda|cuda:N|auto`` is used by every model of both stages (the Lightning trainer
of the sources, the target loop and its evaluation); everything cached is written from CPU tensors, so the cache
loads anywhere. Several processes may share one cache: ``--stage sources --only-sources qnli`` trains just that
source (its adapter folder and ``<name>.json`` appear atomically) and does not decompose; a later ``--stage sources``
with every source cached only decomposes. ``--stage targets --targets rte --seeds 13`` runs one (target, seed) from
the cached sources and decompositions (a missing one: one-line error, exit status 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

from benchmarks.common.device import lightning_device, resolve_device, to_device
from benchmarks.common.pages import read_json, write_json
from benchmarks.common.paths import DOCS, REPO, SCRATCH, data_dir
from benchmarks.prompt_transfer.llm_cache import (
    METHODS,
    VARIANT_SETTINGS,
    slug,
    target_folder,
    variant_settings,
)
from benchmarks.prompt_transfer.llm_report import write_report

RECIPE = os.path.join(REPO, "recipes", "prompt_transfer", "smollm2_sources.yaml")
DOC = str(DOCS / "prompt_transfer.md")
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data-dir", default=str(data_dir()))
    p.add_argument("--work", default=str(SCRATCH / "pct_llm"), help="cache of every stage")
    p.add_argument("--out", default=DOC)
    p.add_argument("--stage", choices=("sources", "targets", "report", "all"), default="all")
    p.add_argument("--sources", default="mnli,qnli,qqp,sst2")
    p.add_argument("--targets", default="rte,mrpc,cola,boolq")
    p.add_argument("--seeds", default="13,42")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--source-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=40, help="target steps (k=16 per class, batch --batch-size)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128, help="prompt tokens; the first field is cut from its end")
    p.add_argument("--eval-size", type=int, default=300, help="test examples per task")
    lr, alr, tau = (VARIANT_SETTINGS[k][1] for k in ("lr", "attention_lr", "temperature"))
    p.add_argument("--lr", type=float, default=lr, help="prompt / residual learning rate (another value: a "
                   "sensitivity check, cached apart; see variant_name)")
    p.add_argument("--attention-lr", type=float, default=alr)
    p.add_argument("--temperature", type=float, default=tau, help="PCT attention temperature")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:N or auto (cuda if available): every model and batch of every stage")
    p.add_argument("--only-sources", default="",
                   help="--stage sources: train just these (comma-separated, from --sources) and skip the "
                        "decomposition, so that several processes can share --work")
    p.add_argument("--smoke", action="store_true",
                   help="2 sources (16-shot), 1 target, 1 seed, 2 steps, 8 test rows; writes <work>/report.md")
    args = p.parse_args(argv)
    if args.smoke:
        args.sources, args.targets, args.seeds = "sst2,qnli", "rte", "13"
        args.source_steps, args.steps, args.eval_size, args.max_length = 2, 2, 8, 64
        if args.work == p.get_default("work"):
            args.work = str(SCRATCH / "pct_llm_smoke")
        if args.out == DOC:
            args.out = os.path.join(args.work, "report.md")
    args.source_list = [s for s in args.sources.split(",") if s]
    args.target_list = [t for t in args.targets.split(",") if t]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    args.method_list = [m for m in args.methods.split(",") if m]
    args.only_source_list = [s for s in args.only_sources.split(",") if s]
    check_settings(args)
    args.device = resolve_device(args.device)
    return args


def check_settings(args) -> None:
    """Refuses a leaking or empty setup before any model loads (one line naming the field).

    Args:
        args: Parsed arguments.
    """
    from peftplug.prompt_cls import get_task
    from prompt_transfer.decompose import task_key

    if not args.source_list:
        raise ValueError("--sources is empty: PCT needs at least one source task")
    if not args.target_list:
        raise ValueError("--targets is empty")
    for name in args.source_list + args.target_list:
        get_task(name)  # unknown task: ConfigError naming data.task's choices
    leak = [t for t in args.target_list if task_key(t) in {task_key(s) for s in args.source_list}]
    if leak:
        raise ValueError(f"--targets: {leak[0]!r} is also a source task (--sources {args.sources}): targets must be "
                         "held out from the sources (leakage)")
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.temperature <= 0:
        raise ValueError(f"--temperature (attention temperature) must be > 0, got {args.temperature}")
    stray = [s for s in args.only_source_list if s not in args.source_list]
    if stray:
        raise ValueError(f"--only-sources: {stray} not in --sources ({args.sources})")
    if args.only_source_list and args.stage != "sources":
        raise ValueError("--only-sources needs --stage sources (targets need every source and the decomposition)")


class CacheMissing(Exception):
    """A stage needs something an earlier stage has not cached yet (reported in one line)."""


def _write_json(path: str, obj) -> None:
    write_json(path, obj, indent=2)


# --------------------------------------------------------------------------------------------------- sources
def sources_recipe(args, names: list[str]) -> dict:
    """The shipped sources recipe, narrowed to ``names`` and to this run's settings and cache."""
    import yaml

    with open(RECIPE) as f:
        recipe = yaml.safe_load(f)
    recipe["out_dir"] = os.path.join(args.work, "sources")
    recipe["zero_shot"] = True
    recipe["trainer"] = {**recipe["trainer"], "default_root_dir": os.path.join(args.work, "logs", "sources"),
                         "max_steps": args.source_steps, "enable_progress_bar": False,
                         "enable_model_summary": False, "logger": False, **lightning_device(args.device)}
    recipe["model"] = {**recipe["model"], "model": args.model}
    by_name = {s["name"]: s for s in recipe["sources"]}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"--sources: {missing} not in {RECIPE} (it has {list(by_name)})")
    chosen = []
    for name in names:
        source = copy.deepcopy(by_name[name])
        init = source["data"]["init_args"]
        init.update(data_dir=args.data_dir, max_test=args.eval_size, max_length=args.max_length,
                    batch_size=args.batch_size)
        if args.smoke:
            init.update(k=16)
        chosen.append(source)
    recipe["sources"] = chosen
    recipe.pop("decompose", None)  # decomposed here once every source is cached
    return recipe


def run_sources(args) -> dict | None:
    """Trains the sources that are not cached yet (one at a time, cached after each), then decomposes.

    With ``--only-sources`` only those are trained and nothing is decomposed (returns ``None``): other processes
    may be training the other sources into the same cache.
    """
    import prompt_transfer as pt
    from prompt_transfer.cli import train_sources

    work = os.path.join(args.work, "sources")
    for name in args.only_source_list or args.source_list:
        if read_json(os.path.join(work, f"{name}.json")) is not None:
            continue
        cpu0, t0 = time.process_time(), time.time()
        summary = train_sources(sources_recipe(args, [name]), decompose=False)
        result = {**summary["sources"][name], "cpu_s": time.process_time() - cpu0, "wall_s": time.time() - t0,
                  "steps": args.source_steps, "device": args.device}
        _write_json(os.path.join(work, f"{name}.json"), result)  # written last: it marks the source as done
        print(f"[pct-llm] source {name}: {json.dumps(result)}", flush=True)
    if args.only_source_list:
        return None
    adapters = {n: os.path.join(work, n) for n in args.source_list}
    base_model = pt.source_base_model(adapters)
    prompts = {n: pt.load_source_prompt(p) for n, p in adapters.items()}
    for sub, weight in (("decomposition", 0.1), ("decomposition_plain", 0.0)):
        dec = pt.decompose(prompts, explained_variance=0.95, contrastive_weight=weight, base_model=base_model)
        pt.save_decomposition(dec, os.path.join(args.work, sub))
    return prompts


def cached_sources(args) -> dict:
    """The source prompts (CPU) of every ``--sources`` entry, read from the cache, with both decompositions checked.

    Raises:
        CacheMissing: Naming the first source or decomposition not cached yet.
    """
    import prompt_transfer as pt

    work = os.path.join(args.work, "sources")
    missing = [n for n in args.source_list if read_json(os.path.join(work, f"{n}.json")) is None
               or not os.path.isfile(os.path.join(work, n, "adapter_model.safetensors"))]
    if missing:
        raise CacheMissing(f"source(s) {missing} not cached under {work}: run --stage sources first "
                           f"(e.g. --stage sources --only-sources {missing[0]})")
    for sub in ("decomposition", "decomposition_plain"):
        meta = read_json(os.path.join(args.work, sub, "decomposition.json"))
        if meta is None:
            raise CacheMissing(f"{os.path.join(args.work, sub)} not cached: run --stage sources once every source "
                               "is trained (it decomposes)")
        if sorted(meta["source_names"]) != sorted(args.source_list):
            raise CacheMissing(f"{os.path.join(args.work, sub)} decomposes {meta['source_names']}, not --sources "
                               f"{args.source_list}: rerun --stage sources")
    return {n: pt.load_source_prompt(os.path.join(work, n)) for n in args.source_list}


# --------------------------------------------------------------------------------------------------- targets
class Targets:
    """Holds the base model and tokenizer; trains and evaluates one method on one target and seed."""

    def __init__(self, args):
        from peftplug.loading import load_model, load_tokenizer

        self.args = args
        self.device = args.device
        self.tokenizer = load_tokenizer(args.model)
        self.base = load_model(args.model, "prompt_cls").eval().to(self.device)
        self.base_params = sum(p.numel() for p in self.base.parameters())
        self.length = read_json(os.path.join(args.work, "decomposition", "decomposition.json"))["num_virtual_tokens"]

    def data(self, target: str, seed: int):
        from peftplug.prompt_cls import PromptClassificationData

        a = self.args
        dm = PromptClassificationData(target, data_dir=a.data_dir, k=16, split_seed=seed, max_length=a.max_length,
                                      max_test=a.eval_size, batch_size=a.batch_size, eval_batch_size=16, seed=seed)
        dm.tokenizer = self.tokenizer
        dm.setup()
        return dm

    @torch.no_grad()
    def accuracy(self, model, dm) -> float:
        from peftplug.prompt_cls import prompt_cls_forward

        model.eval()
        hits = []
        for b in dm.test_dataloader():
            b = to_device(b, self.device)
            hits.append((prompt_cls_forward(model, b).logits.argmax(-1) == b["labels"]).float())
        return torch.cat(hits).mean().item()

    def fit(self, dm, seed: int, config, init_prompt=None) -> tuple[torch.nn.Module, dict]:
        import peft

        import prompt_transfer as pt
        from peftplug.prompt_cls import prompt_cls_forward

        a = self.args
        torch.manual_seed(seed)
        model = peft.get_peft_model(copy.deepcopy(self.base), config)
        if init_prompt is not None:
            pt.set_prompt(model, init_prompt)
        model.to(self.device)  # the prompt encoder (PCT: its decomposition buffers) joins the base model
        cpu0, t0 = time.process_time(), time.time()
        batches = [to_device(b, self.device) for b in dm.train_dataloader()]
        hist = pt.train_prompt(model, batches, steps=a.steps, lr=a.lr,
                               attention_lr=a.attention_lr, loss_fn=lambda m, b: prompt_cls_forward(m, b).loss)
        acc = self.accuracy(model, dm)
        return model, {"acc": acc, "attention": hist["attention"][-1], "loss_first": hist["loss"][0],
                       "loss_last": hist["loss"][-1], "cpu_s": time.process_time() - cpu0,
                       "wall_s": time.time() - t0, "device": self.device,
                       "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                       "base_params": self.base_params, "steps": a.steps}


def run_targets(args, prompts: dict) -> None:
    """Every (target, seed, method) not cached yet; each finished run is written at once."""
    from safetensors.torch import load_file, save_file

    import prompt_transfer as pt
    from peftplug.fileio import atomic_write

    bench = Targets(args)
    dec, plain = os.path.join(args.work, "decomposition"), os.path.join(args.work, "decomposition_plain")
    for target in args.target_list:
        for seed in args.seed_list:
            folders = {m: target_folder(args, target, seed, m) for m in args.method_list}
            todo = [m for m in args.method_list if read_json(os.path.join(folders[m], slug(m) + ".json")) is None]
            zero_path = os.path.join(args.work, "zero_shot", f"{target}-{seed}.json")
            if not todo and os.path.isfile(zero_path):
                continue
            dm = bench.data(target, seed)
            if not os.path.isfile(zero_path):
                _write_json(zero_path, {"acc": bench.accuracy(bench.base, dm), "n": len(dm.splits["test"])})
            # PT's prompt at PT's settings (SPoT uses the same ones: its task embedding is that prompt)
            prompt_file = os.path.join(target_folder(args, target, seed, "PT"), "pt_prompt.safetensors")
            for method in todo:
                extra = {}
                if method == "PT":
                    model, result = bench.fit(dm, seed, pt.prompt_tuning_config("CAUSAL_LM", bench.length, "vocab"))
                    weight = model.prompt_encoder["default"].embedding.weight.detach()[: bench.length]
                    weight = weight.to("cpu", torch.float32).contiguous()
                    os.makedirs(os.path.dirname(prompt_file), exist_ok=True)
                    # SPoT's task embedding, reusable after a restart (CPU tensor: loads on any machine)
                    atomic_write(prompt_file, lambda path, w=weight: save_file({"prompt": w}, path))
                elif method == "SPoT":
                    if not os.path.isfile(prompt_file):
                        print(f"[pct-llm] {target} seed {seed}: SPoT waits for PT (its task embedding)", flush=True)
                        continue
                    best, sims = pt.spot_select(load_file(prompt_file)["prompt"], prompts)
                    extra = {"spot_source": best, "spot_similarity": sims}
                    model, result = bench.fit(dm, seed, pt.prompt_tuning_config("CAUSAL_LM", bench.length),
                                              init_prompt=prompts[best])
                else:
                    kwargs = {"PCT": {"decomposition_path": dec},
                              "PCT w/o contrastive": {"decomposition_path": plain, "contrastive_weight": 0.0},
                              "PCT w/o attention": {"decomposition_path": dec, "fusion": "mean"}}[method]
                    config = pt.PCTConfig(task_type="CAUSAL_LM", target_task=target,
                                          attention_temperature=args.temperature, **kwargs)
                    model, result = bench.fit(dm, seed, config)
                result.update(extra, method=method, target=target, seed=seed, settings=variant_settings(args, method))
                _write_json(os.path.join(folders[method], slug(method) + ".json"), result)
                print(f"[pct-llm] {target} seed {seed} {method}: acc {result['acc']:.3f} "
                      f"cpu {result['cpu_s']:.0f}s {result['attention'] or ''}", flush=True)
                del model


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(os.path.join(args.data_dir, "k-shot")):
        print(f"[pct-llm] skipping: no k-shot data under {args.data_dir} (pass --data-dir)")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    try:
        if args.stage in ("sources", "all"):
            run_sources(args)  # cached sources are only read back
        if args.stage in ("targets", "all"):
            run_targets(args, cached_sources(args))
    except CacheMissing as err:
        print(f"[pct-llm] error: {err}", file=sys.stderr, flush=True)
        return 2
    write_report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
