#!/usr/bin/env python3
"""Runs peftplug's PEFT-integration tests against several PEFT / transformers releases, one throwaway venv each.

pyproject declares ``peft>=0.16,<0.22`` and ``transformers>=4.50,<6`` while ``make test`` runs one set (the main
``.venv``). This script builds a venv per matrix row under ``.venv-compat/<row>`` (reused when its stamp matches the
row's pins), installs torch first from the pinned wheel (``torch==2.13.0``, then a constraint on the exact installed
build, so pip can never resolve an unpinned multi-GB CUDA torch), then the row's explicit dependency set, then
peftplug itself with ``pip install -e . --no-deps``. It runs the PEFT-integration subset of the suite offline in
each and prints one table row per venv. Exit status 1 if any row failed to install or had a failing test.

It uses the standard library only, so any Python 3.10+ can run it (``make test-peft-versions`` uses ``python3``).
docs/compatibility.md has the matrix as last run and the recommended range.

Usage:
    python3 scripts/test_peft_versions.py                  # the default rows (the range's two ends)
    python3 scripts/test_peft_versions.py --rows all       # every row
    python3 scripts/test_peft_versions.py --rows peft0.16.0-tf4.57.6,peft0.21.2-tf5.24.0 --rebuild
    python3 scripts/test_peft_versions.py --list
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"

# Pins shared by every row: not what is under test, so they stay at the main venv's versions where those install
# beside every row's huggingface_hub.
COMMON_PINS = (
    "lightning==2.6.6",
    "jsonargparse[signatures]==4.53.0",
    "bitsandbytes==0.50.2",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "numpy==2.4.6",
    "rich==15.0.0",
    "pytest==9.2.0",
    "accelerate==1.15.0",
    "trl==1.16.0",
)
# transformers 4.57 (the newest 4.x) needs huggingface_hub < 1.0 and tokenizers <= 0.23.0; datasets 5.0.1 is the
# newest that accepts that hub. Hugging Face's `kernels` 0.17 needs hub >= 1, so it is left out of these rows.
TF4_PINS = ("transformers==4.57.6", "tokenizers==0.22.2", "huggingface_hub==0.36.2", "datasets==5.0.1")
# The main .venv's set (make install), with Hugging Face's `kernels` as the dev extra installs it.
TF5_PINS = ("transformers==5.24.0", "tokenizers==0.23.3", "huggingface_hub==2.4.0", "datasets==5.2.0",
            "kernels==0.17.2")


@dataclass(frozen=True)
class Row:
    """One matrix row: a name (also the venv folder's) and the pins installed on top of torch.

    Args:
        name: Row and venv folder name.
        pins: Requirement strings passed to pip together with :data:`COMMON_PINS`.
        why: One line on what the row checks.
    """

    name: str
    pins: tuple[str, ...]
    why: str

    def requirements(self) -> list[str]:
        return [*self.pins, *COMMON_PINS]

    def stamp(self) -> str:
        """A digest of everything that decides the venv's contents (a changed pin rebuilds it)."""
        text = json.dumps([TORCH_SPEC, self.requirements(), sys.version_info[:2]])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


ROWS = (
    Row("peft0.16.0-tf4.57.6", ("peft==0.16.0", *TF4_PINS),
        "oldest allowed PEFT; PEFT 0.16/0.17 import transformers.HybridCache, which transformers 5 removed"),
    Row("peft0.17.1-tf4.57.6", ("peft==0.17.1", *TF4_PINS), "newest 0.17.x (also needs transformers 4)"),
    Row("peft0.18.1-tf5.24.0", ("peft==0.18.1", *TF5_PINS), "oldest PEFT that imports with transformers 5"),
    Row("peft0.19.1-tf5.24.0", ("peft==0.19.1", *TF5_PINS), "newest 0.19.x"),
    Row("peft0.20.0-tf5.24.0", ("peft==0.20.0", *TF5_PINS), "newest 0.20.x"),
    Row("peft0.21.2-tf4.57.6", ("peft==0.21.2", *TF4_PINS),
        "newest PEFT on transformers 4: tells a transformers-4 failure from an old-PEFT one"),
    Row("peft0.21.2-tf5.0.0", ("peft==0.21.2", "transformers==5.0.0", "tokenizers==0.22.2",
                               "huggingface_hub==1.33.0", "datasets==5.2.0"),
        "newest PEFT on the first transformers 5 release (no `kernels`: 0.17 breaks transformers 5.0's import)"),
    Row("peft0.21.2-tf5.24.0", ("peft==0.21.2", *TF5_PINS), "newest allowed PEFT: the main .venv's set (CI)"),
)
# The declared range's two ends (pyproject.toml: peft>=0.21,<0.22, transformers>=5.0,<6); the other rows are the
# evidence for that range (docs/compatibility.md) and run with --rows all.
DEFAULT_ROWS = ("peft0.21.2-tf5.0.0", "peft0.21.2-tf5.24.0")

# The PEFT-integration subset: registration and PEFT's user API (minimal tuner), each method's PeftConfig / tuner /
# save-load / interop with PEFT's own formats, QOFT's bnb dispatch, the Lightning module's PEFT wrapping, and the
# TRL tests where they exist. About a minute on 2 cores.
TEST_PATHS = (
    "tests/test_registry.py",
    "tests/oftv2/test_oftv2_config.py",
    "tests/oftv2/test_oftv2_layer.py",
    "tests/oftv2/test_oftv2_embedding.py",
    "tests/oftv2/test_oftv2_conv2d.py",
    "tests/oftv2/test_oftv2_save_load.py",
    "tests/oftv2/test_oftv2_interop.py",
    "tests/oftv2/test_oftv2_adapter_state.py",
    "tests/oftv2_bnb/test_qoft_layers.py",
    "tests/steering/test_steering_applier.py",
    "tests/steering/test_steering_io.py",
    "tests/steering/test_steering_generators.py",
    "tests/prompt_transfer/test_pct_peft.py",
    "tests/prompt_transfer/test_pct_export.py",
    "tests/test_peftplug_lightning.py",
)
# TRL tests are picked up wherever they land (a tests/trl/ folder or tests/**/test_*trl*.py).
TRL_GLOBS = ("tests/trl", "tests/**/test_*trl*.py", "tests/test_*trl*.py")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
REPORTED = ("peft", "transformers", "torch", "trl", "huggingface_hub", "accelerate", "datasets", "lightning",
            "bitsandbytes")


@dataclass
class Result:
    """What one row produced.

    Args:
        row: The row's name.
        status: ``"ok"``, ``"failed"`` (tests failed), ``"install failed"`` or ``"timeout"``.
    """

    row: str
    status: str = "ok"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def select_rows(spec: str) -> list[Row]:
    """Rows named by ``--rows``: ``default``, ``all`` or a comma-separated list of row names.

    Raises:
        ValueError: If a name is not a row (the message lists the rows).
    """
    by_name = {row.name: row for row in ROWS}
    if spec == "all":
        return list(ROWS)
    names = DEFAULT_ROWS if spec == "default" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"--rows: unknown row(s) {unknown or [spec]}; accepted: default, all, or names from "
                         f"{sorted(by_name)}")
    return [by_name[n] for n in names]


def test_paths() -> tuple[list[str], list[str]]:
    """The subset's paths that exist in this checkout, and those that do not (reported, not an error)."""
    present = [p for p in TEST_PATHS if (REPO_ROOT / p).exists()]
    missing = [p for p in TEST_PATHS if not (REPO_ROOT / p).exists()]
    for pattern in TRL_GLOBS:
        for path in sorted(REPO_ROOT.glob(pattern)):
            rel = str(path.relative_to(REPO_ROOT))
            if rel not in present and not any(rel.startswith(p + "/") for p in present):
                present.append(rel)
    return present, missing


def run(cmd: list[str], log_file: Path, timeout: float, env: dict | None = None) -> int:
    """Runs ``cmd`` in the repository root, appending its output to ``log_file``; returns the exit status."""
    with log_file.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=env, check=False).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[timed out after {timeout:.0f} s]\n")
            return 124


def tail(path: Path, lines: int = 8) -> list[str]:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in text if line.strip()][-lines:]


def ensure_venv(row: Row, root: Path, python: str, rebuild: bool, timeout: float) -> tuple[Path, str | None]:
    """Creates (or reuses) the row's venv; returns its python and ``None``, or an error line when pip failed."""
    venv = root / row.name
    py = venv / "bin" / "python"
    stamp = venv / ".peftplug-compat-stamp"
    if not rebuild and stamp.is_file() and stamp.read_text().strip() == row.stamp() and py.exists():
        log(f"{row.name}: reusing {venv.relative_to(REPO_ROOT) if venv.is_relative_to(REPO_ROOT) else venv}")
        return py, None
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    install_log = venv.parent / f"{row.name}.install.log"
    install_log.write_text("")
    log(f"{row.name}: creating the venv (pip output in {install_log})")
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        # torch first, pinned (the local CPU wheel where pip's find-links has one).
        [str(py), "-m", "pip", "install", "-q", TORCH_SPEC],
    ]
    for cmd in steps:
        if run(cmd, install_log, timeout) != 0:
            return py, f"`{' '.join(cmd[-3:])}` failed: " + " | ".join(tail(install_log, 3))
    torch_version = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True, check=False).stdout.strip()
    if not torch_version:
        return py, "torch does not import after its install: " + " | ".join(tail(install_log, 3))
    constraints = venv / "constraints.txt"
    # The exact installed build (e.g. 2.13.0+cpu), so no later requirement can swap torch for another build.
    constraints.write_text(f"torch=={torch_version}\n")
    steps = [
        [str(py), "-m", "pip", "install", "-q", "-c", str(constraints), *row.requirements()],
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "-c", str(constraints), "-e", "."],
    ]
    for cmd in steps:
        if run(cmd, install_log, timeout) != 0:
            return py, "pip install failed: " + " | ".join(tail(install_log, 3))
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=False).stdout
    (venv / "freeze.txt").write_text(freeze)
    stamp.write_text(row.stamp() + "\n")
    return py, None


def installed_versions(py: Path) -> dict[str, str]:
    """The reported distributions' versions in the venv (``-`` where absent)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    try: out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: out[name] = '-'\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([str(py), "-c", code, *REPORTED], capture_output=True, text=True, check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def parse_junit(path: Path) -> tuple[int, int, int, list[str]]:
    """Counts (passed, failed incl. errors, skipped) and one line per failure from a pytest junit file."""
    suite = ET.parse(path).getroot()
    passed = failed = skipped = 0
    failures: list[str] = []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failed += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{name}: {message[0][:240] if message else '(no message)'}")
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped, failures


def run_tests(row: Row, py: Path, root: Path, paths: list[str], timeout: float, extra: list[str]) -> Result:
    """Runs the subset in the row's venv and reads its junit report."""
    result = Result(row.name, versions=installed_versions(py))
    junit = root / f"{row.name}.junit.xml"
    test_log = root / f"{row.name}.pytest.log"
    junit.unlink(missing_ok=True)
    test_log.write_text("")
    env = {**os.environ, **OFFLINE}
    env.pop("PYTHONPATH", None)  # the venv's editable install, not whatever the caller had on its path
    log(f"{row.name}: peft {result.versions.get('peft')} transformers {result.versions.get('transformers')}: "
        f"running {len(paths)} test files (log {test_log})")
    start = time.monotonic()
    # A module that fails to import under an old release must not hide what the other modules show.
    code = run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                f"--junitxml={junit}", *extra, *paths], test_log, timeout, env)
    result.seconds = time.monotonic() - start
    if junit.is_file():
        result.passed, result.failed, result.skipped, result.failures = parse_junit(junit)
    if code == 124:
        result.status = "timeout"
    elif code != 0 or result.failed or not result.passed:
        result.status = "failed"
        if not result.failures:
            result.failures = [f"pytest exit {code}: " + " | ".join(tail(test_log, 3))]
    return result


def table(results: list[Result]) -> str:
    """A Markdown table, one row per venv, and each row's failures below it."""
    head = ("| row | peft | transformers | huggingface_hub | torch | trl | passed | failed | skipped | s | status |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        v = r.versions
        lines.append(f"| {r.row} | {v.get('peft', '?')} | {v.get('transformers', '?')} | "
                     f"{v.get('huggingface_hub', '?')} | {v.get('torch', '?')} | {v.get('trl', '?')} | {r.passed} | "
                     f"{r.failed} | {r.skipped} | {r.seconds:.0f} | {r.status} |")
    for r in results:
        for failure in r.failures:
            lines.append(f"- {r.row}: {failure}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=os.environ.get("PEFT_ROWS", "default"),
                        help="default (the range's ends), all, or comma-separated row names (see --list)")
    parser.add_argument("--venv-root", type=Path, default=REPO_ROOT / ".venv-compat",
                        help="where the throwaway venvs live (git-ignored); default .venv-compat")
    parser.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                        help="interpreter the venvs are created from (3.11+: TRL 1.x needs it)")
    parser.add_argument("--rebuild", action="store_true", help="recreate the selected venvs")
    parser.add_argument("--install-only", action="store_true", help="build the venvs, run no test")
    parser.add_argument("--install-timeout", type=float, default=1800.0, help="seconds per pip step")
    parser.add_argument("--test-timeout", type=float, default=1200.0, help="seconds per row's pytest run")
    parser.add_argument("--list", action="store_true", help="print the rows and the test subset, then exit")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    try:
        rows = select_rows(args.rows)
    except ValueError as err:
        parser.error(str(err))
    paths, missing = test_paths()
    if args.list:
        for row in ROWS:
            mark = "*" if row.name in DEFAULT_ROWS else " "
            print(f"{mark} {row.name:22s} {' '.join(row.pins)}\n  {'':22s} {row.why}")
        print(f"common pins: {' '.join(COMMON_PINS)}\ntests: {' '.join(paths)}")
        return 0
    if missing:
        log(f"not in this checkout, left out: {', '.join(missing)}")
    root = args.venv_root.resolve()
    results: list[Result] = []
    for row in rows:
        py, error = ensure_venv(row, root, args.python, args.rebuild, args.install_timeout)
        if error:
            log(f"{row.name}: {error}")
            results.append(Result(row.name, status="install failed", failures=[error]))
            continue
        if args.install_only:
            results.append(Result(row.name, status="installed", versions=installed_versions(py)))
            continue
        result = run_tests(row, py, root, paths, args.test_timeout, args.pytest_args)
        log(f"{row.name}: {result.status} ({result.passed} passed, {result.failed} failed, {result.skipped} "
            f"skipped, {result.seconds:.0f} s)")
        results.append(result)
    report = table(results)
    (root / "results.md").write_text(report + "\n")
    (root / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1) + "\n")
    print("\n" + report)
    return 0 if all(r.status in ("ok", "installed") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
