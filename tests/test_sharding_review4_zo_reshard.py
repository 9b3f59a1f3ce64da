"""A zeroth-order forward under FSDP2 after a forward without a backward (a validation pass) must see the shards.

FSDP2 leaves the root unit gathered after a forward, for the backward that would reshard it. A validation pass (the
sanity check, ``val_check_interval``) is such a forward; the zeroth-order step that follows perturbs the shards in
place, and its first forward used to run on the root's stale gathered copies: the perturbation of every tensor the
root holds (steering vectors, ``lm_head``, embeddings) was missing from L+, and the step's projected gradient was
wrong after every validation (3 ZOSGD steps of a steering vector on 2 ranks, validating after each: the vectors
ended 0.08 away from the run without validation, whose largest entry was 0.13; under DDP the two runs are equal).
:func:`peftplug.sharding.zeroth_order_loss` now reshards every unit before its forward too.

Two gloo processes (one rank gathers nothing stale: its "gathered" parameters are its shards), forked from a fresh
process (tests/gloo_ranks.py).
"""

from __future__ import annotations

import pytest
from gloo_ranks import free_port, run_ranks

pytest.importorskip("torch.distributed.fsdp")

WORKER = r'''
import copy, os
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from peft import get_peft_model
from steering import SteeringConfig  # registers the STEERING adapter type
from peftplug.sharding import shard_model, zeroth_order_loss
from peftplug.tiny import tiny_model

def worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM")).eval()
    reference = copy.deepcopy(model)
    shard_model(model, init_device_mesh("cpu", (world,)))
    # What an optimizer holds: the sharded DTensors (while the root is gathered, its modules show other tensors).
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(rank))
    loss = lambda m: (lambda: m(input_ids=ids, labels=ids).loss)
    with torch.no_grad():
        model(input_ids=ids)  # a validation forward: no backward reshards the root
        for p in trainable:  # a zeroth-order perturbation: the shards change in place
            p.to_local().add_(0.5)
        for p in reference.parameters():
            if p.requires_grad:
                p.add_(0.5)
        expected = reference(input_ids=ids, labels=ids).loss.float()
    first = zeroth_order_loss(model, loss(model))
    again = zeroth_order_loss(model, loss(model))
    torch.save({"first": first, "again": again, "expected": expected}, f"{out}.{rank}")
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo threads may abort the interpreter's teardown (tests/helene/test_ddp.py)
'''


def test_zeroth_order_forward_after_a_validation_forward_sees_the_perturbed_shards(tmp_path, zygote):
    import torch

    run_ranks(zygote, WORKER, (2, free_port(), str(tmp_path / "out")))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"out.{rank}")
        # The unsharded model with the same perturbation: what the first forward must compute (before the fix it
        # computed the unperturbed steering vectors' loss).
        torch.testing.assert_close(result["first"], result["expected"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["again"], result["expected"], rtol=1e-5, atol=1e-6)
