"""OFTv2 evaluation and greedy decoding with unmerged adapters on SmolLM2-135M, on CPU: the inference rotation cache
(``oftv2/rotation_cache.py``) against the series on every forward, beside LoRA r16 and the bare base model.

Configurations, adapters on every linear layer of the real model (``smollm2-135m-instruct``, DESIGN.md §10), on two
bases (``--bases``): fp32 weights, and NF4 weights with bf16 compute (bitsandbytes; LoRA and OFTv2 there are QLoRA
and QOFT): ``base`` (no adapter), ``LoRA r16``, ``OFTv2 b32`` (eval mode without autograd: blocks computed once,
then only rotations) and ``OFTv2 b32, series per forward`` (the same model with ``rotation_cache.ENABLED = False``:
what every forward computed before the cache). Adapter weights are random and nonzero. Both OFTv2 rows must compute
the same rotations: the run stops if their logits differ beyond rounding, and records how many generated tokens
agree. Two tasks, both in eval mode under ``torch.no_grad``: a validation forward of batch × seq tokens, and
``generate`` (greedy, KV cache, batch 1) of ``--new`` tokens after a ``--prompt``-token prompt. Timed interleaved
round by round, one torch thread, medians of process CPU time (on shared cores only ratios measured this way mean
anything; DESIGN.md §11).

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.oftv2.decode`` writes ``benchmarks/oftv2/results/decode.json`` and
``docs/benchmarks/oftv2_decode.md``; ``--report`` renders the page from the committed result; ``--quick`` runs the
same code on a tiny random Llama (``--out PAGE``: a trial page with its result beside it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common.fmt import fmt
from benchmarks.common.pages import outputs, render_results, require_results, write_json, write_page
from benchmarks.common.paths import DOCS, results_dir
from benchmarks.common.provenance import provenance, provenance_line
from benchmarks.common.timing import interleaved

MODEL = "smollm2-135m-instruct"
PAGE = DOCS / "oftv2_decode.md"
RESULTS = results_dir("oftv2") / "decode.json"
CODE = ("benchmarks", "oftv2", "peftplug_kernels")
UNCACHED = "OFTv2 b32, series per forward"
CONFIGS = ("base", "LoRA r16", "OFTv2 b32", UNCACHED)
TASKS = ("eval forward", "generate")
#: The bases measured: name -> (``load_model`` quantization, dtype of the weights or of the 4-bit compute, heading).
BASES = {"fp32": ("none", "float32", "fp32 weights"),
         "nf4": ("nf4", "bfloat16", "NF4 weights (bitsandbytes, bf16 compute): QLoRA and QOFT")}
#: Largest cached-vs-uncached logit difference, relative to the largest logit, that a base's compute tolerates: fp32
#: rounding; bf16 rounding of the NF4 layers' inputs through 30 layers.
LOGIT_TOLERANCE = {"fp32": 1e-4, "nf4": 5e-2}
TITLE = "# OFTv2 evaluation and decoding, unmerged: the inference rotation cache"


def build(config: str, base_kind: str, quick: bool) -> torch.nn.Module:
    """The model of ``config`` on a base of ``base_kind``, in eval mode (the two OFTv2 rows share one model; see
    :func:`measure`).

    Args:
        config: One of :data:`CONFIGS` other than the uncached row.
        base_kind: A key of :data:`BASES`.
        quick: A tiny random Llama instead of SmolLM2.

    Raises:
        ValueError: For an unknown configuration or base.
    """
    import peft

    import oftv2

    if base_kind not in BASES:
        raise ValueError(f"base must be one of {', '.join(BASES)}, got {base_kind!r}")
    quantization, dtype, _ = BASES[base_kind]
    if quick:
        from benchmarks.common.llama import llama, quantize_linears_

        base = llama(64, 1, 128)
        if quantization == "nf4":
            quantize_linears_(base, getattr(torch, dtype))
    else:
        from peftplug.loading import load_model

        base = load_model(MODEL, "causal_lm", quantization, dtype)
    if config == "base":
        return base.eval()
    if config == "LoRA r16":
        model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    elif config == "OFTv2 b32":
        model = peft.get_peft_model(base, oftv2.OFTv2Config(block_size=32, target_modules="all-linear"))
    else:
        raise ValueError(f"config must be one of {', '.join(CONFIGS[:3])}, got {config!r}")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # nonzero adapters: an identity rotation or a zero LoRA B would not be what users run
        for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return model.eval()


def measure_base(base_kind: str, args) -> dict:
    """Times every configuration on one base and both tasks, interleaved.

    Args:
        base_kind: A key of :data:`BASES`.
        args: The command line (:func:`parse_args`).

    Returns:
        ``{"timed": {task: {config: {"cpu_s", "cpu_all_s"}}}, "cached_vs_uncached": {"max_logit_diff",
        "tokens_agreeing", "rounding_control"}}``: the largest logit difference of the eval forward relative to the
        largest logit, how many generated tokens agree before the first that differs, and the same logit difference
        for the LoRA model with its input embeddings scaled by 1 + 1e-7 (what rounding alone does on this base).

    Raises:
        RuntimeError: If the cached and uncached OFTv2 logits differ beyond :data:`LOGIT_TOLERANCE`.
    """
    from oftv2 import rotation_cache

    models = {config: build(config, base_kind, args.quick) for config in CONFIGS[:3]}
    models[UNCACHED] = models["OFTv2 b32"]
    vocab = models["base"].get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=generator)
    gen_kwargs = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False, "pad_token_id": 0}

    def run(config: str, task: str) -> torch.Tensor:
        rotation_cache.ENABLED = config != UNCACHED
        try:
            with torch.no_grad():
                if task == "generate":
                    return models[config].generate(input_ids=prompt, **gen_kwargs)
                return models[config](input_ids=batch).logits
        finally:
            rotation_cache.ENABLED = True

    # The cache computes the same rotation in another order of fp32 operations (relative differences ~1e-7, as
    # accurate as the series: both err alike against fp64). bf16 compute rounds those apart at the NF4 layers' input,
    # so greedy decoding may part after some tokens; what must hold is closeness of the logits.
    logits = {config: run(config, "eval forward").float() for config in ("OFTv2 b32", UNCACHED)}
    logit_diff = ((logits["OFTv2 b32"] - logits[UNCACHED]).abs().max() / logits[UNCACHED].abs().max()).item()
    if not logit_diff <= LOGIT_TOLERANCE[base_kind]:
        raise RuntimeError(f"{base_kind}: the cached and uncached OFTv2 logits differ by {logit_diff:.2e} of the "
                           f"largest logit (tolerance {LOGIT_TOLERANCE[base_kind]:.0e})")
    # For scale: what rounding alone does on this base (the LoRA model, its input embeddings scaled by 1 + 1e-7).
    with torch.no_grad():
        embeds = models["LoRA r16"].get_input_embeddings()(batch)
        plain = models["LoRA r16"](inputs_embeds=embeds).logits.float()
        nudged = models["LoRA r16"](inputs_embeds=embeds * (1 + 1e-7)).logits.float()
    control = ((plain - nudged).abs().max() / plain.abs().max()).item()
    tokens = {config: run(config, "generate")[0, prompt.shape[1]:] for config in ("OFTv2 b32", UNCACHED)}
    parted = (tokens["OFTv2 b32"] != tokens[UNCACHED]).nonzero()
    agree = int(parted[0, 0]) if len(parted) else len(tokens[UNCACHED])
    pairs = [f"{config} | {task}" for task in TASKS for config in CONFIGS]

    def step(pair: str) -> float:
        config, task = pair.split(" | ")
        start = time.process_time()
        run(config, task)
        return time.process_time() - start

    times = interleaved(pairs, step, rounds=args.rounds, steps_per_round=args.steps, warmup=1)
    timed = {task: {config: {"cpu_s": statistics.median(times[f"{config} | {task}"]),
                             "cpu_all_s": times[f"{config} | {task}"]} for config in CONFIGS} for task in TASKS}
    return {"timed": timed, "cached_vs_uncached": {"max_logit_diff": logit_diff, "tokens_agreeing": agree,
                                                    "rounding_control": control}}


def measure(args) -> dict:
    """Times every base of ``args.bases``; returns the result record.

    Args:
        args: The command line (:func:`parse_args`).
    """
    torch.set_num_threads(args.threads)
    bases = {base_kind: measure_base(base_kind, args) for base_kind in args.bases}
    settings = {k: getattr(args, k) for k in ("batch", "seq", "prompt", "new", "rounds", "steps", "threads", "quick")}
    settings["model"] = "tiny random Llama (quick)" if args.quick else MODEL
    return {"settings": settings, "provenance": provenance(CODE), "bases": bases}


def render(record: dict) -> str:
    """The page of one result record.

    Args:
        record: What :func:`measure` returned.
    """
    s = record["settings"]
    lines = [TITLE, "",
             ("Generated by `python -m benchmarks.oftv2.decode` from `benchmarks/oftv2/results/decode.json` (module "
              "docstring: method). In eval mode without autograd an OFTv2 layer computes its rotation blocks once "
              "and then only rotates (`oftv2/rotation_cache.py`); the row `OFTv2 b32, series per forward` is the "
              "same model with the cache off, i.e. the Cayley–Neumann series on every forward, as before the cache. "
              "Adapters on every linear layer; medians of process CPU time, interleaved within each base."), "",
             (f"Model: {s['model']}. Eval forward: batch {s['batch']} × {s['seq']} tokens. Generate: greedy, batch 1, "
              f"{s['new']} new tokens after a {s['prompt']}-token prompt. {s['rounds']} rounds × {s['steps']} "
              f"samples per configuration and task.")]
    for base_kind, result in record["bases"].items():
        timed, same = result["timed"], result["cached_vs_uncached"]
        lines += ["", f"## {BASES[base_kind][2]}", "",
                  (f"Cached against uncached OFTv2: the eval forward's logits differ by at most "
                   f"{same['max_logit_diff']:.1e} of the largest logit (the run stops above "
                   f"{LOGIT_TOLERANCE[base_kind]:.0e}); greedy decoding agrees on the first "
                   f"{same['tokens_agreeing']} of {s['new']} tokens. For scale, rounding alone: the LoRA model's "
                   f"logits move by {same['rounding_control']:.1e} of the largest when its input embeddings are "
                   f"scaled by 1 + 1e-7."), "",
                  "| task | configuration | CPU ms | / base | / LoRA r16 | / OFTv2 b32, cached |",
                  "|---|---|---|---|---|---|"]
        for task in TASKS:
            row = timed[task]
            for config in CONFIGS:
                t = row[config]["cpu_s"]
                ratios = [fmt(t / row[ref]["cpu_s"], ".3f") for ref in ("base", "LoRA r16", "OFTv2 b32")]
                per = f" ({fmt(1e3 * t / s['new'], '.1f')} per token)" if task == "generate" else ""
                lines.append(f"| {task} | {config} | {fmt(1e3 * t, '.1f')}{per} | {' | '.join(ratios)} |")
    lines += ["", provenance_line(record["provenance"]), ""]
    return "\n".join(lines)


def report(results=RESULTS, page=PAGE) -> bool:
    """Renders the page from a result file; ``False`` (page untouched) when there is none.

    Args:
        results: The result file.
        page: The page to write.
    """
    return render_results(results, lambda record: write_page(page, render(record)))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama and one round: a smoke run")
    parser.add_argument("--report", action="store_true", help="render the page from the result; measure nothing")
    parser.add_argument("--out", default=None, help="a trial page (its result written beside it)")
    parser.add_argument("--bases", nargs="+", choices=tuple(BASES), default=list(BASES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32, help="tokens generated per generate call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed samples per configuration, task and round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.prompt, args.new, args.rounds, args.steps = 1, 8, 4, 3, 1, 1
    return args


def main(argv=None) -> int:
    """Measures and writes the result and page (``--report``: renders only).

    Args:
        argv: Command-line arguments.
    """
    args = parse_args(argv)
    page, results = outputs(args.out, PAGE, RESULTS)
    if args.report:
        require_results(report(results, page), results)
        return 0
    record = measure(args)
    print(render(record))
    if args.quick and args.out is None:
        return 0  # a smoke run never overwrites the committed result
    write_json(results, record)
    report(results, page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
