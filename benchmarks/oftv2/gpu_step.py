"""GPU training-step benchmark of the OFTv2 family against LoRA: the table of the first H200 run
(``../shared/gpu/2026-12-04-h200/README.md``) measured again in one bounded command, with issue 40's targets.

Llama shapes with random weights: TinyLlama's 1.1B (2048 / 5632, 22 layers, 32 heads, 4 KV heads) and 7B-class widths
(4096 / 11008, 32 heads, 6 layers); batch 4 × 1024 tokens; bf16, and an NF4 + double-quant base (bitsandbytes
``Linear4bit`` in place of every decoder linear layer); adapters on all seven linear kinds: OFTv2 b32 (QOFT on NF4;
its defaults, ``kernel_impl="auto"``), PEFT's LoRA r16 (QLoRA on NF4; PEFT's defaults, so its adapter weights are
upcast to fp32 as users get them) and PEFT's OFT b32 Cayley–Neumann; eager and ``torch.compile(model)``. Each row:
median step (forward + backward + AdamW, CUDA synchronised) after warm-up steps, peak memory allocated during the
timed steps, and one more step under ``torch.profiler``: GPU busy = the kernels' summed device time, its share of
the median step, and the kernel launches.

The rows run in :data:`PLAN`'s order — the ones the targets need first — and a row is skipped (and says so) when
the ``--budget-s`` left cannot fit it, so the run ends in time on a machine lent by the minute; the result file is
rewritten after every row, so a run cut short keeps what it measured. ``--dry-run`` runs the same code paths on CPU
at tiny sizes (fp32, dynamo's ``eager`` backend): CI runs it. Needs torch, transformers, peft and (for NF4)
bitsandbytes; not jsonargparse or datasets.

Run: ``python -m benchmarks.oftv2.gpu_step --out DIR`` (``bash benchmarks/gpu/run_all.sh`` does) writes
``DIR/gpu_step.json`` and ``DIR/gpu_step.md`` and prints each target met / not met; afterwards, locally,
``python -m benchmarks.oftv2.gpu_step --merge-docs DIR/gpu_step.json`` commits the run under ``benchmarks/oftv2/results/gpu_step/``
and renders the ``oftv2-gpu`` section of docs/benchmarks/oftv2.md from every committed run
(:mod:`benchmarks.oftv2.gpu_step_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.llama import TARGETS, llama_of_shape, quantize_linears_
from benchmarks.common.pages import write_json, write_page
from benchmarks.common.provenance import device_environment, git_commit
from benchmarks.common.timing import lm_train_step

SHAPES = {
    "1.1B": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "7B-class widths": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 6,
                        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
}
#: The dry run's stand-ins, under the same names (so every code path, the targets included, runs as on the GPU).
DRY_SHAPES = {
    "1.1B": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 128},
    "7B-class widths": {"hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 1,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128},
}
#: ``OFTv2 b32, kernel_impl=torch``: the torch path (one autograd Function a layer, ``peftplug_kernels.cayley_rotate``)
#: against the Triton kernels ``auto`` runs on sm_90: which one the dispatch table should choose.
TORCH_PATH = "OFTv2 b32, kernel_impl=torch"
#: ``OFTv2 b32, stacked rotations``: ``oftv2.stack_rotations`` on the model, one batched series per forward and only
#: the rotation per layer (2 kernels forward, 3 backward): whether it pays on a launch-bound GPU step.
STACKED = "OFTv2 b32, stacked rotations"
ADAPTERS = ("OFTv2 b32", "LoRA r16", "PEFT OFT b32", TORCH_PATH, STACKED)
#: What a method is called on an NF4 base.
NF4_NAMES = {"OFTv2 b32": "QOFT b32", "LoRA r16": "QLoRA r16", "PEFT OFT b32": "PEFT OFT b32",
             TORCH_PATH: "QOFT b32, kernel_impl=torch", STACKED: "QOFT b32, stacked rotations"}


@dataclass(frozen=True)
class Row:
    """One configuration of the table.

    Args:
        shape: A key of :data:`SHAPES`.
        quant: ``bf16`` or ``nf4``.
        adapter: One of :data:`ADAPTERS`.
        mode: ``eager`` or ``compiled``.
    """

    shape: str
    quant: str
    adapter: str
    mode: str

    @property
    def method(self) -> str:
        """The method's name on this base (QOFT, QLoRA on NF4)."""
        return NF4_NAMES[self.adapter] if self.quant == "nf4" else self.adapter


#: Every row, in the order they run: what issue 40's targets need first — the cheap eager rows (OFTv2 vs LoRA and
#: QOFT vs QLoRA at 1.1B: step and memory; OFTv2 on the torch path, for the dispatch table), then compiled OFTv2 (a
#: compile of a minute or more), then stacked rotations on bf16 (whether ``stack_rotations`` pays) — then the
#: 7B-class widths and stacked rotations on NF4; last the rows our code does not change (compiled LoRA, 83.2 ms on the
#: last run, the targets' fallback; PEFT's OFT) and compiled stacked rotations, which go first when time runs short.
PLAN = (
    Row("1.1B", "bf16", "LoRA r16", "eager"), Row("1.1B", "bf16", "OFTv2 b32", "eager"),
    Row("1.1B", "nf4", "LoRA r16", "eager"), Row("1.1B", "nf4", "OFTv2 b32", "eager"),
    Row("1.1B", "bf16", TORCH_PATH, "eager"),
    Row("1.1B", "bf16", "OFTv2 b32", "compiled"),
    Row("1.1B", "bf16", STACKED, "eager"),
    Row("7B-class widths", "bf16", "LoRA r16", "eager"), Row("7B-class widths", "bf16", "OFTv2 b32", "eager"),
    Row("7B-class widths", "nf4", "LoRA r16", "eager"), Row("7B-class widths", "nf4", "OFTv2 b32", "eager"),
    Row("1.1B", "nf4", STACKED, "eager"),
    Row("1.1B", "bf16", "LoRA r16", "compiled"),
    Row("1.1B", "bf16", "PEFT OFT b32", "eager"), Row("1.1B", "nf4", "PEFT OFT b32", "eager"),
    Row("7B-class widths", "bf16", "PEFT OFT b32", "eager"), Row("7B-class widths", "nf4", "PEFT OFT b32", "eager"),
    Row("1.1B", "bf16", STACKED, "compiled"),
)

COMPILED_OFTV2 = Row("1.1B", "bf16", "OFTv2 b32", "compiled")
COMPILED_LORA = Row("1.1B", "bf16", "LoRA r16", "compiled")


def plan_for(env: dict) -> tuple[Row, ...]:
    """:data:`PLAN` on the machine of the 2026-12-04 run; elsewhere compiled LoRA runs right after compiled OFTv2.

    The compiled targets compare against compiled LoRA, which :data:`PLAN` measures late because the first H200 run's
    83.2 ms stands in for it there. On another GPU or torch version nothing stands in: without its own row the
    target would go unmeasured, so it moves ahead of the rows no target needs.

    Args:
        env: What :func:`environment` says about the machine.
    """
    from benchmarks.oftv2.gpu_step_report import anchor_applies

    if anchor_applies(env):
        return PLAN
    rows = [row for row in PLAN if row != COMPILED_LORA]
    at = rows.index(COMPILED_OFTV2) + 1
    return tuple(rows[:at] + [COMPILED_LORA] + rows[at:])


#: Seconds a row is expected to take before one like it has run (a 1.1B compile took 37–86 s on the H200).
FIRST_GUESS_S = {"eager": 20.0, "compiled": 110.0}
#: Seconds a row may run past the budget's end before it is cut. ``run_all.sh`` kills this benchmark 30 s after
#: ``--budget-s``, and ~10 s of imports come before the budget's clock starts: a row still running then (a compile
#: far slower than its guess) is cut here instead, so the run still ends by itself, says which row ran out and after
#: how long, and writes its page.
OVERRUN_S = 15.0


class RowCut(BaseException):
    """Raised (by SIGALRM) in a row that outlasts the budget. A ``BaseException``, as ``KeyboardInterrupt`` is, so
    that no ``except Exception`` inside torch's compile stack swallows it."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises :class:`RowCut` in the main thread once ``seconds`` have passed (no limit when infinite).

    Args:
        seconds: Wall-clock seconds the block may take.
    """
    if not math.isfinite(seconds):
        yield
        return

    def cut(signum, frame):
        raise RowCut(f"cut after {seconds:.0f} s: the time budget ran out during this row")

    previous = signal.signal(signal.SIGALRM, cut)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def peft_config(adapter: str):
    """The PEFT config of an adapter on every linear layer of the decoder blocks.

    Args:
        adapter: One of :data:`ADAPTERS`.

    Raises:
        ValueError: For another name.
    """
    import peft

    if adapter in ("OFTv2 b32", TORCH_PATH, STACKED):
        import oftv2

        impl = "torch" if adapter == TORCH_PATH else "auto"
        return oftv2.OFTv2Config(block_size=32, target_modules=TARGETS, kernel_impl=impl)
    if adapter == "LoRA r16":
        return peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    if adapter == "PEFT OFT b32":
        return peft.OFTConfig(oft_block_size=32, r=0, target_modules=TARGETS, use_cayley_neumann=True)
    raise ValueError(f"adapter must be one of {', '.join(ADAPTERS)}, got {adapter!r}")


def gpu_profile(step, device: str) -> dict:
    """One ``step`` under ``torch.profiler``: the kernels' summed device time (what ``key_averages().table()`` calls
    "Self CUDA time total") and the launch calls. On a CPU both are ``None``.

    Args:
        step: One training step.
        device: ``cuda`` or ``cpu``.
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        with profile(activities=[ProfilerActivity.CPU]):
            step()
        return {"gpu_busy_ms": None, "launches": None}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    busy = launches = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            busy += event.self_device_time_total
        elif event.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                            "cudaGraphLaunch"):
            launches += 1
    return {"gpu_busy_ms": busy / 1e3, "launches": launches}


def dynamo_counts() -> dict:
    """Graphs dynamo compiled and graph breaks since its counters were last cleared."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def measure_row(row: Row, settings: dict, device: str) -> dict:
    """Builds the model of one row and times its training step.

    Args:
        row: The configuration.
        settings: ``shapes``, ``batch``, ``seq``, ``warmup``, ``steps``, ``dtype``, ``backend``, ``profile``.
        device: ``cuda`` or ``cpu``.

    Returns:
        The row's measurements (``step_ms``, ``min_ms``, ``peak_gib``, ``gpu_busy_ms``, ``gpu_busy_fraction``,
        ``launches``, ``first_step_s``, ``loss``, ``trainable``, ``allocated_before_gib``; compiled rows also
        ``dynamo``).
    """
    import peft
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    dtype = getattr(torch, settings["dtype"])
    shape = settings["shapes"][row.shape]
    # What earlier rows left allocated (should be ~0): it would count in this row's peak.
    left_over = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    model = llama_of_shape(shape, device, dtype, max_positions=max(2048, settings["seq"]))
    if row.quant == "nf4":
        quantize_linears_(model, dtype)
    model = peft.get_peft_model(model, peft_config(row.adapter)).train()
    if row.adapter == STACKED:
        import oftv2

        oftv2.stack_rotations(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-5)
    run = model
    if row.mode == "compiled":
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(model, backend=settings["backend"])
    ids = torch.randint(3, shape["vocab_size"], (settings["batch"], settings["seq"]), device=device,
                        generator=torch.Generator(device).manual_seed(0))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step():
        return lm_train_step(run, optim, ids)

    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(settings["warmup"] - 1):
        step()
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(settings["steps"]):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    out = {"step_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           "first_step_s": first, "loss": float(loss), "trainable": sum(p.numel() for p in params),
           "allocated_before_gib": left_over}
    if row.mode == "compiled":
        out["dynamo"] = dynamo_counts()
    prof = gpu_profile(step, device) if settings["profile"] else {"gpu_busy_ms": None, "launches": None}
    out.update(prof, gpu_busy_fraction=None if prof["gpu_busy_ms"] is None else prof["gpu_busy_ms"] / out["step_ms"])
    if not math.isfinite(out["loss"]):
        raise RuntimeError(f"non-finite loss {out['loss']}")
    return out


def _estimate(row: Row, done: list[dict]) -> float:
    """Seconds ``row`` should take: the slowest finished row of the same shape and mode, else a first guess."""
    same = [r["seconds"] for r in done if r.get("shape") == row.shape and r.get("mode") == row.mode and "seconds" in r]
    return max(same) if same else FIRST_GUESS_S[row.mode]


def run(settings: dict, device: str, budget_s: float, out: Path, env: dict, skip_nf4: str | None) -> dict:
    """Measures :data:`PLAN` within ``budget_s``, rewriting ``out/gpu_step.json`` after every row.

    Args:
        settings: See :func:`measure_row`.
        device: ``cuda`` or ``cpu``.
        budget_s: Seconds the rows may take together; a row that would not fit is skipped.
        out: Output folder.
        env: What the record says about the machine and code.
        skip_nf4: Why the NF4 rows cannot run (bitsandbytes missing), or ``None``.
    """
    import torch
    import torch._dynamo

    record = {"env": env, "settings": {k: v for k, v in settings.items() if k != "shapes"},
              "shapes": settings["shapes"], "rows": []}
    started = time.perf_counter()
    for row in plan_for(env):
        entry = asdict(row) | {"method": row.method}
        left = budget_s - (time.perf_counter() - started)
        if row.quant == "nf4" and skip_nf4:
            entry["skipped"] = skip_nf4
        elif _estimate(row, record["rows"]) > left:
            entry["skipped"] = f"time budget: {left:.0f} s left of {budget_s:.0f}"
        else:
            t0 = time.perf_counter()
            try:
                with deadline(left + OVERRUN_S):
                    entry.update(measure_row(row, settings, device))
            except (Exception, RowCut) as err:  # noqa: BLE001 - one failing row (OOM, a compile error) must not end the table
                entry["error"] = f"{type(err).__name__}: {err}"[:400]
            entry["seconds"] = time.perf_counter() - t0
            torch._dynamo.reset()  # dynamo's caches would keep a compiled row's model (and its memory) alive
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        record["rows"].append(entry)
        print(_row_line(entry), flush=True)
        write_json(out / "gpu_step.json", record)
    return record


def _row_line(entry: dict) -> str:
    name = f"{entry['shape']} {entry['quant']} {entry['method']} {entry['mode']}"
    if "skipped" in entry or "error" in entry:
        return f"{name}: {entry.get('skipped') or entry['error']}"
    return (f"{name}: {entry['step_ms']:.1f} ms, peak {entry['peak_gib'] or float('nan'):.2f} GiB, "
            f"busy {entry['gpu_busy_fraction'] or float('nan'):.2f}, {entry['seconds']:.0f} s")


def environment(device: str, dry_run: bool, commit: str | None = None) -> dict:
    """What the result file says about where it ran.

    Args:
        device: ``cuda`` or ``cpu``.
        dry_run: Whether this is the CPU dry run.
        commit: The code's commit when this copy has no git history (the GPU machine gets a bare working tree).
    """
    import peft
    import torch
    import transformers

    try:
        import bitsandbytes

        bnb = bitsandbytes.__version__
    except ImportError:
        bnb = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    return {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit or os.environ.get("PEFTPLUG_COMMIT") or git_commit(),
            "torch": torch.__version__, "triton": triton_version, "bitsandbytes": bnb, "peft": peft.__version__,
            "transformers": transformers.__version__, "dry_run": dry_run, **device_environment(device)}


def main(argv=None) -> dict | None:
    """Runs the benchmark (or merges a run into the docs, or renders them); see the module docstring.

    Args:
        argv: Command-line arguments.
    """
    from benchmarks.oftv2 import gpu_step_report as step_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: the same code paths, for CI")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu/out"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds all rows may take together (GPU default 200; the dry run: no limit)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (GPU: 6)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, compile included (GPU: 3)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (GPU-busy share)")
    parser.add_argument("--commit", default=None, help="the code's commit, where the copy has no .git")
    parser.add_argument("--merge-docs", type=Path, default=None, metavar="GPU_STEP_JSON",
                        help="commit a run's gpu_step.json and render docs/benchmarks/oftv2.md's GPU section")
    parser.add_argument("--report", action="store_true", help="render the GPU section from the committed runs")
    args = parser.parse_args(argv)
    if args.merge_docs is not None:
        try:
            step_report.merge_docs(args.merge_docs)
        except (OSError, ValueError) as err:  # a wrong or missing file: one line, not a traceback
            raise SystemExit(f"--merge-docs: {err}") from None
        return None
    if args.report:
        if not step_report.report():
            raise SystemExit(f"no committed GPU step runs in {step_report.RESULTS}")
        return None
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.oftv2.gpu_step: torch sees no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        raise SystemExit(2)
    settings = {"shapes": DRY_SHAPES if args.dry_run else SHAPES, "batch": 1 if args.dry_run else 4,
                "seq": 16 if args.dry_run else 1024, "warmup": args.warmup if args.warmup is not None else (0 if args.dry_run else 3),
                "steps": args.steps or (1 if args.dry_run else 6),
                "dtype": "float32" if args.dry_run else "bfloat16",
                "backend": "eager" if args.dry_run else "inductor", "profile": not args.no_profile}
    try:
        import bitsandbytes  # noqa: F401

        skip_nf4 = None
    except ImportError:
        skip_nf4 = "bitsandbytes is not installed (carry its wheel in .whl/)"
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s if args.budget_s is not None else (math.inf if args.dry_run else 200.0)
    record = run(settings, device, budget, args.out,
                 environment(device, args.dry_run, args.commit), skip_nf4)
    text = step_report.render_run(record)
    write_page(args.out / "gpu_step.md", text)
    print(text)
    return record


if __name__ == "__main__":
    main()
