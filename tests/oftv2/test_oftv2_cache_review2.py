"""Second review of OFTv2's eval rotation cache (oftv2/rotation_cache.py): ways a cached rotation could outlive the
parameters it was computed from. Every cached output is compared with the same model computed fresh (unsharded copy,
autograd on: no cache)."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from oftv2_helpers import randomize_q

import oftv2
from oftv2 import rotation_cache, stacking

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _fresh(model, tokens):
    """Logits with autograd on (the per-forward series, no cache), detached."""
    with torch.enable_grad():
        return model(tokens).logits.detach()


def test_fsdp2_writes_to_the_shards_are_seen_by_eval_forwards(tmp_path, tiny_model, tokens):
    # A zeroth-order optimizer under FSDP2 (HELENE with strategy fsdp) evaluates the model in eval mode without
    # autograd and perturbs the sharded parameters in place between forwards. FSDP2 gathers them into the same
    # unsharded tensor every forward (its version never moves) and frees that memory after the forward, so the next
    # gather can land at the old address: the cache must not be used there, or a forward reuses the rotation of
    # the previous perturbation. (Observed before the fix: outputs off by ~2e-3 from the second perturbation on.)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2),
                                    oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"]))
        randomize_q(model, std=0.05, seed=1)
        reference = copy.deepcopy(model).eval()  # unsharded, evaluated with autograd on: never cached
        inner = model.get_base_model()
        for block in inner.model.layers:
            fully_shard(block)
        fully_shard(inner)
        model.eval()
        shards = [p for n, p in model.named_parameters() if "oftv2_Q" in n]
        plain = [p for n, p in reference.named_parameters() if "oftv2_Q" in n]
        assert shards and type(shards[0]).__name__ == "DTensor"
        # +δ, −δ, +δ ... as a two-point estimate perturbs and restores, each followed by an eval forward.
        for delta in (0.0, 0.05, -0.05, 0.05, -0.05, 0.05):
            with torch.no_grad():
                for p in shards + plain:
                    p.add_(delta)
                out = model(tokens).logits
            torch.testing.assert_close(out, _fresh(reference, tokens), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, d=delta: f"after adding {d}: {m}")
        # (What made the outputs stale: entries keyed on a gathered tensor; none is kept now.)
        assert not any(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in stacking.oftv2_layers(model))
    finally:
        dist.destroy_process_group()


def test_unsharded_model_still_caches(tiny_model, tokens):
    # The FSDP guard reads a flag only FSDP sets: a plain model keeps its cache (and its outputs).
    model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2),
                                oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"]))
    randomize_q(model, std=0.05, seed=1)
    model.eval()
    with torch.no_grad():
        out = model(tokens).logits
    torch.testing.assert_close(out, _fresh(model, tokens), rtol=1e-5, atol=1e-6)
    assert all(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in stacking.oftv2_layers(model))
