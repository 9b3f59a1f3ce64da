"""benchmarks/oftv2/gpu_step.py without a GPU: its --dry-run measures every row of the plan on CPU at tiny sizes (eager and
compiled, bf16's stand-in and NF4), writes the run and its targets; the time budget skips rows; a dry run is never
merged into the docs; the first H200 run's files become a record whose numbers are exactly those files'."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[2]
SHARED_RUN = REPO.parent / "shared" / "gpu" / "2026-12-04-h200"


def test_run_all_calls_the_step_benchmark_within_its_time_budget():
    script = (REPO / "benchmarks" / "gpu" / "run_all.sh").read_text()
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu" / "run_all.sh")], check=True)
    assert "-m benchmarks.oftv2.gpu_step --out" in script and "-m benchmarks.oftv2.gpu_step --dry-run" in script
    # Every phase of the GPU run is bounded (step benchmark, CUDA tests, NF4 sweep, micro-benchmarks) within 510 s.
    limits = [int(line.split("timeout -k 5 ")[1].split()[0]) for line in script.splitlines()
              if "timeout -k 5 " in line and not line.lstrip().startswith("#") and "--dry-run" not in line]
    assert len(limits) == 4 and sum(limits) <= 510, limits


def test_dry_run_measures_every_row_and_checks_the_targets(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    from benchmarks.oftv2 import gpu_step as step
    from benchmarks.oftv2 import gpu_step_report as step_report

    record = step.main(["--dry-run", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_step.json").read_text())
    assert saved == json.loads(json.dumps(record)) and saved["env"]["dry_run"] is True
    assert [(r["shape"], r["quant"], r["adapter"], r["mode"]) for r in saved["rows"]] == \
        [(r.shape, r.quant, r.adapter, r.mode) for r in step.PLAN]
    for row in saved["rows"]:
        assert "error" not in row and "skipped" not in row, row
        assert row["step_ms"] > 0 and math.isfinite(row["loss"]) and row["trainable"] > 0
    compiled = [r for r in saved["rows"] if r["mode"] == "compiled"]
    assert len(compiled) == 3 and all(r["dynamo"]["graphs"] >= 1 for r in compiled)
    # QOFT and QLoRA name the NF4 rows; OFTv2 trains fewer parameters than LoRA r16.
    methods = {(r["quant"], r["adapter"]): r for r in saved["rows"] if r["mode"] == "eager" and r["shape"] == "1.1B"}
    assert methods[("nf4", "OFTv2 b32")]["method"] == "QOFT b32"
    assert methods[("bf16", "OFTv2 b32")]["trainable"] < methods[("bf16", "LoRA r16")]["trainable"]
    text = (tmp_path / "gpu_step.md").read_text()
    assert text in capsys.readouterr().out
    verdicts = {name: verdict for name, _, verdict in step_report.targets(saved)}
    assert len(verdicts) == 11 and set(verdicts.values()) <= {"met", "not met", "not measured"}
    # The dispatch-table question is answered from the torch-path row the plan runs, the stacked-rotation one from
    # its rows (stack_rotations on the bf16 and the NF4 base, eager and compiled).
    assert verdicts["table check: OFTv2 torch path ≤ auto (Triton) eager, 1.1B bf16"] in {"met", "not met"}
    assert {v for k, v in verdicts.items() if k.startswith("stacked rotations")} <= {"met", "not met"}
    assert len([k for k in verdicts if k.startswith("stacked rotations")]) == 3
    # CPU has no allocator statistics: the memory targets say so rather than pass.
    assert verdicts["peak memory OFTv2 ≤ 0.75 × LoRA r16's, 1.1B bf16"] == "not measured"
    assert "| compiled OFTv2 ≤ compiled LoRA r16 (" in text and " ms, this run) |" in text
    with pytest.raises(ValueError, match="dry run"):
        step_report.merge_docs(tmp_path / "gpu_step.json", tmp_path / "results", tmp_path / "page.md")


def test_budget_skips_the_rows_that_do_not_fit(tmp_path):
    from benchmarks.oftv2 import gpu_step as step
    from benchmarks.oftv2 import gpu_step_report as step_report

    record = step.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)])
    assert all(r["skipped"].startswith("time budget") for r in record["rows"])
    verdicts = {verdict for _, _, verdict in step_report.targets(record)}
    assert verdicts == {"not measured"}
    # Without its own compiled LoRA, the compiled target falls back to the 2026-12-04 measurement.
    assert "83.2 ms, 2026-12-04" in step_report.render_run(record)


@pytest.mark.skipif(not SHARED_RUN.is_dir(), reason="../shared/gpu/2026-12-04-h200 is not beside this checkout")
def test_the_first_h200_run_imports_with_its_own_numbers(tmp_path):
    from benchmarks.oftv2 import gpu_step_report as step_report

    record = step_report.import_shared(SHARED_RUN)
    rows = {(r["shape"], r["quant"], r["method"], r["mode"]): r for r in record["rows"]}
    # The README's table, number for number.
    assert round(rows[("1.1B", "bf16", "LoRA r16", "eager")]["step_ms"], 1) == 127.8
    assert round(rows[("1.1B", "bf16", "OFTv2 b32", "eager")]["step_ms"], 1) == 139.7
    assert round(rows[("1.1B", "bf16", "OFTv2 b32", "compiled")]["step_ms"], 1) == 267.9
    assert round(rows[("1.1B", "nf4", "QOFT b32", "eager")]["peak_gib"], 2) == 8.99
    assert round(rows[("7B-class widths", "nf4", "QOFT b32", "eager")]["step_ms"], 1) == 79.1
    assert rows[("1.1B", "bf16", "OFTv2 b32", "eager")]["gpu_busy_ms"] == 73.471
    assert rows[("1.1B", "bf16", "LoRA r16", "eager")]["launches"] == 4894
    verdicts = {name: (value, verdict) for name, value, verdict in step_report.targets(record)}
    assert verdicts["eager OFTv2 ≤ 1.00 × LoRA r16, 1.1B bf16"] == ("1.094×", "not met")
    assert verdicts["peak memory QOFT ≤ 0.75 × QLoRA r16's, 1.1B NF4"][1] == "met"
    # Rendered into its section of a page, and rendered again from the committed file alone, byte for byte.
    results, page = tmp_path / "results", tmp_path / "oftv2.md"
    page.write_text("# OFTv2\n\n<!-- oftv2-cpu:begin -->\nCPU part\n<!-- oftv2-cpu:end -->\n")
    (results).mkdir()
    (results / "first.json").write_text(json.dumps(record))
    assert step_report.report(results, page)
    text = page.read_text()
    assert "CPU part" in text and "| 1.1B | bf16 | OFTv2 b32 | compiled | 267.9 | 3.22 |" in text
    assert "Source: `../shared/gpu/2026-12-04-h200/`" in text
    step_report.report(results, page)
    assert page.read_text() == text


def test_run_all_runs_its_phases_in_order_with_the_commit(tmp_path):
    # A stand-in Python records each command line: the step benchmark first (with the commit the machine's copy has
    # no .git to tell), then the CUDA tests, the NF4 sweep (issue 41), then the kernel micro-benchmarks without their
    # training rows.
    stub, log = tmp_path / "python", tmp_path / "calls.txt"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "OUT": str(tmp_path / "out"), "PEFTPLUG_COMMIT": "abc1234"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run_all.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [line for line in log.read_text().splitlines() if not line.startswith("-c ")]
    assert calls[0] == f"-m benchmarks.oftv2.gpu_step --out {tmp_path / 'out'} --budget-s 210 --commit abc1234"
    assert calls[1].startswith("-m pytest -q -p no:cacheprovider tests/kernels tests/oftv2_bnb")
    assert calls[2] == f"-m benchmarks.kernels.nf4_sweep --budget-s 140 --out {tmp_path / 'out'}"
    assert f"-m benchmarks.kernels.gpu --skip-training --out {tmp_path / 'out'}" in calls[3:]
