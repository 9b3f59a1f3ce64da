"""Where a number came from: the commit, the threads, the CPU's flags, the process's peak memory and load."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from pathlib import Path

from benchmarks.common.paths import REPO

#: The CPU flags that change what a CPU timing means here (bf16 matmuls are ~5x slower without AVX512-BF16, and
#: bitsandbytes 0.50 repacks 4-bit weights only with it).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def git_commit(paths: tuple[str, ...] = ("benchmarks", "peftplug"), root: Path = REPO) -> str:
    """``HEAD``'s short hash, with ``+dirty`` when ``paths`` have uncommitted changes (results excluded).

    Args:
        paths: The code a run depends on. Committed results (``benchmarks/*/results``) never count: runs in flight
            write them, and would otherwise mark each other dirty.
        root: The checkout (default: this one; another for an A/B of two trees).
    """
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths,
                                ":(exclude,glob)benchmarks/**/results/**"], cwd=root, capture_output=True,
                               text=True, check=False).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def cpu_flags() -> list[str]:
    """Which of :data:`CPU_FLAGS` this machine's CPU has (empty where ``/proc/cpuinfo`` is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return []


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float | None:
    """This process's resident set now (``VmRSS``) in MiB, beside the peak that loading transients may set; ``None``
    where ``/proc/self/status`` is not readable."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere, often empty on Linux), or ``"?"``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def provenance(paths: tuple[str, ...] = ("benchmarks", "peftplug")) -> dict:
    """Everything a result file should say about where it was measured.

    Args:
        paths: The code the measurement depends on (see :func:`git_commit`).
    """
    import torch

    return {"commit": git_commit(paths), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "cpu_flags": cpu_flags(), "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "peak_rss_mib": peak_rss_mib(), "loadavg": list(os.getloadavg())}


def provenance_line(prov: dict) -> str:
    """One sentence for a page: where and how the numbers of a result file were measured.

    Args:
        prov: A :func:`provenance` record.
    """
    flags = ", ".join(prov.get("cpu_flags") or []) or "none of " + ", ".join(CPU_FLAGS)
    where = f"GPU {prov['cuda']}, " if prov.get("cuda") else ""
    where += f"CPU {prov['cpu']}, " if prov.get("cpu") not in (None, "", "?") else ""
    return (f"Measured at commit `{prov.get('commit', '?')}` on {prov.get('date', '?')}: {where}torch "
            f"{prov.get('torch', '?')}, {prov.get('threads', '?')} thread(s), CPU flags {flags}, peak RSS "
            f"{prov.get('peak_rss_mib', float('nan')):.0f} MiB.")


def device_environment(device: str) -> dict:
    """The machine behind a GPU number: compute capability, GPU memory, torch's CUDA runtime and the driver.

    Every GPU result file records it (a timing means little without them, and the GPU machine's image may change).
    On a CPU only ``cuda`` (torch's build) is known; the others are ``None``.

    Args:
        device: ``cuda`` or ``cpu``.
    """
    import torch

    env = {"cuda": torch.version.cuda, "driver": None, "capability": None, "gpu_memory_gib": None}
    if device != "cuda":
        return env
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    env.update(capability=f"sm_{props.major}{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1))
    try:  # torch does not expose the driver's version; nvidia-smi ships with the driver
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        env["driver"] = out.splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return env


def run_provenance(device: str) -> dict:
    """Date and commit of a run (``PEFTPLUG_COMMIT`` names it where the copy has no ``.git``) plus
    :func:`device_environment`.

    Args:
        device: ``cuda`` or ``cpu``.
    """
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("PEFTPLUG_COMMIT") or git_commit(), **device_environment(device)}
