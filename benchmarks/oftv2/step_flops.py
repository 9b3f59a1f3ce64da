"""The floating-point work of one SmolLM2-135M training step, op by op: OFTv2 against LoRA r16.

The overhead study's compiled SmolLM2 step ratio OFTv2 b32 / LoRA r16 sits around its ≤ 1.00 target, 0.98–1.06
across runs and machines (:mod:`benchmarks.oftv2.overhead_llm`), and :mod:`benchmarks.oftv2.step_ops` finds the
difference in the adapters' matrix products, not in overhead. This tool counts the products' work itself, which does
not depend on the machine: each adapter's model (``overhead_llm.adapted_model``: every linear layer adapted, batch ×
seq random tokens, step = forward + backward + AdamW; ``--adapters`` picks them, LoRA r16 always among them) runs one
eager step under ``torch.utils.flop_counter.FlopCounterMode``, which counts ``mm``, ``bmm``, ``baddbmm``, ``addmm``
and attention (its CPU kernel counted by the same formula as the GPU ones: the full score matrix, causal masking not
discounted). Elementwise work is not counted. The eager step is what is counted: under ``torch.compile`` OFTv2 forms
Q² once, one b × b product fewer per layer. On a CPU a step whose products take most of its time cannot run faster
than its FLOPs allow, so a FLOP ratio above 1.00 bounds what the compiled time ratio can reach unless OFTv2's products
run faster per FLOP than LoRA's.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.oftv2.step_flops --label NAME`` writes
``benchmarks/oftv2/results/overhead/step_flops_NAME.json``; the overhead page's notes quote it. ``--quick``: a tiny
random Llama (nothing written unless ``--out-dir``).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
from torch.utils import flop_counter

from benchmarks.common.timing import lm_train_step
from benchmarks.oftv2.overhead_llm import ADAPTERS, OTHER_ADAPTERS, adapted_model
from benchmarks.oftv2.overhead_report import write_study


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    # FlopCounterMode knows the GPU attention kernels only; the CPU one takes the same shapes.
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


#: Formulas for the ops FlopCounterMode does not know, passed as its ``custom_mapping``.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def count(adapter: str, batch: int, seq: int, quick: bool) -> dict:
    """FLOPs of one eager training step of ``adapter``'s model, by op.

    Args:
        adapter: One of ``overhead_llm.ADAPTERS`` or ``OTHER_ADAPTERS``.
        batch: Sequences per step.
        seq: Tokens per sequence.
        quick: The tiny random Llama instead of SmolLM2.

    Returns:
        ``{"total": flops, "by_op": {op name: flops}}``.
    """
    model = adapted_model(adapter, quick)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        lm_train_step(model, opt, ids)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    del model, opt
    gc.collect()
    return {"total": int(counter.get_total_flops()), "by_op": by_op}


def summary(adapters: dict[str, dict]) -> dict[str, dict[str, float]]:
    """The ratios the notes quote, for each OFTv2 adapter of :func:`count`'s records against ``"LoRA r16"``'s.

    ``batched share``: OFTv2's ``bmm`` + ``baddbmm`` (its block rotation and series; SmolLM2's attention runs as its
    own op) as a fraction of its step. ``mm difference``: LoRA's plain products minus OFTv2's, as a fraction of
    LoRA's step (LoRA's adapter products, less the input gradients of the first layer's frozen products, which
    OFTv2 needs for its rotations' gradients and LoRA does not).

    Args:
        adapters: Records by adapter name, ``"LoRA r16"`` among them.
    """
    lora = adapters["LoRA r16"]
    ratios = {}
    for name, oft in adapters.items():
        if not name.startswith("OFTv2"):
            continue
        batched = sum(oft["by_op"].get(op, 0) for op in ("aten.bmm", "aten.baddbmm"))
        mm_difference = lora["by_op"].get("aten.mm", 0) - oft["by_op"].get("aten.mm", 0)
        ratios[f"{name} / LoRA r16"] = {
            "total": oft["total"] / lora["total"],
            "batched share": batched / oft["total"],
            "batched / LoRA step": batched / lora["total"],
            "mm difference / LoRA step": mm_difference / lora["total"],
        }
    return ratios


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Args:
        argv: Arguments (default: ``sys.argv``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="run")
    parser.add_argument("--adapters", nargs="+", default=["OFTv2 b32", "LoRA r16"], choices=ADAPTERS + OTHER_ADAPTERS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None, help="results folder (default: the committed one)")
    args = parser.parse_args(argv)
    if "LoRA r16" not in args.adapters:
        parser.error("--adapters must include 'LoRA r16' (the anchor)")
    if args.quick:
        args.batch, args.seq = 1, 8
    return args


def main(argv=None) -> int:
    """Counts each adapter's step and writes the result file.

    Args:
        argv: Command-line arguments.
    """
    args = parse_args(argv)
    adapters = {adapter: count(adapter, args.batch, args.seq, args.quick) for adapter in args.adapters}
    ratios = summary(adapters)
    for adapter, rec in adapters.items():
        ops = {k: round(v / 1e9, 3) for k, v in sorted(rec["by_op"].items())}
        print(f"{adapter}: {rec['total'] / 1e9:.3f} GFLOP a step; by op (GFLOP): {ops}", flush=True)
    for pair, values in ratios.items():
        print(f"{pair}: " + "; ".join(f"{k} = {v:.4f}" for k, v in values.items()), flush=True)
    write_study("step_flops", args, ("adapters", "batch", "seq", "quick"),
                {"adapters": adapters, "summary": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
