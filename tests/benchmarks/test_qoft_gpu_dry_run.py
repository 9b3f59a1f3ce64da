"""benchmarks/gpu/run_all.sh stays runnable without a GPU: its benchmark module (benchmarks.kernels.gpu)'s --dry-run exercises every code
path (Triton kernels through the interpreter, the three training set-ups) at tiny sizes, in this process."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_run_all_script_parses():
    script = REPO_ROOT / "benchmarks" / "gpu" / "run_all.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    help_text = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--dry-run" in help_text


def test_gpu_benchmark_dry_run(tmp_path):
    from peftplug_kernels._triton_available import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from benchmarks.kernels import gpu as bench

    results = bench.main(["--dry-run", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_results.json").read_text())
    assert saved["env"]["dry_run"] is True
    impls = {(r["op"], r["impl"]) for r in results["kernels"]}
    assert ("block_rotate", "triton") in impls
    assert ("nf4_rotate_matmul, 48 tokens", "fused nf4_rotate_matmul (triton)") in impls
    # fp16 activations (what the fused kernels take): a few fp16 roundings; Cayley–Neumann computes in fp32.
    assert all(r["max_rel_err"] < (1e-4 if r["op"].startswith("cayley_neumann") else 1e-2)
               for r in results["kernels"]), results["kernels"]
    methods = [r["method"] for r in results["training"]]
    assert methods == ["QOFT (ours)", "QOFT (ours, fused kernel forced)", "PEFT OFT (same 4-bit base)", "QLoRA r=16"]
    assert ("nf4_dequantize 96×128", "triton") in impls
    assert all(math.isfinite(r["loss"]) and r["step_ms"] > 0 for r in results["training"])
    assert "| QOFT (ours) |" in (tmp_path / "gpu_results.md").read_text()


def test_merge_docs_commits_the_run_and_renders_the_gpu_section_only(tmp_path, kernel_page):
    from benchmarks.common.pages import read_section
    from benchmarks.kernels import gpu

    record = {"env": {"device": "NVIDIA H200", "torch": "2.13.0", "triton": "3.9.0", "bitsandbytes": "not installed",
                      "dtype": "bfloat16", "dry_run": False},
              "config": {"tokens": 4096, "width": 4096, "out": 4096, "block": 32}, "training": [],
              "kernels": [{"op": "block_rotate", "impl": "triton", "fwd_ms": 0.5, "fwd_bwd_ms": 1.5,
                           "fwd_bwd_peak_mib": 64.0, "max_rel_err": 1e-6}]}
    run = tmp_path / "out"
    run.mkdir()
    (run / "gpu_results.json").write_text(json.dumps(record))
    page = kernel_page
    gpu.main(["--merge-docs", str(run / "gpu_results.md")])  # the .md names the run; its JSON is what is kept
    assert json.loads(gpu.RESULTS.read_text()) == record
    text = page.read_text()
    assert read_section(text, "qoft-cpu") == "CPU part"
    assert "| block_rotate | triton | 0.500 | 1.500 |" in read_section(text, "qoft-gpu")
    page.write_text(text.replace("| block_rotate |", "| stale |"))
    gpu.main(["--report"])
    assert page.read_text() == text


def test_merging_a_run_without_training_rows_points_to_the_step_benchmark(tmp_path, kernel_page):
    # run_all.sh runs this module with --skip-training (the step table is benchmarks.oftv2.gpu_step's now): merging
    # such a run replaces the committed file, whose 2026-12-04 training table then leaves the page; the section says
    # where the training step is measured instead of ending silently after the kernels.
    from benchmarks.common.pages import read_section
    from benchmarks.kernels import gpu

    record = {"env": {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "bitsandbytes": "0.50.2",
                      "dtype": "bfloat16", "dry_run": False},
              "config": {"tokens": 4096, "width": 4096, "out": 4096, "block": 32}, "training": [],
              "kernels": [{"op": "nf4_rotate_matmul, 16 tokens", "impl": "fused nf4_rotate_matmul (triton)",
                           "fwd_ms": 0.1, "fwd_bwd_ms": 0.5, "fwd_bwd_peak_mib": 8.0, "max_rel_err": 1e-3}],
              "fused_crossover": 16, "fused_max_tokens": 64}
    (tmp_path / "gpu_results.json").write_text(json.dumps(record))
    page = kernel_page
    gpu.main(["--merge-docs", str(tmp_path / "gpu_results.json")])
    section = read_section(page.read_text(), "qoft-gpu")
    assert "| training step |" not in section
    assert "`python -m benchmarks.oftv2.gpu_step` (docs/benchmarks/oftv2.md, GPU section)" in section


def test_gpu_benchmark_dry_run_without_bitsandbytes(tmp_path):
    # The H200 image has no bitsandbytes: the script must still time the other kernels and render a section.
    from peftplug_kernels._triton_available import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from benchmarks.kernels import gpu as bench

    results = bench.main(["--dry-run", "--skip-bnb", "--out", str(tmp_path)])
    ops = {r["op"].split(",")[0] for r in results["kernels"]}
    assert ops == {"block_rotate", "cayley_neumann"} and results["training"] == []
    section = (tmp_path / "gpu_results.md").read_text()
    assert "bitsandbytes was not installed" in section and "| cayley_neumann" in section


def test_fused_crossover_is_the_last_win_before_the_first_loss():
    from benchmarks.kernels.gpu import fused_crossover

    def sweep(times):  # {tokens: (fused ms, unfused ms)}
        return [{"op": f"nf4_rotate_matmul, {t} tokens", "impl": impl, "fwd_bwd_ms": ms}
                for t, pair in times.items()
                for impl, ms in zip(("fused nf4_rotate_matmul (triton)", "rotate (triton) + bnb.matmul_4bit"), pair)]

    assert fused_crossover(sweep({16: (1, 2), 256: (1, 2), 1024: (3, 2), 4096: (1, 2)})) == 256
    assert fused_crossover(sweep({16: (3, 2), 256: (1, 2)})) is None
    assert fused_crossover(sweep({4096: (1, 2), 16: (1, 2)})) == 4096
