"""FSDP2 units of a model whose ``_no_split_modules`` names a class nested inside another listed class.

Transformers models may list both a block and a module inside it (Idefics2 lists ``Idefics2MLP``, which sits inside
``Idefics2PerceiverLayer``). ``fully_shard`` must be applied to the inner unit before the outer one; applied outer
first (the order ``modules()`` yields), FSDP2 failed with "TypeError: Invariant encountered: value was None when it
should not be". Checked on the tiny Llama with ``LlamaMLP`` (inside ``LlamaDecoderLayer``) added to the list.
"""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model

from peftplug.sharding import shard_units
from peftplug.tiny import tiny_model


def _nested_llama():
    model = tiny_model("llama")
    model._no_split_modules = ["LlamaDecoderLayer", "LlamaMLP"]  # LlamaMLP is the `mlp` of each decoder layer
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))


def test_nested_units_come_before_the_units_around_them():
    model = _nested_llama()
    units = shard_units(model)
    names = {id(m): name for name, m in model.get_base_model().named_modules()}
    order = [names[id(u)] for u in units]
    assert order == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0", "model.layers.1", ""]
    for i, unit in enumerate(units):
        inside = {id(m) for m in unit.modules()}
        assert not any(id(later) in inside for later in units[i + 1:]), f"{order[i]} holds a later unit"


def test_nested_units_shard_and_compute_the_unsharded_logits(run_fresh):
    """On a one-rank gloo mesh, in a fresh process (a process group started here would outlive the test)."""
    pytest.importorskip("torch.distributed.fsdp")
    out = run_fresh("""
        import copy, tempfile

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from peftplug.sharding import is_sharded, shard_model
        from tests.test_sharding_review3 import _nested_llama

        torch.manual_seed(0)
        model = _nested_llama().eval()
        reference = copy.deepcopy(model)
        ids = torch.randint(3, 100, (2, 7))
        store = tempfile.mkstemp()[1]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            print("UNITS", shard_model(model, init_device_mesh("cpu", (1,))), is_sharded(model))
            with torch.no_grad():
                sharded, plain = model(input_ids=ids).logits, reference(input_ids=ids).logits
            print("EQUAL", torch.equal(sharded, plain))
        finally:
            dist.destroy_process_group()
    """).stdout
    assert "UNITS 5 True" in out, out  # 2 decoder layers, their 2 MLPs, the root
    assert "EQUAL True" in out, out
