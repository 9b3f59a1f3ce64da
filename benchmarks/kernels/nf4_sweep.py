"""GPU sweep of the NF4 forward/backward paths and of ``block_rotate`` against the issue-41 targets, in a time budget.

For each weight shape (out × in: 4096², 4096 × 11008, 11008 × 4096; NF4 + double quant, blocksize 64, bf16,
rotation block 32) and token count (1, 16, 64, 256, 1024, 4096) it times, forward and forward + backward:

- ``dense bf16``: ``F.linear`` on the unquantized weight (the floor);
- ``rotate + bnb``: the Triton ``block_rotate`` then bitsandbytes' ``Linear4bit`` (what ``auto`` runs today);
- ``dequantize + cuBLAS``: rotate once, our one-launch dequantize, one matmul (``unfused_forward``);
- ``fused``: the W4A16 kernel (``fused_forward``; backward ``grad_rotated_input`` + ``block_rotate_backward``),
  autotuned over ≤ 8 candidates (``DECODE_CANDIDATES`` up to 64 tokens, ``GEMM_CANDIDATES`` above) on the
  first shape and reused on the others;
- ``policy``: ``rotate_dequant_matmul`` as shipped (fused up to ``FUSED_MAX_TOKENS``, dequantize + cuBLAS above).

Times are CUDA-event medians of eager calls (what the issue's targets were measured as: Python's launch cost
included when the GPU waits for it). For our own kernel paths and dense bf16 (no autograd, no bitsandbytes inside a
capture, which could poison the stream), ``*_graph_ms`` also replays a captured CUDA graph: GPU time alone, what
``torch.compile`` with CUDA graphs would see. ``block_rotate`` at 4096 × 4096 is measured first. It prints every
target as met / not met and the token threshold for ``peftplug_kernels/dispatch_table.py``: the largest swept
count at which the fused kernel beats ``rotate + bnb`` on every shape, forward + backward.

    python -m benchmarks.kernels.nf4_sweep [--budget-s 150] [--out DIR]   # on a GPU
    python -m benchmarks.kernels.nf4_sweep --dry-run                       # tiny shapes on CPU (interpreter)

Stops measuring once ``--budget-s`` is spent (what is left is marked skipped) and writes ``<out>/nf4_sweep.json``
(after every measurement group too, marked ``"partial": true`` until the run ends, so a killed run keeps its rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common.pages import write_json
from benchmarks.common.paths import REPO
from benchmarks.common.provenance import run_provenance
from benchmarks.kernels.gpu import _timer

FULL = {"shapes": ((4096, 4096), (4096, 11008), (11008, 4096)), "tokens": (1, 16, 64, 256, 1024, 4096),
        "block": 32, "reps": 20, "candidates": 8, "rotate": (4096, 4096)}
DRY = {"shapes": ((48, 128),), "tokens": (1, 80), "block": 32, "reps": 1, "candidates": 2, "rotate": (64, 128)}


class Budget:
    """Seconds left of ``--budget-s``; ``spent()`` once a measurement group should be skipped."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() > self.deadline


def _graph_timer(device: str, measure):
    """``measure_graph(fn, reps)``: ms per replay of a captured CUDA graph of ``fn``; None on CPU or when capture
    fails (e.g. a call that synchronises)."""
    import torch

    def measure_graph(fn, reps: int) -> float | None:
        if device != "cuda":
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # compile, autotune and cache outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except Exception:  # noqa: BLE001  (report eager time only)
            torch.cuda.synchronize()
            return None
        return measure(graph.replay, reps)

    return measure_graph


# Paths whose calls are our kernels, cuBLAS and torch allocations only: safe to capture in a CUDA graph.
GRAPHABLE = ("dequantize + cuBLAS", "fused", "policy")


def _layer(n: int, k: int, device: str, dtype):
    import bitsandbytes as bnb
    import torch

    layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4", compress_statistics=True)
    dense = torch.randn(n, k) * 0.02
    layer.load_state_dict({"weight": dense})
    layer = layer.to(device)
    layer.support_avx512bf16_for_cpu = False  # the portable 4-bit layout on CPU (see oftv2/bnb.py)
    return layer, dense.to(device=device, dtype=dtype)


def _paths(layer, dense, rot, kernels, rotate, config):
    """``{name: (forward(x), forward_backward(x, g))}`` for one layer; backward = dX and dR."""
    import torch
    import torch.nn.functional as F

    from peftplug_kernels import ops

    w, state = layer.weight, layer.weight.quant_state

    def bwd_ours(x, g, fused):
        grad_rot = kernels.grad_rotated_input(g, w, state, fused=fused)
        return rotate.block_rotate_backward(x, grad_rot, rot)

    def policy_bwd(x, g):
        return bwd_ours(x, g, x.shape[0] <= kernels.FUSED_GRAD_MAX_TOKENS)

    def bnb_fb(x, g):
        xr = x.detach().requires_grad_(True)
        rr = rot.detach().requires_grad_(True)
        return torch.autograd.grad(layer(ops.block_rotate(xr, rr, impl="triton")), (xr, rr), g)

    def dense_fb(x, g):
        xr = x.detach().requires_grad_(True)
        return torch.autograd.grad(F.linear(xr, dense), (xr,), g)

    return {
        "dense bf16": (lambda x: F.linear(x, dense), dense_fb),
        "rotate + bnb": (lambda x: layer(ops.block_rotate(x, rot, impl="triton")), bnb_fb),
        "dequantize + cuBLAS": (lambda x: kernels.unfused_forward(x, rot, w, state, None),
                                lambda x, g: (kernels.unfused_forward(x, rot, w, state, None), bwd_ours(x, g, False))),
        "fused": (lambda x: kernels.fused_forward(x, rot, w, state, None, config=config),
                  lambda x, g: (kernels.fused_forward(x, rot, w, state, None, config=config), bwd_ours(x, g, True))),
        "policy": (lambda x: kernels.rotate_dequant_matmul(x, rot, w, state, None),
                   lambda x, g: (kernels.rotate_dequant_matmul(x, rot, w, state, None), policy_bwd(x, g))),
    }


def _autotune(layer, rot, kernels, tokens: int, cfg: dict, device: str, dtype, measure, budget: Budget):
    """Best forward candidate at ``tokens`` (≤ ``cfg['candidates']`` tried), its ms, and every candidate's ms."""
    import torch

    x = torch.randn(tokens, layer.in_features, device=device, dtype=dtype)
    pool = kernels.DECODE_CANDIDATES if tokens <= 64 else kernels.GEMM_CANDIDATES
    tried = {}
    with torch.no_grad():
        for cand in pool[: cfg["candidates"]]:
            if budget.spent():
                break
            try:
                tried[str(tuple(cand))] = measure(
                    lambda c=cand: kernels.fused_forward(x, rot, layer.weight, layer.weight.quant_state, None, config=c),
                    cfg["reps"])
            except Exception as err:  # noqa: BLE001  (a candidate that fails to launch is reported, not fatal)
                tried[str(tuple(cand))] = f"{type(err).__name__}: {err}"[:120]
    timed = {c: ms for c, ms in tried.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get) if timed else None
    config = next((c for c in pool if str(tuple(c)) == best), None)
    return config, tried


def sweep(cfg: dict, device: str, budget: Budget, save=None) -> dict:
    """Runs the sweep; returns ``{"rows": [...], "autotune": {...}, "rotate": {...}, "skipped": [...]}``.

    Args:
        cfg: ``FULL`` or ``DRY``.
        device: ``"cuda"`` or ``"cpu"``.
        budget: When to stop measuring.
        save: Called with the result so far after every measurement group, so that a run killed by its time limit
            keeps what it measured.
    """
    save = save or (lambda result: None)
    import torch

    from peftplug_kernels._triton_available import load_kernel_module

    kernels = load_kernel_module("nf4_rotate_matmul")
    rotate = load_kernel_module("block_rotate")
    dtype = torch.bfloat16
    measure = _timer(device)
    measure_graph = _graph_timer(device, measure)
    out = {"rows": [], "autotune": {}, "skipped": []}
    # block_rotate first: cheap, and its two targets should not fall to a spent budget.
    out["rotate"] = _rotate_rows(cfg, device, rotate, measure, measure_graph, budget)
    save(out)
    best = {}  # regime -> config tuned on the first shape
    for shape_index, (n, k) in enumerate(cfg["shapes"]):
        layer, dense = _layer(n, k, device, dtype)
        rot = torch.linalg.qr(torch.randn(k // cfg["block"], cfg["block"], cfg["block"], device=device))[0]
        rot = rot.contiguous()
        for tokens in cfg["tokens"]:
            if budget.spent():
                out["skipped"].append(f"{n}×{k}, {tokens} tokens")
                continue
            regime = "decode" if tokens <= 64 else "gemm"
            if shape_index == 0:
                config, tried = _autotune(layer, rot, kernels, tokens, cfg, device, dtype, measure, budget)
                out["autotune"][f"{tokens}"] = tried
                best.setdefault(regime, config)
                if config is not None and tokens in (16, 4096, cfg["tokens"][-1]):
                    best[regime] = config
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            g = torch.randn(tokens, n, device=device, dtype=dtype)
            paths = _paths(layer, dense, rot, kernels, rotate, best.get(regime))
            with torch.no_grad():
                ref = paths["rotate + bnb"][0](x).float()
            for name, (fwd, fwd_bwd) in paths.items():
                row = {"shape": f"{n}×{k}", "tokens": tokens, "impl": name}
                try:
                    with torch.no_grad():
                        # Dense bf16 is the unrotated, unquantized floor: its output is not comparable.
                        row["max_rel_err"] = (None if name == "dense bf16" else
                                              float((fwd(x).float() - ref).abs().max() / ref.abs().max()))
                        row["fwd_ms"] = measure(lambda f=fwd, x=x: f(x), cfg["reps"])
                        if name in GRAPHABLE or name == "dense bf16":
                            row["fwd_graph_ms"] = measure_graph(lambda f=fwd, x=x: f(x), cfg["reps"])
                    row["fwd_bwd_ms"] = measure(lambda f=fwd_bwd, x=x, g=g: f(x, g), cfg["reps"])
                    if name in GRAPHABLE:
                        row["fwd_bwd_graph_ms"] = measure_graph(lambda f=fwd_bwd, x=x, g=g: f(x, g), cfg["reps"])
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"[:160]
                out["rows"].append(row)
                print(_row_text(row), flush=True)
            save(out)
    return out


def _rotate_rows(cfg: dict, device: str, rotate, measure, measure_graph, budget: Budget) -> dict:
    """``block_rotate`` forward and forward + backward (our kernels, and torch's einsum) at ``cfg['rotate']``."""
    import torch

    from peftplug_kernels.block_rotate import reference

    if budget.spent():
        return {"skipped": True}
    tokens, width = cfg["rotate"]
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    rot = torch.linalg.qr(torch.randn(width // cfg["block"], cfg["block"], cfg["block"], device=device))[0]
    rot = rot.contiguous()
    rows = {}
    for name, fwd, fwd_bwd in (
        ("triton", lambda: rotate.block_matmul(x, rot), lambda: (rotate.block_matmul(x, rot),
                                                                 rotate.block_rotate_backward(x, g, rot))),
        ("torch einsum", lambda: reference.block_rotate(x, rot), None),
    ):
        rows[name] = {"fwd_ms": measure(fwd, cfg["reps"]), "fwd_graph_ms": measure_graph(fwd, cfg["reps"])}
        if fwd_bwd is not None:
            rows[name]["fwd_bwd_ms"] = measure(fwd_bwd, cfg["reps"])
            rows[name]["fwd_bwd_graph_ms"] = measure_graph(fwd_bwd, cfg["reps"])
    print(f"block_rotate {tokens}×{width}: {rows}", flush=True)
    return rows


def _row_text(row: dict) -> str:
    if "error" in row:
        return f"{row['shape']:>11} {row['tokens']:>5} tok  {row['impl']:<20} ERROR {row['error']}"
    def graph(key):
        return f" (graph {row[key]:.4f})" if row.get(key) is not None else ""

    return (f"{row['shape']:>11} {row['tokens']:>5} tok  {row['impl']:<20} fwd {row['fwd_ms']:.4f} ms"
            f"{graph('fwd_graph_ms')}  fwd+bwd {row['fwd_bwd_ms']:.4f} ms{graph('fwd_bwd_graph_ms')}  err "
            f"{'-' if row['max_rel_err'] is None else format(row['max_rel_err'], '.2e')}")


def verdicts(result: dict, cfg: dict) -> list[str]:
    """One line per target (met / not met, by how much) and the recommended dispatch threshold."""
    rows = [r for r in result["rows"] if "error" not in r]

    def ms(impl, tokens, shape_index, key="fwd_ms"):
        n, k = cfg["shapes"][shape_index]
        hit = [r.get(key) for r in rows if r["impl"] == impl and r["tokens"] == tokens and r["shape"] == f"{n}×{k}"]
        return hit[0] if hit else None

    lines = []

    def judge(what, got, limit, text):
        if got is None:
            lines.append(f"target {what} {text}: not measured")
        else:
            lines.append(f"target {what} {text}: {'met' if got <= limit else 'NOT met'} ({got:.4f} vs {limit:.4f})")

    if cfg is FULL:
        judge("fused forward, 16 tokens, 4096²", ms("fused", 16, 0), 0.05, "≤ 0.05 ms")
        judge("fused forward, 16 tokens, 4096², CUDA graph (GPU time)", ms("fused", 16, 0, "fwd_graph_ms"), 0.05,
              "≤ 0.05 ms")
        deq = ms("dequantize + cuBLAS", 16, 0)
        # Without its anchor the ratio target is not measured (a NaN limit would print "NOT met").
        judge("fused forward ≥ 4× faster than dequantize + cuBLAS, 16 tokens", ms("fused", 16, 0) if deq else None,
              deq / 4 if deq else float("nan"), "(ms vs a quarter of dequantize + cuBLAS)")
        judge("forward, 4096 tokens (policy)", ms("policy", 4096, 0), 0.30, "≤ 0.30 ms")
        judge("forward + backward, 4096 tokens (policy)", ms("policy", 4096, 0, "fwd_bwd_ms"), 1.0, "≤ 1.0 ms")
        rot = result.get("rotate", {}).get("triton", {})
        judge("block_rotate forward 4096×4096", rot.get("fwd_ms"), 0.03, "≤ 0.03 ms")
        judge("block_rotate forward + backward 4096×4096", rot.get("fwd_bwd_ms"), 0.15, "≤ 0.15 ms")
        judge("block_rotate forward 4096×4096, CUDA graph", rot.get("fwd_graph_ms"), 0.03, "≤ 0.03 ms")
        judge("block_rotate forward + backward 4096×4096, CUDA graph", rot.get("fwd_bwd_graph_ms"), 0.15, "≤ 0.15 ms")
    threshold = None
    for tokens in cfg["tokens"]:
        if not all(_beats(ms, impl, tokens, i, key) for i in range(len(cfg["shapes"]))
                   for impl in ("fused", "policy") for key in ("fwd_ms", "fwd_bwd_ms")):
            break
        threshold = tokens
    lines.append(f"recommended dispatch threshold (fused NF4 up to; the fused kernel and the shipped path it routes to "
                 f"(policy) beat rotate + bnb forward and forward + backward on every shape; takes effect with the "
                 f"device's nf4_rotate_matmul entry on triton): {'never' if threshold is None else threshold}")
    return lines


def _beats(ms, impl: str, tokens: int, shape_index: int, key: str) -> bool:
    """Whether ``impl`` was measured faster than ``rotate + bnb`` (what ``auto`` runs unfused) at one point.

    The threshold admits a token count only where both ``fused`` (the kernel, autotuned) and ``policy`` win:
    ``policy`` is what a layer under the threshold actually runs (``rotate_dequant_matmul``: default tiles, and
    dequantize + cuBLAS above ``FUSED_MAX_TOKENS``), and forward alone is what evaluation and generation run.
    """
    ours, theirs = ms(impl, tokens, shape_index, key), ms("rotate + bnb", tokens, shape_index, key)
    return ours is not None and theirs is not None and ours < theirs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop measuring after this many seconds")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/out"))
    parser.add_argument("--verdicts", type=Path, default=None, metavar="NF4_SWEEP_JSON",
                        help="print the targets and threshold of a saved sweep (a partial one too: a run cut by its "
                             "time limit writes none); exit")
    args = parser.parse_args(argv)
    if args.verdicts is not None:
        return print_verdicts(args.verdicts)
    if args.dry_run:
        # The interpreter only takes effect before the kernel modules are decorated. In a process that already
        # imported them compiled (the CUDA test session of run_all.sh), the CPU dry run would launch GPU kernels on
        # host tensors, and setting the variable there would reach every later test and subprocess: refuse instead.
        compiled = [name for name in ("block_rotate", "nf4_rotate_matmul")
                    if not getattr(sys.modules.get(f"peftplug_kernels.{name}.triton"), "INTERPRETED", True)]
        if compiled:
            raise SystemExit(f"--dry-run: peftplug_kernels.{compiled[0]}.triton was already imported compiled for the "
                             "GPU; run the dry run in a process of its own (it needs TRITON_INTERPRET=1 before that)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    cfg = DRY if args.dry_run else FULL
    torch.manual_seed(0)
    started = time.monotonic()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    path = args.out / "nf4_sweep.json"
    env = {"torch": torch.__version__, "triton": _version("triton"), "bitsandbytes": _version("bitsandbytes"),
           "dry_run": args.dry_run, **run_provenance(device)}

    def save_partial(result: dict) -> None:
        # Marked partial: the verdicts come only with the complete file (or from --verdicts).
        write_json(path, {**result, "partial": True, "device": name, "env": env,
                          "seconds": time.monotonic() - started}, indent=1)

    result = sweep(cfg, device, Budget(args.budget_s), save=save_partial)
    result["verdicts"] = verdicts(result, cfg)
    result["seconds"] = time.monotonic() - started
    result["device"] = name
    result["env"] = env
    for line in result["verdicts"]:
        print(line, flush=True)
    write_json(path, result, indent=1)
    print(f"wrote {path} in {result['seconds']:.0f} s", flush=True)
    return result


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def print_verdicts(path: Path) -> dict:
    """Prints the verdicts of a saved ``nf4_sweep.json`` (judged with ``FULL`` unless it is a dry run's).

    Args:
        path: The file.

    Raises:
        SystemExit: One line, when the file is missing or is no sweep.
    """
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"--verdicts: {path} is not a saved nf4_sweep.json ({err})") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise SystemExit(f"--verdicts: {path} is not a saved nf4_sweep.json (no rows)")
    dry = result.get("env", {}).get("dry_run", str(result.get("device", "")).startswith("cpu"))
    lines = verdicts(result, DRY if dry else FULL)
    if result.get("partial"):
        lines.insert(0, "partial sweep (cut by its time limit): what was not reached reads 'not measured'")
    for line in lines:
        print(line, flush=True)
    return {**result, "verdicts": lines}


if __name__ == "__main__":
    main(sys.argv[1:])
