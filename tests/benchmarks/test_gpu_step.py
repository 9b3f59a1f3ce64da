"""benchmarks/oftv2/gpu_step.py without a GPU: its --dry-run measures every row of the plan on CPU at tiny sizes (eager and
compiled, bf16's stand-in and NF4), writes the run and its targets; the time budget skips rows; a dry run is never
merged into the docs; the first H200 run's files become a record whose numbers are exactly those files'."""

from __future__ import annotations

import json
import math
import re
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
    phases = [line for line in script.splitlines()
              if "timeout " in line and not line.lstrip().startswith("#") and "--dry-run" not in line]
    limits = [int(re.search(r"timeout (?:-s INT )?-k 5 (\d+) ", line).group(1)) for line in phases]
    assert len(limits) == 4 and sum(limits) <= 510, limits
    # A phase's own budget leaves its limit room for the imports before that clock starts and for the last item it
    # began: the NF4 sweep checks its budget only between token counts and writes its JSON once, at its end.
    for module, margin in (("benchmarks.oftv2.gpu_step", 30), ("benchmarks.kernels.nf4_sweep", 30)):
        line = next(line for line in phases if f"-m {module} " in line)
        limit = int(re.search(r"-k 5 (\d+) ", line).group(1))
        assert limit - float(re.search(r"--budget-s (\d+)", line).group(1)) >= margin, line
    # The CUDA tests write each outcome as it comes (-v) and, cut at their limit, get SIGINT: pytest then still
    # prints its summary of failures; with -q and TERM a cut run left only a row of dots.
    tests = next(line for line in phases if "-m pytest" in line)
    assert "timeout -s INT " in tests and " -v " in tests and " -q " not in tests


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


def test_a_row_that_outlasts_the_budget_is_cut_and_the_run_still_ends_by_itself(tmp_path, monkeypatch):
    # A compile far slower than its guess (the 1.1B compiled rows): cut once the budget (+ OVERRUN_S) is spent, before
    # run_all.sh's timeout would kill the process mid-row; the row says so, the rest are skipped, the page is written.
    import time as _time

    from benchmarks.oftv2 import gpu_step as step

    def slow_row(row, settings, device):
        _time.sleep(30)
        raise AssertionError("not cut")

    monkeypatch.setattr(step, "measure_row", slow_row)
    monkeypatch.setattr(step, "FIRST_GUESS_S", {"eager": 0.1, "compiled": 0.1})
    monkeypatch.setattr(step, "OVERRUN_S", 0.5)
    started = _time.perf_counter()
    record = step.main(["--dry-run", "--budget-s", "1", "--out", str(tmp_path)])
    assert _time.perf_counter() - started < 10
    first, rest = record["rows"][0], record["rows"][1:]
    assert first["error"].startswith("RowCut: cut after ") and 1 <= first["seconds"] < 5, first
    assert rest and all(r["skipped"].startswith("time budget") for r in rest)
    assert json.loads((tmp_path / "gpu_step.json").read_text())["rows"][0]["error"] == first["error"]
    assert "RowCut: cut after" in (tmp_path / "gpu_step.md").read_text()


def test_the_deadline_is_off_without_a_budget_and_restores_the_alarm_handler():
    import signal

    from benchmarks.oftv2 import gpu_step as step

    before = signal.getsignal(signal.SIGALRM)
    with step.deadline(float("inf")):
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with step.deadline(100.0):
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is before


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
    assert calls[1].startswith("-m pytest -v ")
    assert "tests/oftv2_bnb tests/kernels -k not dry_run and not nf4_sweep" in calls[1]
    assert calls[2] == f"-m benchmarks.kernels.nf4_sweep --budget-s 100 --out {tmp_path / 'out'}"
    assert f"-m benchmarks.kernels.gpu --skip-training --out {tmp_path / 'out'}" in calls[3:]
    log = (tmp_path / "out" / "run_all.log").read_text()
    for phase in ("gpu_step", "kernel_tests", "nf4_sweep", "kernels_gpu"):
        assert re.search(rf"^phase {phase}: exit 0, \d+ s$", log, re.MULTILINE), log


def _fake_repo(tmp_path: Path, python_body: str) -> tuple[Path, dict]:
    """run_all.sh in a folder of its own (a stand-in repository root) with a stand-in Python; returns the script
    and the environment."""
    root = tmp_path / "repo"
    (root / "benchmarks" / "gpu").mkdir(parents=True)
    script = root / "benchmarks" / "gpu" / "run_all.sh"
    script.write_text((REPO / "benchmarks" / "gpu" / "run_all.sh").read_text())
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\n" + python_body)
    stub.chmod(0o755)
    return script, {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "OUT": str(tmp_path / "out")}


def test_a_failing_phase_does_not_stop_the_others(tmp_path):
    # The step benchmark crashes (exit 1) and the CUDA tests fail: the NF4 sweep and the micro-benchmarks still run,
    # the log says which phase failed, and the script's own status says something failed.
    calls = tmp_path / "calls.txt"
    script, env = _fake_repo(tmp_path, f'echo "$*" >> {calls}\n'
                                        'case "$*" in *gpu_step*|*pytest*) exit 1;; esac\nexit 0\n')
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    modules = [line.split()[1] for line in calls.read_text().splitlines() if line.startswith("-m ")]
    assert modules == ["benchmarks.oftv2.gpu_step", "pytest", "benchmarks.kernels.nf4_sweep", "benchmarks.kernels.gpu"]
    log = (tmp_path / "out" / "run_all.log").read_text()
    assert re.search(r"^phase gpu_step: exit 1, \d+ s$", log, re.MULTILINE) and "tests exit 1, benchmarks exit 1" in log


def test_the_carried_wheels_are_installed_offline_when_bitsandbytes_is_missing(tmp_path):
    # The device image has no bitsandbytes: the .whl/ wheels are installed with pip's offline flags into /tmp/site,
    # which the later phases then see on PYTHONPATH (here a stand-in pip that "installs" by creating a marker).
    calls, marker = tmp_path / "calls.txt", tmp_path / "installed"
    script, env = _fake_repo(tmp_path, f'echo "$* | PYTHONPATH=$PYTHONPATH" >> {calls}\n'
                                        f'case "$*" in "-m pip install"*) touch {marker}; exit 0;; esac\n'
                                        f'case "$*" in *"import bitsandbytes"*) [ -e {marker} ] || exit 1;; esac\n'
                                        'exit 0\n')
    (script.parents[2] / ".whl").mkdir()
    (script.parents[2] / ".whl" / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl").write_bytes(b"")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = calls.read_text().splitlines()
    pip = next(line for line in lines if line.startswith("-m pip install"))
    for flag in ("--no-index", "--no-deps", "--target /tmp/site", ".whl/bitsandbytes-0.50.2-py3-none-manylinux"):
        assert flag in pip, pip
    sweep = next(line for line in lines if line.startswith("-m benchmarks.kernels.nf4_sweep"))
    assert sweep.endswith(":/tmp/site") and "--skip-bnb" not in "".join(lines)
