"""The overhead study's whole-model part: SmolLM2-135M training-step ratio OFTv2 b32 / LoRA r16 on CPU, eager and
under ``torch.compile`` (Inductor), in one process.

The adapters on every linear layer of the real model (``smollm2-135m-instruct``, DESIGN.md §10: fp32, loaded
from the converted GGUF), batch 4 × 64 random tokens, step = forward + backward + AdamW. The six configurations
(OFTv2, OFTv2 with its rotations stacked by ``oftv2.stack_rotations``, LoRA; each eager and compiled, the compiled
module sharing its eager model's parameters) are timed interleaved round by round after their first steps (the
compiled ones compile there; that time is recorded), one torch thread, medians of process CPU time: on shared
cores only ratios measured this way mean anything (DESIGN.md §11). ``--quick`` runs the same code on a tiny
random Llama.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common.provenance import provenance
from benchmarks.common.timing import interleaved, lm_train_step
from benchmarks.oftv2.overhead_ops import dynamo_stats, reset_dynamo_stats

MODEL = "smollm2-135m-instruct"
ADAPTERS = ("OFTv2 b32", "OFTv2 b32 stacked", "LoRA r16")
#: What :func:`adapted_model` builds besides :data:`ADAPTERS` (the step tools compare block sizes; the timed study
#: keeps its three).
OTHER_ADAPTERS = ("OFTv2 b16", "OFTv2 b16 stacked")
CONFIGS = tuple(f"{adapter} {mode}" for mode in ("eager", "compiled") for adapter in ADAPTERS)


def adapted_model(adapter: str, quick: bool) -> torch.nn.Module:
    """SmolLM2 (or, with ``quick``, a tiny random Llama) with ``adapter`` on every linear layer, in training mode.

    Args:
        adapter: One of :data:`ADAPTERS` or :data:`OTHER_ADAPTERS`.
        quick: The tiny model instead of SmolLM2.

    Raises:
        ValueError: For an unknown adapter.
    """
    import peft

    if adapter in ADAPTERS + OTHER_ADAPTERS and adapter.startswith("OFTv2 b"):
        import oftv2

        block = int(adapter.split()[1][1:])
        config = oftv2.OFTv2Config(block_size=block, target_modules="all-linear")
    elif adapter == "LoRA r16":
        config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    else:
        raise ValueError(f"adapter must be one of {', '.join(ADAPTERS + OTHER_ADAPTERS)}, got {adapter!r}")
    if quick:
        from benchmarks.common.llama import llama

        base = llama(64, 1, 128)
    else:
        from peftplug.loading import load_model

        base = load_model(MODEL, "causal_lm", "none", "float32")
    model = peft.get_peft_model(base, config).train()
    if adapter.endswith("stacked"):
        oftv2.stack_rotations(model)
    return model


def run(args, code_paths: tuple[str, ...]) -> dict:
    """Measures the six configurations; returns the result record.

    Args:
        args: The overhead command line (``quick``, ``threads``, ``llm_batch``, ``llm_seq``, ``llm_rounds``,
            ``llm_steps``, ``label``, ``code``).
        code_paths: The code the result depends on (for ``provenance``).
    """
    torch.set_num_threads(args.threads)
    steps, compile_info = {}, {}
    vocab = None
    for adapter in ADAPTERS:
        model = adapted_model(adapter, args.quick)
        vocab = model.get_input_embeddings().num_embeddings
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        steps[f"{adapter} eager"] = (model, opt)
        steps[f"{adapter} compiled"] = (torch.compile(model, backend="eager" if args.quick else "inductor"), opt)
    ids = torch.randint(0, vocab, (args.llm_batch, args.llm_seq), generator=torch.Generator().manual_seed(0))

    def step(config: str) -> tuple[float, float]:
        model, opt = steps[config]
        start, start_cpu = time.perf_counter(), time.process_time()
        lm_train_step(model, opt, ids)
        return time.process_time() - start_cpu, time.perf_counter() - start

    for config in CONFIGS:
        if config.endswith("compiled"):
            reset_dynamo_stats()
            first = step(config)
            compile_info[config] = {"first_step_s": first[1], "dynamo": dynamo_stats()}
            print(f"{config}: first step {first[1]:.1f} s, {compile_info[config]['dynamo']}", flush=True)
    times = interleaved(CONFIGS, step, rounds=args.llm_rounds, steps_per_round=args.llm_steps, warmup=1)
    timed = {c: {"cpu_s": statistics.median(t[0] for t in v), "wall_s": statistics.median(t[1] for t in v),
                 "cpu_all_s": [t[0] for t in v], **compile_info.get(c, {})} for c, v in times.items()}
    settings = {"model": "tiny random Llama (quick)" if args.quick else MODEL, "batch": args.llm_batch,
                "seq": args.llm_seq, "rounds": args.llm_rounds, "steps": args.llm_steps, "threads": args.threads,
                "quick": args.quick}
    return {"label": args.label, "code": args.code or None, "settings": settings,
            "provenance": provenance(code_paths), "timed": timed}
