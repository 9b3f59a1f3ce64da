"""Third review of the prepared GPU run (benchmarks/gpu/run_all.sh), for what only a CUDA machine would have shown:
the CUDA test phase must not collect tests that need the CPU interpreter (nf4_sweep's dry runs launched compiled
kernels on host tensors and left TRITON_INTERPRET=1 set for the rest of the session), its Lightning fits must come
before the time limit's SIGINT (Lightning ignores SIGINT for good once it caught one, so pytest ran on until KILLed
and printed no summary), and the log must say when a phase was KILLed rather than cut."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run_all.sh"


def _cuda_test_args() -> tuple[list[str], str]:
    """The test folders and the ``-k`` expression of run_all.sh's CUDA test phase."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "-m pytest" in line and not line.lstrip().startswith("#"))
    words = shlex.split(line.split("-m pytest", 1)[1].split("2>&1")[0])
    folders = [w for w in words if w.startswith("tests/")]
    return folders, words[words.index("-k") + 1]


def _test_function_source(node_id: str) -> str:
    path, _, name = node_id.partition("::")
    tree = ast.parse((REPO / path).read_text())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name.split("[")[0])
    return ast.get_source_segment((REPO / path).read_text(), func)


def test_the_cuda_phase_collects_no_test_that_runs_a_cpu_dry_run(run_fresh):
    folders, expression = _cuda_test_args()
    # pytest's own collection of that phase, in a fresh process (a child of the fork server: collecting imports
    # nothing that depends on which third-party package came first, and it skips the 10-13 s of a new interpreter).
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", *folders, "-k", expression]
    proc = run_fresh(f"import sys\nimport pytest\nsys.exit(pytest.main({args!r}))\n", timeout=300, check=False)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert proc.returncode == 0 and len(ids) > 100, proc.stdout[-2000:] + proc.stderr[-2000:]
    dry = [node for node in ids if '"--dry-run"' in _test_function_source(node)]
    assert dry == [], dry


def test_the_cuda_phase_runs_its_lightning_fits_before_the_time_limit_can_land_in_one():
    folders, _ = _cuda_test_args()
    assert sorted(folders) == ["tests/kernels", "tests/oftv2_bnb"]
    uses_lightning = [path.relative_to(REPO).as_posix() for folder in folders for path in (REPO / folder).glob("test_*.py")
                      if re.search(r"^\s*(import lightning|L = pytest.importorskip\(\"lightning\"\)|from peftplug.lightning)",
                                   path.read_text(), re.MULTILINE)]
    assert uses_lightning, "no Lightning test found: the check would say nothing"
    assert all(path.startswith(folders[0] + "/") for path in uses_lightning), (folders, uses_lightning)


def test_the_nf4_sweep_dry_run_refuses_a_process_with_compiled_kernels(tmp_path):
    pytest.importorskip("triton")
    code = (
        "import os, sys\n"
        "from peftplug_kernels._triton_available import load_kernel_module\n"
        "load_kernel_module('block_rotate'); load_kernel_module('nf4_rotate_matmul')\n"
        "from benchmarks.kernels import nf4_sweep\n"
        "try:\n"
        f"    nf4_sweep.main(['--dry-run', '--out', {str(tmp_path)!r}])\n"
        "except SystemExit as err:\n"
        "    print('EXIT', err)\n"
        "except Exception as err:\n"
        "    print('RAISED', type(err).__name__, err)\n"
        "print('INTERPRET', os.environ.get('TRITON_INTERPRET'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("EXIT --dry-run: peftplug_kernels.block_rotate.triton was already imported compiled")
               for line in lines), proc.stdout + proc.stderr[-2000:]
    assert "INTERPRET None" in lines  # nothing left set for later tests and subprocesses
    assert not (tmp_path / "nf4_sweep.json").exists()


@pytest.mark.parametrize(("status", "note"), [(0, ""), (1, ""), (124, " (cut by its time limit)"),
                                              (137, " (killed: it outlived its time limit by 5 s, or ran out of memory)")])
def test_the_log_says_how_a_phase_ended(tmp_path, status, note):
    text = SCRIPT.read_text()
    function = re.search(r"^phase_done\(\) \{\n.*?^\}\n", text, re.MULTILINE | re.DOTALL).group(0)
    log = tmp_path / "run_all.log"
    script = f'LOG={shlex.quote(str(log))}\n{function}phase_done kernel_tests {status} "$SECONDS"\n'
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True, timeout=30)
    assert log.read_text() == f"phase kernel_tests: exit {status}{note}, 0 s\n"
