"""The GPU step benchmark's tables and issue 40's targets: one run (what ``benchmarks.oftv2.gpu_step`` prints and writes
beside its JSON) and every committed run (the ``oftv2-gpu`` section of docs/benchmarks/oftv2.md).

Committed runs live in ``benchmarks/oftv2/results/gpu_step/``, one JSON each. The first H200 run (2026-12-04, commit d6385f5)
predates the step benchmark: its numbers came from probe scripts and ``benchmarks/kernels/gpu.py``, and
``--import-shared ../shared/gpu/2026-12-04-h200`` turns those files (and only their numbers) into a record of the
same form, each row naming the file it came from.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from benchmarks.common.fmt import fmt
from benchmarks.common.pages import read_json, write_json, write_section
from benchmarks.common.paths import DOCS, results_dir

RESULTS = results_dir("oftv2") / "gpu_step"
PAGE = DOCS / "oftv2.md"
SECTION = "oftv2-gpu"
TITLE = "# OFTv2 CPU benchmark"
#: Compiled LoRA r16 at 1.1B on the first H200 run (``step_compiled_1p1b.json``): the target when a run on the same
#: machine (:data:`ANCHOR_MACHINE`) has none of its own.
LORA_COMPILED_2026_12_04_MS = 83.2
#: GPU model and torch minor version of that measurement: on another GPU or torch a compiled step is another number,
#: so there the compiled target needs this run's own compiled LoRA row.
ANCHOR_MACHINE = ("NVIDIA H200", "2.11.")
#: Issue 40's moonshot for eager OFTv2 at 1.1B: 100 ms against the H200's 127.8 ms LoRA step, i.e. 0.78× LoRA —
#: judged as that ratio to this run's LoRA, so that it means the same on any GPU.
MOONSHOT_EAGER_MS = 100.0
MOONSHOT_EAGER_RATIO = 0.78
#: Issue 41's step target: QOFT ≤ 0.95× QLoRA on the 1.1B NF4 shape (eager).
QOFT_ISSUE41_RATIO = 0.95


def anchor_applies(env: dict) -> bool:
    """Whether the 2026-12-04 compiled-LoRA step may stand in for a run's own: same GPU model and torch minor version.

    A dry run counts as the same machine: its verdicts are no measurement, but it runs the fallback's code path.

    Args:
        env: The run's ``env``.
    """
    if env.get("dry_run"):
        return True
    device, torch_prefix = ANCHOR_MACHINE
    return env.get("device") == device and str(env.get("torch") or "").startswith(torch_prefix)


def _find(rows: list[dict], shape: str, quant: str, method: str, mode: str) -> dict | None:
    for row in rows:
        if (row["shape"], row["quant"], row["method"], row["mode"]) == (shape, quant, method, mode) \
                and row.get("step_ms") is not None:
            return row
    return None


def _anchor(rows: list[dict], row: dict) -> dict | None:
    """LoRA r16 (QLoRA on NF4) of the same shape, base and mode."""
    return _find(rows, row["shape"], row["quant"], "QLoRA r16" if row["quant"] == "nf4" else "LoRA r16", row["mode"])


def targets(record: dict) -> list[tuple[str, str, str]]:
    """Issue 40's GPU targets on one run: ``(target, measured, "met" / "not met" / "not measured")``.

    Args:
        record: A run (``rows`` as ``benchmarks.oftv2.gpu_step`` writes them).
    """
    rows = record["rows"]
    lora, oft = _find(rows, "1.1B", "bf16", "LoRA r16", "eager"), _find(rows, "1.1B", "bf16", "OFTv2 b32", "eager")
    qlora, qoft = _find(rows, "1.1B", "nf4", "QLoRA r16", "eager"), _find(rows, "1.1B", "nf4", "QOFT b32", "eager")
    lora_c = _find(rows, "1.1B", "bf16", "LoRA r16", "compiled")
    oft_c = _find(rows, "1.1B", "bf16", "OFTv2 b32", "compiled")
    # The anchor of the compiled targets: this run's compiled LoRA, else the 2026-12-04 H200 number, but only on that
    # machine (an H100's compiled OFTv2 against an H200's LoRA says nothing).
    if lora_c:
        lora_c_ms, lora_c_src = lora_c["step_ms"], "this run"
    elif anchor_applies(record["env"]):
        lora_c_ms, lora_c_src = LORA_COMPILED_2026_12_04_MS, "2026-12-04"
    else:
        lora_c_ms, lora_c_src = None, f"not measured in this run; 2026-12-04's is an {ANCHOR_MACHINE[0]}'s"
    out = []

    def add(name: str, value: float | None, limit: float, text: str) -> None:
        verdict = "not measured" if value is None else ("met" if value <= limit else "not met")
        out.append((name, text if value is not None else "—", verdict))

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and a.get(key) is not None and b.get(key) is not None else None

    r = ratio(oft, lora, "step_ms")
    add("eager OFTv2 ≤ 1.00 × LoRA r16, 1.1B bf16", r, 1.0, f"{fmt(r, '.3f')}×")
    add(f"moonshot: eager OFTv2 ≤ {MOONSHOT_EAGER_RATIO:.2f} × LoRA r16 ({MOONSHOT_EAGER_MS:.0f} ms on the H200), "
        "1.1B bf16", r, MOONSHOT_EAGER_RATIO, f"{fmt(oft and oft['step_ms'], '.1f')} ms = {fmt(r, '.3f')}×")
    r = oft_c["step_ms"] / lora_c_ms if oft_c and lora_c_ms else None
    add(f"compiled OFTv2 ≤ compiled LoRA r16 ({fmt(lora_c_ms, '.1f')} ms, {lora_c_src})", r, 1.0,
        f"{fmt(oft_c and oft_c['step_ms'], '.1f')} ms = {fmt(r, '.3f')}×")
    add("moonshot: compiled OFTv2 ≤ 0.85 × compiled LoRA r16", r, 0.85, f"{fmt(r, '.3f')}×")
    r = ratio(qoft, qlora, "step_ms")
    add("QOFT ≤ QLoRA r16 eager, 1.1B NF4", r, 1.0, f"{fmt(r, '.3f')}×")
    r = ratio(oft, lora, "peak_gib")
    add("peak memory OFTv2 ≤ 0.75 × LoRA r16's, 1.1B bf16", r, 0.75, f"{fmt(r, '.3f')}×")
    r = ratio(qoft, qlora, "peak_gib")
    add("peak memory QOFT ≤ 0.75 × QLoRA r16's, 1.1B NF4", r, 0.75, f"{fmt(r, '.3f')}×")
    # Not an issue-40 target: the question the dispatch table asks. "met" means the torch path (one autograd
    # Function a layer) beat the Triton kernels auto runs, so the device's cayley_neumann and block_rotate entries
    # should say torch (peftplug_kernels/dispatch_table.py).
    torch_path = _find(rows, "1.1B", "bf16", "OFTv2 b32, kernel_impl=torch", "eager")
    r = ratio(torch_path, oft, "step_ms")
    add("table check: OFTv2 torch path ≤ auto (Triton) eager, 1.1B bf16", r, 1.0,
        f"{fmt(torch_path and torch_path['step_ms'], '.1f')} ms = {fmt(r, '.3f')}×")
    # Not a target either: whether oftv2.stack_rotations (one batched series per forward) reaches LoRA's step.
    for quant, anchor in (("bf16", lora), ("nf4", qlora)):
        stacked = _find(rows, "1.1B", quant, "OFTv2 b32, stacked rotations" if quant == "bf16"
                        else "QOFT b32, stacked rotations", "eager")
        r = ratio(stacked, anchor, "step_ms")
        add(f"stacked rotations: eager {'OFTv2' if quant == 'bf16' else 'QOFT'} ≤ "
            f"{'LoRA' if quant == 'bf16' else 'QLoRA'} r16, 1.1B {quant}", r, 1.0,
            f"{fmt(stacked and stacked['step_ms'], '.1f')} ms = {fmt(r, '.3f')}×")
    stacked_c = _find(rows, "1.1B", "bf16", "OFTv2 b32, stacked rotations", "compiled")
    r = stacked_c["step_ms"] / lora_c_ms if stacked_c and lora_c_ms else None
    add("stacked rotations: compiled OFTv2 ≤ compiled LoRA r16, 1.1B bf16", r, 1.0,
        f"{fmt(stacked_c and stacked_c['step_ms'], '.1f')} ms = {fmt(r, '.3f')}×")
    return out


def issue41_targets(record: dict) -> list[tuple[str, str, str]]:
    """Issue 41's step target on one run (same form as :func:`targets`, printed in its own table).

    Args:
        record: A run.
    """
    rows = record["rows"]
    qlora, qoft = _find(rows, "1.1B", "nf4", "QLoRA r16", "eager"), _find(rows, "1.1B", "nf4", "QOFT b32", "eager")
    r = qoft["step_ms"] / qlora["step_ms"] if qoft and qlora else None
    verdict = "not measured" if r is None else ("met" if r <= QOFT_ISSUE41_RATIO else "not met")
    return [(f"QOFT ≤ {QOFT_ISSUE41_RATIO:.2f} × QLoRA r16 eager, 1.1B NF4", f"{fmt(r, '.3f')}×" if r else "—",
             verdict)]


def _source_line(record: dict) -> str:
    env = record["env"]
    # CUDA runtime, driver and capability: runs before 2026-12-08 did not record them.
    versions = ", ".join(f"{k} {env[k]}" for k in ("capability", "cuda", "driver", "torch", "triton", "bitsandbytes",
                                                   "peft", "transformers") if env.get(k))
    s = record["settings"]
    how = (f"batch {s['batch']} × {s['seq']} tokens, {s['dtype']}, median of {s['steps']} steps after "
           f"{s['warmup']} warm-up steps (the compiled rows compile in the first)")
    where = f"Source: `{record['source']}`. " if record.get("source") else ""
    return f"{where}{env['device']}, {env['date']}, commit `{env['commit']}`; {versions}; {how}."


def render_run(record: dict, heading: str = "##") -> str:
    """One run: its table and its targets.

    Args:
        record: A run.
        heading: Markdown heading level of the run's title.
    """
    env, rows = record["env"], record["rows"]
    title = f"{heading} {env['device']}, {env['date'][:10]}" + (" (dry run: tiny sizes, not a measurement)"
                                                                  if env.get("dry_run") else "")
    lines = [title, "", _source_line(record), "",
             ("| shape | base | method | mode | step ms | × LoRA r16 / QLoRA | peak GiB | × LoRA r16 / QLoRA "
             "| GPU busy ms | busy share | launches | first step s | source |"),
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        head = f"| {row['shape']} | {row['quant']} | {row['method']} | {row['mode']} |"
        if row.get("step_ms") is None:
            lines.append(f"{head} {row.get('skipped') or row.get('error') or '—'} | | | | | | | | |")
            continue
        anchor = _anchor(rows, row)
        step_x = fmt(row["step_ms"] / anchor["step_ms"], ".2f") if anchor else "—"
        mem_x = (fmt(row["peak_gib"] / anchor["peak_gib"], ".2f")
                 if anchor and row.get("peak_gib") and anchor.get("peak_gib") else "—")
        lines.append(f"{head} {row['step_ms']:.1f} | {step_x} | {fmt(row.get('peak_gib'), '.2f')} | {mem_x} | "
                     f"{fmt(row.get('gpu_busy_ms'), '.1f')} | {fmt(row.get('gpu_busy_fraction'), '.2f')} | "
                     f"{fmt(row.get('launches'), ',d')} | {fmt(row.get('first_step_s'), '.1f')} | "
                     f"{row.get('source', '')} |")
    lines += ["", "Issue 40's targets on this run:", "", "| target | measured | |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict} |" for name, value, verdict in targets(record)]
    lines += ["", "Issue 41's step target on this run:", "", "| target | measured | |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict} |" for name, value, verdict in issue41_targets(record)]
    return "\n".join(lines) + "\n"


def render_section(records: list[dict]) -> str:
    """The ``oftv2-gpu`` section: every committed run, oldest first.

    Args:
        records: The runs.
    """
    intro = ("## GPU: training step, Llama shapes with random weights\n\n"
             "Adapters on all seven linear kinds, AdamW, CUDA synchronised; × = ratio to LoRA r16 (QLoRA r16 on "
             "NF4) of the same shape, base and mode. GPU busy = the kernels' summed device time in one profiled "
             "step (the profiler's \"Self CUDA time total\"); busy share = that / the median step. Generated by "
             "`python -m benchmarks.oftv2.gpu_step --merge-docs` (a run of `bash benchmarks/gpu/run_all.sh`) and "
             "`--report`; one file per run in `benchmarks/oftv2/results/gpu_step/`. On the GPU machine: "
             "`PEFTPLUG_COMMIT=<hash> OUT=<dir> bash benchmarks/gpu/run_all.sh` with the bitsandbytes wheel carried "
             "in `.whl/` (docs/qoft.md); the step benchmark gets 240 s of it and skips the rows that would not fit. "
             "The CPU side of this launch-bound cost, per adapted layer: [oftv2_overhead.md](oftv2_overhead.md).\n")
    runs = sorted(records, key=lambda r: r["env"]["date"])
    return intro + "\n" + "\n".join(render_run(r, "###") for r in runs)


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the ``oftv2-gpu`` section of ``page`` from the runs in ``results``; returns whether there were any.

    Args:
        results: The committed runs.
        page: docs/benchmarks/oftv2.md.
    """
    records = [read_json(p) for p in sorted(Path(results).glob("*.json"))]
    if not records:
        return False
    write_section(page, SECTION, render_section(records), TITLE)
    return True


def merge_docs(path: Path, results: Path = RESULTS, page: Path = PAGE) -> Path:
    """Commits a run's ``gpu_step.json`` as ``results/<date>-<device>.json`` and re-renders the section.

    Args:
        path: The run's ``gpu_step.json`` (or the ``gpu_step.md`` beside it).
        results: The committed runs.
        page: docs/benchmarks/oftv2.md.

    Raises:
        ValueError: For a dry run's file (tiny sizes on CPU are no measurement), or a file that is not a run of
            ``benchmarks.oftv2.gpu_step`` (e.g. the 2026-12-04 probe files: ``--import-shared`` reads those).
    """
    path = Path(path)
    path = path.with_suffix(".json") if path.suffix == ".md" else path
    record = json.loads(path.read_text(encoding="utf-8"))
    env = record.get("env") if isinstance(record, dict) else None
    if not (isinstance(env, dict) and env.get("device") and env.get("date") and isinstance(record.get("rows"), list)):
        # Checked before anything is copied: a foreign file would otherwise break every later --report.
        raise ValueError(f"{path} is not a run of benchmarks.oftv2.gpu_step (it needs env.device, env.date and rows); "
                         "the 2026-12-04 probe files are read by `python -m benchmarks.oftv2.gpu_step_report "
                         "--import-shared FOLDER`")
    if env.get("dry_run"):
        raise ValueError(f"{path} is a dry run (tiny sizes on CPU): only a GPU run is merged into the docs")
    slug = re.sub(r"[^a-z0-9]+", "-", f"{record['env']['date'][:10]}-{record['env']['device']}".lower()).strip("-")
    results.mkdir(parents=True, exist_ok=True)
    target = results / f"{slug}.json"
    shutil.copyfile(path, target)
    report(results, page)
    return target


def _self_cuda_ms(path: Path) -> float:
    """The "Self CUDA time total" of a saved ``key_averages().table()`` (ms)."""
    match = re.search(r"Self CUDA time total: ([\d.]+)(ms|us|s)", path.read_text(encoding="utf-8"))
    value, unit = float(match.group(1)), match.group(2)
    return value * {"ms": 1.0, "us": 1e-3, "s": 1e3}[unit]


def import_shared(folder: Path) -> dict:
    """The 2026-12-04 H200 run's step numbers as a record of this module's form (see the module docstring).

    Args:
        folder: ``../shared/gpu/2026-12-04-h200``.
    """
    folder = Path(folder)
    rows: list[dict] = []

    def add(shape, quant, adapter, method, mode, src, data, **extra) -> None:
        rows.append({"shape": shape, "quant": quant, "adapter": adapter, "method": method, "mode": mode,
                     "step_ms": data["step_ms"], "peak_gib": data.get("peak_gib"), "source": src,
                     "first_step_s": data.get("first_step_s"), **extra})

    bf16 = {r["method"]: r for r in json.loads((folder / "step_bf16_1p1b.json").read_text())["rows"]}
    for name, (adapter, method) in {"LoRA r16": ("LoRA r16", "LoRA r16"),
                                    "OFTv2 b32 (auto)": ("OFTv2 b32", "OFTv2 b32"),
                                    "OFTv2 b32 (torch)": ("OFTv2 b32", "OFTv2 b32, kernel_impl=torch"),
                                    "PEFT OFT b32 CN": ("PEFT OFT b32", "PEFT OFT b32"),
                                    "full FT (no adapter)": ("full FT", "full finetuning")}.items():
        add("1.1B", "bf16", adapter, method, "eager", "step_bf16_1p1b.json", bf16[name])
    compiled = {r["method"]: r for r in json.loads((folder / "step_compiled_1p1b.json").read_text())}
    add("1.1B", "bf16", "LoRA r16", "LoRA r16", "compiled", "step_compiled_1p1b.json", compiled["LoRA r16 compiled"])
    add("1.1B", "bf16", "OFTv2 b32", "OFTv2 b32", "compiled", "step_compiled_1p1b.json",
        compiled["OFTv2 b32 auto compiled"])
    training = {r["method"]: r for r in json.loads((folder / "gpu_results.json").read_text())["training"]}
    for name, (adapter, method) in {"QLoRA r=16": ("LoRA r16", "QLoRA r16"), "QOFT (ours)": ("OFTv2 b32", "QOFT b32"),
                                    "QOFT (ours, fused kernel forced)": ("OFTv2 b32", "QOFT b32, fused NF4 forced"),
                                    "PEFT OFT (same 4-bit base)": ("PEFT OFT b32", "PEFT OFT b32")}.items():
        add("1.1B", "nf4", adapter, method, "eager", "gpu_results.json", training[name])
    wide = json.loads((folder / "step_7bwidths_and_profile.json").read_text())
    names = {"OFTv2": ("OFTv2 b32", "OFTv2 b32"), "LoRA r16": ("LoRA r16", "LoRA r16"),
             "PEFT OFT": ("PEFT OFT b32", "PEFT OFT b32")}
    for r in wide["rows"]:
        base, rest = r["method"].split(" ", 1)
        adapter, method = names[rest.split(" @")[0]]
        quant = "nf4" if base == "NF4" else "bf16"
        if quant == "nf4":
            method = {"OFTv2 b32": "QOFT b32", "LoRA r16": "QLoRA r16"}.get(method, method)
        add("7B-class widths", quant, adapter, method, "eager", "step_7bwidths_and_profile.json", r)
    # GPU busy (the profile tables' totals) and launches (the probe's counts) of the four profiled 1.1B steps.
    for quant, adapter, method in (("bf16", "oftv2", "OFTv2 b32"), ("bf16", "lora", "LoRA r16"),
                                   ("nf4", "oftv2", "QOFT b32"), ("nf4", "lora", "QLoRA r16")):
        row = _find(rows, "1.1B", quant, method, "eager")
        profile = wide["profiles"][f"{'NF4' if quant == 'nf4' else 'bf16'} "
                                   f"{'OFTv2' if adapter == 'oftv2' else 'LoRA r16'} @1.1B"]
        row["gpu_busy_ms"] = _self_cuda_ms(folder / f"prof_{quant}_{adapter}.txt")
        row["gpu_busy_fraction"] = row["gpu_busy_ms"] / row["step_ms"]
        row["launches"] = profile["launches"]
        row["source"] += f", prof_{quant}_{adapter}.txt"
    env = {"device": "NVIDIA H200", "date": "2026-12-04", "commit": "d6385f5", "torch": "2.11.0+cu130",
           "triton": "3.6.0", "bitsandbytes": "0.50.2", "peft": "0.21.2", "transformers": "5.17.0", "dry_run": False}
    settings = {"batch": 4, "seq": 1024, "dtype": "bfloat16", "steps": "8–10", "warmup": 3}
    return {"env": env, "settings": settings, "source": "../shared/gpu/2026-12-04-h200/", "rows": rows}


def main(argv=None) -> None:
    """``--import-shared FOLDER``: commit the 2026-12-04 run's record and render the section; ``--report``: render.

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--import-shared", type=Path, default=None, metavar="FOLDER")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    if args.import_shared is not None:
        write_json(RESULTS / "2026-12-04-nvidia-h200.json", import_shared(args.import_shared))
    if not report():
        raise SystemExit(f"no committed GPU step runs in {RESULTS}")


if __name__ == "__main__":
    main()
