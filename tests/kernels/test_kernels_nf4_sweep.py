"""The prepared GPU sweep of the NF4 paths runs end to end at tiny sizes on CPU (``--dry-run``, interpreter)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("needs_triton")
# The dry run runs the kernels through the interpreter on CPU tensors: in a CUDA session whose kernels are compiled
# already it would launch them on CPU pointers (benchmarks/gpu/run_all.sh deselects these tests there too).
cpu_dry_run = pytest.mark.skipif(os.environ.get("PEFTPLUG_KERNELS_ON_GPU") == "1", reason="a CPU dry run")


@cpu_dry_run
def test_dry_run_measures_every_path_and_prints_the_threshold(tmp_path, capsys):
    from benchmarks.kernels import nf4_sweep

    result = nf4_sweep.main(["--dry-run", "--out", str(tmp_path)])
    rows = result["rows"]
    impls = {"dense bf16", "rotate + bnb", "dequantize + cuBLAS", "fused", "policy"}
    assert {(r["tokens"], r["impl"]) for r in rows} == {(t, i) for t in nf4_sweep.DRY["tokens"] for i in impls}
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    # Every path computes the same layer (dense bf16 is the unrotated floor, not compared).
    assert all(r["max_rel_err"] < 0.05 for r in rows if r["impl"] != "dense bf16")
    assert set(result["autotune"]) == {str(t) for t in nf4_sweep.DRY["tokens"]}
    assert "fwd_bwd_ms" in result["rotate"]["triton"]
    assert "recommended dispatch threshold" in capsys.readouterr().out
    assert json.loads((tmp_path / "nf4_sweep.json").read_text())["verdicts"] == result["verdicts"]


@cpu_dry_run
def test_every_measurement_group_is_saved_as_it_ends(tmp_path, monkeypatch):
    """A run killed by its time limit keeps what it measured: the JSON is rewritten after each group (marked partial),
    and the complete file, with the verdicts, replaces it at the end."""
    import copy

    from benchmarks.kernels import nf4_sweep

    saved, write = [], nf4_sweep.write_json
    monkeypatch.setattr(nf4_sweep, "write_json", lambda path, obj, **kw: (saved.append(copy.deepcopy(obj)),
                                                                          write(path, obj, **kw))[1])
    result = nf4_sweep.main(["--dry-run", "--out", str(tmp_path)])
    partial = [s for s in saved if s.get("partial")]
    assert len(partial) == 1 + len(nf4_sweep.DRY["tokens"])  # block_rotate, then one per token count
    assert [len(s["rows"]) for s in partial] == sorted(len(s["rows"]) for s in partial)
    assert partial[-1]["rows"] == result["rows"] and "verdicts" not in partial[-1]
    final = json.loads((tmp_path / "nf4_sweep.json").read_text())
    assert "partial" not in final and final["verdicts"] == result["verdicts"]


@cpu_dry_run
def test_a_spent_budget_skips_the_rest_and_still_writes(tmp_path):
    from benchmarks.kernels import nf4_sweep

    result = nf4_sweep.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)])
    assert result["rows"] == [] and len(result["skipped"]) == len(nf4_sweep.DRY["tokens"])
    assert result["rotate"] == {"skipped": True}
    assert result["verdicts"][-1].endswith(": never")
    assert (tmp_path / "nf4_sweep.json").exists()


def test_verdicts_judge_each_target_and_set_the_threshold():
    from benchmarks.kernels import nf4_sweep

    cfg = nf4_sweep.FULL
    rows = []
    for n, k in cfg["shapes"]:
        for tokens in cfg["tokens"]:
            fused = 0.04 if tokens <= 64 else 2.0  # fused wins up to 64 tokens on every shape
            for impl, ms in (("fused", fused), ("rotate + bnb", 0.3), ("dequantize + cuBLAS", 0.2), ("policy", 0.25)):
                rows.append({"shape": f"{n}×{k}", "tokens": tokens, "impl": impl, "fwd_ms": ms, "fwd_bwd_ms": ms,
                             "fwd_graph_ms": None})
    result = {"rows": rows, "rotate": {"triton": {"fwd_ms": 0.02, "fwd_bwd_ms": 0.2}}}
    lines = nf4_sweep.verdicts(result, cfg)
    assert "target fused forward, 16 tokens, 4096² ≤ 0.05 ms: met (0.0400 vs 0.0500)" in lines
    assert "target fused forward, 16 tokens, 4096², CUDA graph (GPU time) ≤ 0.05 ms: not measured" in lines
    assert any(line.startswith("target forward, 4096 tokens (policy) ≤ 0.30 ms: met") for line in lines)
    assert any(line.startswith("target block_rotate forward + backward 4096×4096 ≤ 0.15 ms: NOT met") for line in lines)
    assert lines[-1].endswith(": 64")
