"""When one process of a multi-process run fails, the others end with one line pointing at its error instead of
~100 lines of gloo's "Connection closed by peer" tracebacks that buried it (a real 2-process gloo group here)."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import free_port

from peftplug.errors import ConfigError, run_command


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch

    sys.stderr = open(os.path.join(out_dir, f"rank{rank}.err"), "w")  # noqa: SIM115  (closed at exit)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def command(argv):
        if rank == 1:
            raise ConfigError("boom on rank 1")
        dist.barrier()  # rank 1 has failed: rank 0 waits
        dist.all_reduce(torch.ones(1))
        return 0

    status = run_command("peftplug", command, [])
    with open(os.path.join(out_dir, f"rank{rank}.status"), "w") as f:
        f.write(str(status))
    sys.stderr.flush()
    os._exit(0)  # without the group's teardown, which would wait for the peer


def test_the_surviving_rank_prints_one_line(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    assert (tmp_path / "rank1.status").read_text() == "2"
    assert (tmp_path / "rank1.err").read_text().strip() == "peftplug: error: boom on rank 1"
    assert (tmp_path / "rank0.status").read_text() == "1"
    err = (tmp_path / "rank0.err").read_text().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peftplug: error: another process of this run failed"), err


def test_a_runtime_error_of_one_process_is_still_a_traceback():
    def command(argv):
        raise RuntimeError("Connection closed by peer")  # no process group: a bug of this process, not a peer's

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        run_command("peftplug", command, [])
