"""The steering adapter: exactness at multiplier 0, positions under padding and KV cache, operators, composition."""

from __future__ import annotations

import itertools

import peft
import pytest
import torch

import steering
from steering import SteeringConfig

FAMILIES = ("llama", "qwen2", "gpt2")
PROMPTS = ["Once upon a time", "Hi", "The cat sat on"]


def _steered(model, layers=(0,), seed=1, scale=2.0, **cfg):
    """Wraps ``model`` with random vectors (fixed seed) at ``layers``."""
    config = SteeringConfig(layers=list(layers), task_type="CAUSAL_LM", **cfg)
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    hidden = pm.base_model.peft_config["default"].hidden_size
    pm.base_model.set_vectors({layer: scale * torch.randn(hidden, generator=gen) for layer in layers})
    return pm


def _greedy(model, batch, n=6, use_cache=True):
    out = model.generate(**batch, max_new_tokens=n, do_sample=False, use_cache=use_cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_multiplier_zero_and_disable_give_base_exactly(family, tiny_model, tokenizer):
    batch = tokenizer(["hello world", "hi"], return_tensors="pt", padding=True)
    base = tiny_model(family)(**batch).logits
    pm = _steered(tiny_model(family), layers=(0, 1), multiplier=0.0)
    assert torch.equal(pm(**batch).logits, base)
    pm.base_model.set_multiplier(3.0)
    steered = pm(**batch).logits
    assert (steered - base).abs().max() > 1e-3
    with pm.disable_adapter():
        assert torch.equal(pm(**batch).logits, base)
    assert torch.equal(pm(**batch).logits, steered)


def test_projection_rises_monotonically_with_multiplier(tiny_model, tokenizer):
    pm = _steered(tiny_model("llama", num_hidden_layers=3), layers=(0,), scale=1.0)
    v = pm.base_model.get_vectors()[0]
    blocks = pm.base_model.model.model.layers
    seen = {}
    handle = blocks[2].register_forward_hook(lambda m, a, out: seen.__setitem__("h", out))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    projections = []
    try:
        for mult in (-4.0, -2.0, 0.0, 1.0, 2.0, 4.0, 8.0):
            pm.base_model.set_multiplier(mult)
            with torch.no_grad():
                pm(**batch)
            h = seen["h"][batch["attention_mask"].bool()]
            projections.append(float((h @ v / v.norm()).mean()))
    finally:
        handle.remove()
    assert all(b > a for a, b in itertools.pairwise(projections)), projections


@pytest.mark.parametrize("family", ("llama", "gpt2"))
@pytest.mark.parametrize("positions", steering.POSITIONS)
def test_left_padded_batch_equals_single_runs_and_cache_equals_no_cache(family, positions, tiny_model, tokenizer):
    tokenizer.padding_side = "left"
    pm = _steered(tiny_model(family), layers=(0, 1), scale=3.0, positions=positions)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    seq_b, scores_b = _greedy(pm, batch)
    seq_nc, scores_nc = _greedy(pm, batch, use_cache=False)
    assert torch.equal(seq_b, seq_nc)
    torch.testing.assert_close(scores_b, scores_nc, rtol=1e-4, atol=1e-4)
    width = batch["input_ids"].shape[1]
    for i, prompt in enumerate(PROMPTS):
        single = tokenizer([prompt], return_tensors="pt")
        seq_s, scores_s = _greedy(pm, single)
        assert torch.equal(seq_s[0, single["input_ids"].shape[1]:], seq_b[i, width:])
        torch.testing.assert_close(scores_s[0], scores_b[i], rtol=1e-4, atol=1e-4)
    with pm.disable_adapter():
        _, scores_base = _greedy(pm, batch)
    first_differs = not torch.allclose(scores_base[:, 0], scores_b[:, 0])
    later_differs = not torch.allclose(scores_base[:, 1:], scores_b[:, 1:])
    # The first new token is predicted from the prompt's last position: "generated" must leave it alone.
    assert first_differs == (positions != "generated")
    assert later_differs


def test_generated_policy_steers_exactly_the_new_tokens(tiny_model, tokenizer):
    pm = _steered(tiny_model("llama"), layers=(1,), scale=3.0, positions="generated")
    ids = tokenizer(["abcdefgh"], return_tensors="pt")
    with pm.disable_adapter():
        base = pm(**ids).logits
    # A plain forward is all prompt: nothing is steered.
    assert torch.equal(pm(**ids).logits, base)
    # Scoring it as "5 prompt tokens + 3 generated" steers the last 3 positions only.
    with pm.base_model.prompt_length(5):
        scored = pm(**ids).logits
    assert torch.equal(scored[:, :5], base[:, :5])
    assert (scored[:, 5:] - base[:, 5:]).abs().amax(dim=-1).min() > 1e-4


def test_prompt_policy_steers_real_prompt_tokens_only(tiny_model, tokenizer):
    tokenizer.padding_side = "left"
    pm = _steered(tiny_model("llama"), layers=(1,), positions="prompt")
    rec = []
    pm.base_model.model.model.layers[1].register_forward_hook(lambda m, a, out: rec.append(out.detach()))
    batch = tokenizer(["abc", "abcdef"], return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    seq = pm.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)
    full_mask = torch.cat([batch["attention_mask"], torch.ones(2, 3, dtype=torch.long)], dim=1)
    rec.clear()
    with pm.base_model.prompt_length(width):
        pm(input_ids=seq, attention_mask=full_mask)
    with pm.disable_adapter():
        pm(input_ids=seq, attention_mask=full_mask)
    steered, base = rec
    real_prompt = batch["attention_mask"].bool()
    assert (steered[:, :width][real_prompt] - base[:, :width][real_prompt]).abs().amax(dim=-1).min() > 1e-4
    assert torch.equal(steered[:, :width][~real_prompt], base[:, :width][~real_prompt])  # padding: never steered
    assert torch.equal(steered[:, width:], base[:, width:])  # generated tokens: not steered


def test_ablate_removes_the_direction(tiny_model, tokenizer):
    pm = _steered(tiny_model("llama"), layers=(0,), operator="ablate", multiplier=1.0)
    u = pm.base_model.get_vectors()[0]
    u = u / u.norm()
    seen = {}
    pm.base_model.model.model.layers[0].register_forward_hook(lambda m, a, out: seen.__setitem__("h", out))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    pm(**batch)
    mask = batch["attention_mask"].bool()
    assert (seen["h"][mask] @ u).abs().max() < 1e-5
    pm.base_model.peft_config["default"].operator = "ablate_then_add"
    layer = pm.base_model.steering_layers()[0]
    layer.steer_operator["default"] = "ablate_then_add"
    pm.base_model.set_multiplier(2.0)
    pm(**batch)
    v = pm.base_model.get_vectors()[0]
    torch.testing.assert_close(seen["h"][mask] @ u, torch.full((int(mask.sum()),), 2.0 * float(v.norm())))


def test_several_adapters_add_up_and_merge(tiny_model, tokenizer):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    pm = _steered(tiny_model("llama"), layers=(0,), seed=1, multiplier=1.5)
    gen = torch.Generator().manual_seed(2)
    pm.add_adapter("b", SteeringConfig(layers=[0, 1], multiplier=-0.5, task_type="CAUSAL_LM"))
    vb = {0: torch.randn(64, generator=gen), 1: torch.randn(64, generator=gen)}
    pm.base_model.set_vectors(vb, "b")
    pm.base_model.set_adapter(["default", "b"])
    both = pm(**batch).logits
    va = pm.base_model.get_vectors("default")[0]
    expected = {0: 1.5 * va - 0.5 * vb[0], 1: -0.5 * vb[1]}
    ref = steering.steering_adapter(tiny_model("llama"), expected)
    torch.testing.assert_close(both, ref(**batch).logits, rtol=1e-5, atol=1e-5)

    pm.base_model.add_weighted_adapter(["default", "b"], [1.0, 1.0], "merged")
    pm.base_model.set_adapter("merged")
    torch.testing.assert_close(pm(**batch).logits, both, rtol=1e-5, atol=1e-5)
    pm.base_model.add_weighted_adapter(["default", "b"], [1.0, 1.0], "ties", combination_type="ties", density=0.5)
    ties = pm.base_model.get_vectors("ties")
    assert ties.keys() == {0, 1} and all(int((t != 0).sum()) <= 64 for t in ties.values())
    with pytest.raises(ValueError, match="combination_type"):
        pm.base_model.add_weighted_adapter(["default", "b"], [1.0, 1.0], "x", combination_type="svd")


def test_merge_and_unload_folds_an_add_vector_into_the_bias(tiny_model, tokenizer):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    pm = _steered(tiny_model("llama"), layers=(0, 1), multiplier=2.0)
    steered = pm(**batch).logits
    merged = pm.merge_and_unload()
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(merged(**batch).logits[mask], steered[mask], rtol=1e-5, atol=1e-5)
    assert not merged.model._forward_pre_hooks  # the position bookkeeping left with the adapter
    pm2 = _steered(tiny_model("llama"), layers=(0,), positions="prompt")
    with pytest.raises(ValueError, match="positions='all'"):
        pm2.merge_and_unload()


def test_trainable_vector_is_a_peft_parameter(tiny_model):
    pm = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM"))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("steer_vector" in n for n in trainable)
    assert sum(p.numel() for n, p in pm.named_parameters() if p.requires_grad) == 2 * 64


def test_invalid_config_values_are_rejected(tiny_model):
    with pytest.raises(ValueError, match="layers"):
        SteeringConfig()
    with pytest.raises(ValueError, match="operator"):
        SteeringConfig(layers=[0], operator="mul")
    with pytest.raises(ValueError, match="positions"):
        SteeringConfig(layers=[0], positions="last")
    with pytest.raises(ValueError, match="layer_multipliers"):
        SteeringConfig(layers=[0], layer_multipliers={3: 1.0})
    with pytest.raises(ValueError, match="out of range"):
        peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[5]))
    with pytest.raises(ValueError, match="hidden size"):
        peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0], hidden_size=32))


def test_cached_decoding_plan_follows_every_change(tiny_model, tokenizer):
    """The no-grad fast path caches multiplier * v; every way of changing what it was built from must show."""
    pm = _steered(tiny_model("llama"), layers=(0,), scale=1.0)
    layer = pm.base_model.steering_layers()[0]
    seen = {}
    hooks = [layer.base_layer.register_forward_hook(lambda m, a, out: seen.__setitem__("base", out)),
             layer.register_forward_hook(lambda m, a, out: seen.__setitem__("steered", out))]
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()

    def delta():
        with torch.no_grad():
            pm(**batch)
        d = seen["steered"] - seen["base"]
        assert d[~real].abs().max() == 0  # padding is never steered
        return d[real]

    def expect(vector):
        # (h + a) - h carries a float32 rounding of ulp(|h| + |a|): ~2e-6 for entries near 20, so a fixed 1e-6 was
        # flaky; a wrong vector is off by O(1).
        torch.testing.assert_close(delta(), vector.expand(int(real.sum()), -1), rtol=1e-6, atol=1e-5)

    try:
        v = pm.base_model.get_vectors()[0]
        expect(v)
        expect(v)  # served from the plan
        pm.base_model.set_multiplier(-2.5)
        expect(-2.5 * v)
        w = torch.randn(v.shape[0], generator=torch.Generator().manual_seed(0))
        pm.base_model.set_vectors({0: w})
        expect(-2.5 * w)
        with torch.no_grad():
            layer.steer_vector["default"].mul_(2.0)  # in-place edit, as an optimizer step would do
        expect(-5.0 * w)
        layer.steer_normalize["default"] = True
        expect(-2.5 * w / w.norm())
        layer.steer_normalize["default"] = False
        pm.add_adapter("other", SteeringConfig(layers=[0], task_type="CAUSAL_LM", multiplier=3.0))
        pm.base_model.set_vectors({0: v}, adapter_name="other")
        pm.base_model.set_adapter("other")
        expect(3.0 * v)
        pm.base_model.set_adapter(["default", "other"])
        expect(-5.0 * w + 3.0 * v)
        layer.steer_operator["other"] = "ablate"  # a non-add operator leaves the fast path
        unit = v / v.norm()
        with torch.no_grad():
            pm(**batch)
        h = seen["base"] - 5.0 * w
        torch.testing.assert_close(seen["steered"][real], (h - 3.0 * (h @ unit)[..., None] * unit)[real],
                                   rtol=0, atol=1e-5)
    finally:
        for hook in hooks:
            hook.remove()


def test_padding_after_the_prompt_is_still_masked_outside_generate(tiny_model, tokenizer):
    """Only generate's own chunks skip the padding mask; a declared prompt length with right padding keeps it."""
    pm = _steered(tiny_model("llama"), layers=(0,), positions="generated", scale=1.0)
    layer = pm.base_model.steering_layers()[0]
    seen = {}
    hooks = [layer.base_layer.register_forward_hook(lambda m, a, out: seen.__setitem__("base", out)),
             layer.register_forward_hook(lambda m, a, out: seen.__setitem__("steered", out))]
    side, tokenizer.padding_side = tokenizer.padding_side, "right"  # the tokenizer fixture is session-wide
    try:
        batch = tokenizer(["Once upon a time", "Hi"], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    assert not batch["attention_mask"][:, -1].all()  # right padding after the declared prompt
    try:
        with torch.no_grad(), pm.base_model.prompt_length(2):
            pm(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    steered = (seen["steered"] - seen["base"]).abs().amax(-1) > 0
    expected = batch["attention_mask"].bool() & (torch.arange(batch["input_ids"].shape[1]) >= 2)
    assert torch.equal(steered, expected)


def test_block_attributes_resolve_through_the_steering_wrapper():
    # Qwen2 in transformers 5.0 reads `attention_type` from each decoder layer, which steering wraps.
    import peft

    import steering
    from peftplug.tiny import tiny_model

    model = tiny_model("qwen2", seed=0)
    block = model.model.layers[0]
    block.attention_type = "full_attention"
    wrapped = peft.get_peft_model(model, steering.SteeringConfig(layers=[0]))
    layer = wrapped.base_model.model.model.layers[0]
    assert isinstance(layer, steering.SteeringLayer) and layer.attention_type == "full_attention"
    with pytest.raises(AttributeError):
        _ = layer.not_an_attribute_anywhere
