"""oftv2.stack_rotations: one batched series per model forward gives the per-layer results (loss, gradients,
generation, block dropout, several adapters), runs only where it may (not under gradient checkpointing, not for
forms it has no program for), and leaves nothing behind (hooks removable, cache dropped even when the forward
raises)."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from oftv2_helpers import MixedLayers, randomize_q
from torch import nn

import oftv2
from oftv2 import rotation_cache, stacking
from peftplug_kernels import ops


@pytest.fixture
def calls(monkeypatch):
    """Counts the batched series (``stacked``) and the per-layer series + rotation ops (``per_layer``) called."""
    counts = {"stacked": 0, "per_layer": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(stacking, "stacked_rotations", counted(stacking.stacked_rotations, "stacked"))
    monkeypatch.setattr(ops, "cayley_rotate", counted(ops.cayley_rotate, "per_layer"))
    return counts


def _llama_pair(tiny_model, config, seed=0):
    """The same OFTv2 tiny Llama twice (random rotations, training mode); the second one stacked."""
    model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2), config)
    randomize_q(model, std=0.05, seed=seed)
    model.train()
    stacked = copy.deepcopy(model)
    handle = oftv2.stack_rotations(stacked)
    return model, stacked, handle


def _loss_and_grads(model, tokens, seed=0):
    torch.manual_seed(seed)  # block dropout draws its masks from the global generator
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same_step(plain, stacked, tokens, seed=0):
    loss, grads = _loss_and_grads(plain, tokens, seed)
    loss_s, grads_s = _loss_and_grads(stacked, tokens, seed)
    torch.testing.assert_close(loss_s, loss, rtol=1e-6, atol=1e-6)
    assert grads and grads.keys() == grads_s.keys()
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_s[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_llama_all_linear_equals_per_layer_with_one_batch_per_block_size(tiny_model, tokens, calls, dropout):
    # r=8: block 8 on the 64-wide inputs, 16 on down_proj's 128: two groups, so two batched series per forward.
    config = oftv2.OFTv2Config(r=8, target_modules="all-linear", module_dropout=dropout)
    plain, stacked, _ = _llama_pair(tiny_model, config)
    _assert_same_step(plain, stacked, tokens)
    per_layer_calls = calls["per_layer"]
    assert per_layer_calls == 14  # the plain model: 7 linears × 2 decoder layers
    _loss_and_grads(stacked, tokens)
    assert calls == {"stacked": 4, "per_layer": per_layer_calls}  # 2 groups × 2 forwards, no per-layer series
    assert all(stacking.STACKED_ATTR not in layer.__dict__ for layer in stacking.oftv2_layers(stacked))


def test_several_active_adapters_compose_in_order(tiny_model, tokens, calls):
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "down_proj"])
    plain = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2), config)
    plain.add_adapter("second", oftv2.OFTv2Config(r=4, target_modules=["q_proj", "down_proj"]))
    plain.base_model.set_adapter(["default", "second"])
    randomize_q(plain, std=0.05, seed=3)
    stacked = copy.deepcopy(plain)
    oftv2.stack_rotations(stacked)
    # With autograd on: in eval mode without it the hook steps aside for each layer's cached blocks.
    torch.testing.assert_close(stacked(tokens).logits, plain(tokens).logits, rtol=1e-5, atol=1e-6)
    # Three groups: blocks of 8 (the first adapter, both layers), 16 (the second on q_proj), 32 (the second on
    # down_proj).
    assert calls["stacked"] == 3


def test_linear_conv_embedding_and_ineligible_forms(calls):
    """Embedding, Conv2d (input evaluation; weight evaluation computes its own blocks) and Linear; the exact Cayley
    form and a shared block with dropout keep their per-layer path inside a stacked model."""
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(1))
    for conv_evaluation in ("input", "weight"):
        plain = peft.get_peft_model(MixedLayers(), oftv2.OFTv2Config(
            block_size=4, target_modules=["embed", "conv", "proj"], conv_evaluation=conv_evaluation))
        randomize_q(plain, std=0.05)
        stacked = copy.deepcopy(plain)
        oftv2.stack_rotations(stacked)
        before = calls["stacked"]
        for model in (plain, stacked):
            model(ids).square().mean().backward()
        assert calls["stacked"] == before + 1  # one group (block 4) for the stacked model's forward
        for (name, p), q in zip(plain.named_parameters(), stacked.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for config in (oftv2.OFTv2Config(block_size=4, target_modules=["0", "1"], orthogonalization="cayley"),
                   oftv2.OFTv2Config(block_size=4, target_modules=["0", "1"], block_share=True, module_dropout=0.5)):
        model = peft.get_peft_model(copy.deepcopy(layer), config).train()
        assert not any(stacking.eligible(m, "default") for m in stacking.oftv2_layers(model))
        oftv2.stack_rotations(model)
        before = dict(calls)
        model(torch.randn(3, 8)).sum().backward()
        assert calls["stacked"] == before["stacked"]


def test_generate_through_the_peft_model_is_unchanged(tiny_model, tokens, calls):
    config = oftv2.OFTv2Config(block_size=8, target_modules="all-linear")
    plain, stacked, _ = _llama_pair(tiny_model, config)
    plain.eval()
    stacked.eval()
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(stacked.generate(input_ids=tokens, **kwargs), plain.generate(input_ids=tokens, **kwargs))
    # generate runs in eval mode without autograd: every layer computes its blocks once (oftv2.rotation_cache) and
    # the hook computes no batched series per token.
    assert calls["stacked"] == 0
    assert all(rotation_cache.CACHE_ATTR in layer.__dict__ for layer in stacking.oftv2_layers(stacked))


def test_gradient_checkpointing_turns_stacking_off(tiny_model, tokens, calls):
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"])
    plain, stacked, handle = _llama_pair(tiny_model, config)
    for model in (plain, stacked):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not handle.active()
    _assert_same_step(plain, stacked, tokens)
    assert calls["stacked"] == 0
    stacked.gradient_checkpointing_disable()
    assert handle.active()


def _checkpoint_decoder_layers(model, reentrant):
    """Wraps each decoder layer's forward in ``torch.utils.checkpoint`` by hand (as ``checkpoint_wrapper`` does),
    which transformers' ``gradient_checkpointing`` flag does not show."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for layer in model.get_base_model().model.layers:
        def forward(hidden_states, _inner=layer.forward, **kwargs):
            return checkpoint(functools.partial(_inner, **kwargs), hidden_states, use_reentrant=reentrant)
        layer.forward = forward
    model.enable_input_require_grads()  # (a reentrant checkpoint needs an input that requires grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hand_placed_activation_checkpoints_give_the_per_layer_gradients(tiny_model, tokens, reentrant):
    # The recomputation in backward comes after the hook dropped the stacked blocks, so the layers inside a
    # checkpointed region compute their own series in the first forward too. Before, a non-reentrant checkpoint
    # stopped with "Recomputed values ... different metadata" (the first forward had only rotated).
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"])
    plain, stacked, handle = _llama_pair(tiny_model, config)
    for model in (plain, stacked):
        _checkpoint_decoder_layers(model, reentrant)
    assert handle.active()  # the hook cannot see these checkpoints
    _assert_same_step(plain, stacked, tokens)


def test_disabled_adapters_and_remove(tiny_model, tokens, calls):
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"])
    plain, stacked, handle = _llama_pair(tiny_model, config)
    with torch.no_grad():
        with stacked.disable_adapter():
            base = stacked(tokens).logits
        assert calls["stacked"] == 0  # every layer bypassed: nothing to stack
        with plain.disable_adapter():
            torch.testing.assert_close(base, plain(tokens).logits)
        handle.remove()
        torch.testing.assert_close(stacked(tokens).logits, plain(tokens).logits, rtol=1e-5, atol=1e-6)
    assert calls["stacked"] == 0 and not handle.active()


def test_a_failing_forward_drops_the_cache(tiny_model, calls):
    _, stacked, _ = _llama_pair(tiny_model, oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"]))
    with pytest.raises(IndexError):
        stacked(torch.full((1, 4), 10_000))  # token id beyond the vocabulary: the embedding raises
    assert calls["stacked"] == 1
    assert all(stacking.STACKED_ATTR not in layer.__dict__ for layer in stacking.oftv2_layers(stacked))


def test_a_model_without_oftv2_layers_is_refused():
    with pytest.raises(ValueError, match="Linear holds no OFTv2 layer"):
        oftv2.stack_rotations(nn.Linear(4, 4))


def test_config_option_installs_stacking_and_follows_the_adapters(tiny_model, tokens, calls):
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"], stack_rotations=True)
    model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2), config)
    randomize_q(model, std=0.05)
    plain = copy.deepcopy(model)
    plain.base_model._oftv2_stacking.remove()
    torch.testing.assert_close(model(tokens).logits, plain(tokens).logits, rtol=1e-5, atol=1e-6)
    assert calls["stacked"] == 1
    # An added adapter's layers join the hooks; deleting the only adapter asking for stacking removes them.
    model.add_adapter("other", oftv2.OFTv2Config(block_size=8, target_modules=["v_proj"]))
    assert len(model.base_model._oftv2_stacking.layers) == 4
    model.base_model.set_adapter("other")
    model.delete_adapter("default")
    assert "_oftv2_stacking" not in model.base_model.__dict__
    assert not any(layer.oftv2_stacking for layer in stacking.oftv2_layers(model))


def test_config_option_is_validated_and_saved(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="`stack_rotations` must be a bool"):
        oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"], stack_rotations="yes")
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"], stack_rotations=True)
    peft.get_peft_model(tiny_model("llama"), config).save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path)
    assert loaded.peft_config["default"].stack_rotations is True
    assert "_oftv2_stacking" in loaded.base_model.__dict__


def test_fsdp2_sharded_adapters_keep_their_per_layer_path(tmp_path, tiny_model, tokens, calls):
    # FSDP2 gathers each block's parameters in that block's own pre-forward: at the model's pre-forward they are
    # still shards (DTensors), so the hook must leave every layer to compute its own blocks (one-rank gloo group).
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"], stack_rotations=True)
        model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2), config)
        randomize_q(model, std=0.05)
        plain_loss = copy.deepcopy(model)(tokens, labels=tokens).loss  # unsharded: stacked (one batched series)
        handle = model.base_model._oftv2_stacking
        assert handle.active()
        inner = model.get_base_model()
        for block in inner.model.layers:
            fully_shard(block)
        fully_shard(inner)
        assert not handle.active()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
        assert calls["stacked"] == 1  # the unsharded copy's forward only
        assert all(p.grad is not None for n, p in model.named_parameters() if "oftv2_Q" in n)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("merge", [True, False])
def test_unloading_removes_the_hooks(tiny_model, tokens, merge):
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj"], stack_rotations=True)
    model = peft.get_peft_model(tiny_model("llama", num_hidden_layers=2), config)
    randomize_q(model, std=0.05)
    with torch.no_grad():
        adapted = model(tokens).logits
        plain = model.merge_and_unload() if merge else model.unload()
        assert not plain._forward_pre_hooks and not plain._forward_hooks
        out = plain(tokens).logits
    if merge:
        torch.testing.assert_close(out, adapted, rtol=1e-4, atol=1e-4)


def test_bf16_model_equals_per_layer(tiny_model, tokens):
    # bf16 activations, fp32 blocks (the triangles are cast up): both paths rotate in fp32 and round once.
    config = oftv2.OFTv2Config(block_size=8, target_modules="all-linear")
    plain, stacked, _ = _llama_pair(tiny_model, config)
    plain.to(torch.bfloat16)
    stacked.to(torch.bfloat16)
    _assert_same_step(plain, stacked, tokens)


def test_max_q_norm_bound_applies_in_the_batch(tiny_model, tokens, calls):
    # The bound rescales each block's triangle before the series (here it binds: random blocks have norm ~0.4).
    config = oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "o_proj"], max_q_norm=0.05)
    plain, stacked, _ = _llama_pair(tiny_model, config)
    _assert_same_step(plain, stacked, tokens)
    assert calls["stacked"] == 1
