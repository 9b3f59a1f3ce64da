"""Gloo ranks for the suite's distributed tests without a fresh import of torch and transformers per rank.

A child of the fork server (tests/fresh_interpreter.py: torch, transformers, PEFT and Lightning already imported,
nothing of this library) imports the test's worker and forks the ranks from there (``start_method="fork"``). Spawned
ranks, or a ``python worker.py`` subprocess spawning them, paid 10–13 s of imports each on CI's 2 cores, about two
thirds of every such test. Forking pytest's own process instead is not safe: earlier tests have run torch there, and
a forked copy of a started OpenMP thread pool can hang. The zygote child has run no torch computation before it
forks, and each rank still starts its own process group, so what the ranks compute is what spawned ranks computed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_LAUNCH = '''
import torch.multiprocessing as _mp
_mp.start_processes(worker, args={args!r}, nprocs={nprocs}, join=True, start_method="fork")
'''


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the ranks' ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    """The environment ``torchrun`` gives one rank on one node (Lightning then sees the ranks launched and starts
    none itself).

    Args:
        rank: This rank.
        port: The ranks' ``MASTER_PORT``.
        world: Number of ranks.
    """
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "NODE_RANK": "0"}


def run_ranks(zygote: Callable, worker: Callable | str, args: tuple, nprocs: int = 2,
              timeout: int = 240) -> subprocess.CompletedProcess:
    """Runs ``worker(rank, *args)`` in ``nprocs`` ranks forked from one fresh process; fails with the ranks' output
    if any rank fails, else returns the process (``stdout``/``stderr``: what the ranks printed, together).

    Args:
        zygote: The session's ``zygote`` fixture (tests/conftest.py).
        worker: A module-level function of a test module (the fresh process imports it by name), or Python source
            that defines a function ``worker``.
        args: The arguments after the rank: literals (their ``repr`` is the source that rebuilds them).
        nprocs: Number of ranks.
        timeout: Seconds before the fresh process is killed.
    """
    if callable(worker):
        module = sys.modules[worker.__module__]
        # Test folders have no __init__.py: pytest imports each test module by its file name, from its folder, and
        # the suite's helpers (this file) from tests/.
        folders = list(dict.fromkeys([str(Path(module.__file__).parent), str(Path(__file__).parent)]))
        source = (f"import sys\nsys.path[:0] = {folders!r}\n"
                  f"from {module.__name__} import {worker.__name__} as worker\n")
    else:
        source = worker
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = zygote().run(source + _LAUNCH.format(args=tuple(args), nprocs=nprocs), [], env, REPO, timeout)
    assert proc.returncode == 0, f"gloo ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc
