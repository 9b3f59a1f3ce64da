"""Zeroth-order steps on FSDP2 shards (DTensors), in this process: a one-rank gloo group, ``fully_shard`` on a
1-device CPU mesh, and the optimizers stepping the sharded parameters directly.

What ``peftplug fit`` relies on under ``ModelParallelStrategy`` with a zeroth-order optimizer (the end-to-end
2-process runs are the slow test in tests/test_sharding_fsdp2.py): parameters stay DTensors laid out as before,
each shard's z is drawn from a generator seeded by (step seed, tensor, shard) — so it is not the unsharded run's
z, which continues one stream per step over whole tensors — and the same seed gives the same run bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from helene import ZOSGD, Helene
from helene.zo import shard_seed
from tests.helene.zo_testing import closure, data, directions, mlp, step_seeds

dist = torch.distributed
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

STEPS = 3
# The recipe's HELENE of tests/test_sharding_fsdp2.py (elementwise A-GNB), the per-tensor estimate (which takes
# the mean over the local shard, the to_local() branch), and plain MeZO.
OPTIMIZERS = {
    "helene": (Helene, {"lr": 1e-3, "eps": 1e-3, "seed": 3, "preconditioner": "hessian"}),
    "helene_agnb_layer": (Helene, {"lr": 1e-3, "eps": 1e-3, "seed": 3, "hessian": "agnb_layer"}),
    "zosgd": (ZOSGD, {"lr": 1e-2, "eps": 1e-3, "seed": 3}),
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A 1-D CPU device mesh over a one-rank gloo group, destroyed after this module's tests."""
    if dist.is_initialized():
        # Not ours to replace or destroy (and its world size may not be 1).
        pytest.skip("a default process group is already initialized")
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh) -> torch.nn.Module:
    """The zo_testing MLP with every parameter-holding layer an FSDP2 unit, laid out like peftplug's
    ``shard_model`` (blocks, then the root); the root itself holds no parameter (see the last test for one that
    does)."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for unit in (model[0], model[2], model[3]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run(model, name, steps=STEPS):
    """``steps`` steps of optimizer ``name`` on ``model``; returns the optimizer and the step losses."""
    cls, kwargs = OPTIMIZERS[name]
    opt = cls(model.parameters(), **kwargs)
    if hasattr(opt, "set_total_steps"):
        opt.set_total_steps(steps)  # as the trainer does: anneal_horizon="auto" then needs no fallback
    x, y = data()
    return opt, [opt.step(closure(model, x, y)).item() for _ in range(steps)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_keep_shards_and_reproduce_bit_for_bit(mesh, name):
    from torch.distributed.tensor import DTensor

    model = _sharded(mesh)
    before = {n: (p.placements, p.shape, p.to_local().clone()) for n, p in model.named_parameters()}
    assert before and all(isinstance(p, DTensor) for p in model.parameters())
    opt, losses = _run(model, name)
    assert torch.isfinite(torch.tensor(losses)).all() and opt.update_count == STEPS
    after = dict(model.named_parameters())
    for n, (placements, shape, local) in before.items():
        assert isinstance(after[n], DTensor), n
        assert after[n].placements == placements and after[n].shape == shape, n
    assert any(not torch.equal(after[n].to_local(), local) for n, (_, _, local) in before.items()), "nothing moved"
    # The momentum (and A-GNB's estimate) of a shard is a shard as well: the update needs no communication.
    if isinstance(opt, Helene):
        assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in model.parameters())

    again = _sharded(mesh)
    _, losses_again = _run(again, name)
    assert losses_again == losses
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), n

    # The unsharded model from the same init and optimizer seed: same step seeds, other directions (one stream
    # over whole tensors), so it goes elsewhere. At world size 1 a shard is its whole tensor: only the seeding
    # can tell the runs apart.
    plain = mlp()
    _run(plain, name)
    assert any(not torch.allclose(p.to_local(), q) for p, q in zip(model.parameters(), plain.parameters()))


def test_each_shard_draws_z_from_step_seed_tensor_and_shard(mesh):
    """HELENE's first momentum is c·z, then β1·m + α_t·c·z: z read back from it against the per-shard draw."""
    model = _sharded(mesh)
    cls, kwargs = OPTIMIZERS["helene"]
    opt = cls(model.parameters(), **kwargs)
    opt.set_total_steps(STEPS)
    x, y = data()
    params = list(model.parameters())
    coordinate = mesh.get_coordinate()
    beta1 = opt.defaults["betas"][0]
    momentum = [torch.zeros_like(p.to_local()) for p in params]
    drawn = []
    for t in range(STEPS):
        opt.step(closure(model, x, y))
        seed = step_seeds(kwargs["seed"], t)[0]
        z = [torch.randn(p.to_local().shape, generator=torch.Generator().manual_seed(shard_seed(seed, i, coordinate)))
             for i, p in enumerate(params)]
        for i, p in enumerate(params):
            expected = momentum[i] * beta1 + opt.alpha(t, beta1) * opt.last_projected_grad * z[i]
            actual = opt.state[p]["exp_avg"].to_local()
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-9)
            momentum[i] = actual.clone()
        # Not the unsharded draw of the same step seed (DDP's z), though equally distributed.
        unsharded = directions(mlp(), seed).values()
        assert all(not torch.allclose(a, b) for a, b in zip(z, unsharded))
        drawn.append(z)
    assert opt.last_projected_grad != 0.0  # else the momentum would not show z at all
    # A new direction every step, and for every tensor (the two 8-element LayerNorm tensors share a shape).
    assert all(not torch.equal(a, b) for a, b in zip(drawn[0], drawn[1]))
    assert not torch.equal(drawn[0][2], drawn[0][3])


def test_shard_seed_depends_on_step_tensor_and_shard():
    """World size 1 has one shard only, so the shard's part of the seed is checked on the function itself."""
    seeds = {shard_seed(7, 0, [0]), shard_seed(8, 0, [0]), shard_seed(7, 1, [0]), shard_seed(7, 0, [1])}
    assert len(seeds) == 4
    assert all(0 <= s < 2**62 for s in seeds)
    assert shard_seed(7, 0, [1]) == shard_seed(7, 0, [1])


def test_every_forward_of_a_step_sees_the_shards_as_they_are_now(mesh):
    """Parameters held by the root unit (embeddings and ``lm_head`` in ``shard_model``'s layout): FSDP2 leaves them
    gathered after a forward, for a backward that a zeroth-order step never runs. Through
    :func:`peftplug.sharding.zeroth_order_loss` (the closure of ``PeftModule``'s zeroth-order step) every forward
    runs on the shards as the previous update left them: the sharded model's loss equals the loss of a plain copy
    of its full tensors after every step."""
    from torch.distributed.fsdp import fully_shard

    from peftplug.sharding import zeroth_order_loss

    model = mlp()
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)  # model[3], a LayerNorm, belongs to the root
    x, y = data()
    loss = closure(model, x, y)
    opt = ZOSGD(model.parameters(), lr=1e-2, eps=1e-3, seed=3)
    start = model[3].weight.to_local().clone()
    for _ in range(STEPS):
        opt.step(lambda: zeroth_order_loss(model, loss))
        plain = mlp()
        plain.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
        assert torch.equal(zeroth_order_loss(model, loss), zeroth_order_loss(plain, closure(plain, x, y)))
    assert not torch.equal(model[3].weight.to_local(), start)  # the root's own parameter was updated
