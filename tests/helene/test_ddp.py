"""Data parallel without Lightning: two gloo processes over half batches equal one process over the batch.

The ranks are given different optimizer seeds, so agreement needs the broadcast step seed (FZOO: its N seeds). The
two processes are forked from a fresh one (tests/gloo_ranks.py)."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import free_port, run_ranks

from helene import FZOO, Helene

WORKER = r'''
import os, torch, torch.distributed as dist
from helene import FZOO, Helene

SPECS = {SPECS_LITERAL}

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))

def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    for name, (cls, kwargs) in SPECS.items():
        model = build()
        # Different optimizer seeds per rank on purpose: the broadcast step seed must make them agree.
        opt = cls(model.parameters(), seed=100 + rank, **kwargs)
        def closure():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)   # only this scalar is communicated
            return loss / world
        losses = [opt.step(closure).item() for _ in range(4)]
        torch.save({"params": [p.detach() for p in model.parameters()], "losses": losses}, f"{out}.{name}.{rank}")
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: there torch 2.13's gloo threads sometimes abort the process
    # ("terminate called without an active exception", SIGABRT) after everything above has finished and been saved.
    os._exit(0)
'''


OPTIMIZERS = {
    "helene": (Helene, {"lr": 1e-2, "eps": 1e-2, "hessian_interval": 2, "anneal_horizon": 10.0}),
    "fzoo": (FZOO, {"lr": 1e-2, "eps": 1e-2, "n_probes": 3}),
}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory, zygote) -> str:
    """Both optimizers trained by one pair of gloo processes; returns the prefix of their
    ``<prefix>.<name>.<rank>`` result files."""
    root = tmp_path_factory.mktemp("gloo")
    specs = ", ".join(f"{name!r}: ({cls.__name__}, {kwargs!r})" for name, (cls, kwargs) in OPTIMIZERS.items())
    run_ranks(zygote, WORKER.replace("{SPECS_LITERAL}", "{" + specs + "}"), (2, free_port(), str(root / "ddp")))
    return str(root / "ddp")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_gloo_processes_equal_one_process(gloo_runs, name):
    cls, kwargs = OPTIMIZERS[name]
    r0, r1 = torch.load(f"{gloo_runs}.{name}.0"), torch.load(f"{gloo_runs}.{name}.1")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    init = [p.detach().clone() for p in model.parameters()]
    opt = cls(model.parameters(), seed=100, **kwargs)
    losses = [opt.step(lambda: torch.nn.functional.cross_entropy(model(x), y)).item() for _ in range(4)]

    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)  # ranks stay bit-identical
    for a, p in zip(r0["params"], model.parameters()):
        torch.testing.assert_close(a, p.detach(), rtol=0, atol=1e-5)
    assert r0["losses"] == r1["losses"]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    # The agreement is not trivial: the distance moved is far larger than the 1e-5 tolerance.
    assert max((a - b).abs().max().item() for a, b in zip(r0["params"], init)) > 1e-3
