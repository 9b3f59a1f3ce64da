"""Merging steering vectors into biases: exact per family or refused, PEFT's merge/disable/unmerge conventions, and
the merged model's save/reload round trip."""

from __future__ import annotations

import pytest
import torch
import transformers

import steering

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])

# Tiny configs of the registered families whose merge is exact (the last-layer bias reaches the residual stream
# unchanged, or the family's merge rule rescales or relocates it).
EXACT = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma": {},
    "phi3": {"pad_token_id": 0},
    "olmo": {},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_neox": {},
    "gpt_neox-sequential": {"use_parallel_residual": False},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "opt-post-norm": {"ffn_dim": 128, "word_embed_proj_dim": 64, "do_layer_norm_before": False},
    "granite": {"residual_multiplier": 0.22},
}
VARIANTS = {**EXACT, "gptj": {"rotary_dim": 8}}
# Families that normalise the MLP output with a bias-free norm before the residual add: no bias is exact.
REFUSED = ("gemma2", "olmo2")


def _build(name: str, seed: int = 0):
    """A tiny randomly initialised causal LM of the family ``name`` (``family-variant`` for config variants)."""
    model_type = name.split("-")[0]
    kwargs = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128, "head_dim": 16,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    kwargs.update(VARIANTS.get(name, {}))
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _steer(model, layers=(0, 1), multiplier=1.5, **cfg):
    """``model`` with random vectors (fixed seed) at ``layers``."""
    gen = torch.Generator().manual_seed(1)
    vectors = {layer: torch.randn(64, generator=gen) for layer in layers}
    return steering.steering_adapter(model, vectors, multiplier=multiplier, **cfg)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.filterwarnings("ignore:merge_and_unload folded")
@pytest.mark.parametrize("name", sorted(EXACT))
def test_merge_and_unload_matches_the_steered_model(name):
    base = _logits(_build(name))
    pm = _steer(_build(name))
    steered = _logits(pm)
    assert (steered - base).abs().max() > 1e-2
    merged = _logits(pm.merge_and_unload())
    torch.testing.assert_close(merged, steered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", REFUSED)
def test_merge_is_refused_where_no_bias_is_exact(name):
    pm = _steer(_build(name))
    steered = _logits(pm)
    with pytest.raises(ValueError, match=rf"{name}.*post_feedforward_layernorm"):
        pm.merge_and_unload()
    with pytest.raises(ValueError, match=name):
        pm.merge_adapter()
    # Nothing was merged: the adapter still steers as before, and disabling it gives the base model.
    assert not any(layer.merged for layer in pm.base_model.steering_layers().values())
    assert torch.equal(_logits(pm), steered)
    with pm.disable_adapter():
        assert torch.equal(_logits(pm), _logits(_build(name)))


def test_a_refused_adapter_merges_nothing():
    """One unmergeable adapter among the active ones: no block is changed (not even those merged first)."""
    model = _build("gpt2")
    bias = model.transformer.h[0].mlp.c_proj.bias.detach().clone()
    pm = _steer(model, layers=(0,), adapter_name="shift")
    _steer(pm, layers=(1,), adapter_name="ablate", operator="ablate")
    pm.base_model.set_adapter(["shift", "ablate"])
    with pytest.raises(ValueError, match="ablate"):
        pm.merge_and_unload()
    assert torch.equal(pm.base_model.model.transformer.h[0].base_layer.mlp.c_proj.bias, bias)


def test_adapters_on_different_blocks_merge_together():
    pm = _steer(_build("gpt2"), layers=(0,), adapter_name="a")
    _steer(pm, layers=(1,), adapter_name="b", multiplier=-2.0)
    pm.base_model.set_adapter(["a", "b"])
    steered = _logits(pm)
    assert (steered - _logits(_steer(_build("gpt2"), layers=(0,)))).abs().max() > 1e-2
    torch.testing.assert_close(_logits(pm.merge_and_unload()), steered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_disable_after_merge_adapter_gives_the_base_model(name):
    base = _logits(_build(name))
    pm = _steer(_build(name))
    steered = _logits(pm)
    pm.merge_adapter()
    torch.testing.assert_close(_logits(pm), steered, atol=1e-5, rtol=1e-5)
    with pm.disable_adapter():
        # PEFT's convention: a disabled layer unmerges first (bit-exact: the bias before the merge is restored).
        assert torch.equal(_logits(pm), base)
    assert not any(layer.merged for layer in pm.base_model.steering_layers().values())
    torch.testing.assert_close(_logits(pm), steered, atol=1e-5, rtol=1e-5)


def test_unmerge_undoes_what_was_merged_after_set_multiplier():
    model = _build("gpt2")
    bias = model.transformer.h[0].mlp.c_proj.bias.detach().clone()
    base = _logits(_build("gpt2"))
    pm = _steer(model, multiplier=1.0)
    pm.merge_adapter()
    with pytest.warns(UserWarning, match="merged"):
        pm.base_model.set_multiplier(4.0)
    pm.unmerge_adapter()
    assert torch.equal(pm.base_model.model.transformer.h[0].base_layer.mlp.c_proj.bias, bias)
    with pm.disable_adapter():
        assert torch.equal(_logits(pm), base)
    # The new multiplier applies once unmerged, exactly as in an adapter that had it from the start.
    torch.testing.assert_close(_logits(pm), _logits(_steer(_build("gpt2"), multiplier=4.0)))


@pytest.mark.parametrize("name", ["llama", "granite"])
def test_merged_model_without_mlp_bias_survives_save_and_reload(tmp_path, name):
    model = _build(name)
    assert model.config.mlp_bias is False
    base = _logits(_build(name))
    pm = _steer(model)
    steered = _logits(pm)
    merged = pm.merge_and_unload()
    assert merged.config.mlp_bias is True
    merged.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    again = _logits(reloaded)
    torch.testing.assert_close(again, steered, atol=1e-5, rtol=1e-5)
    assert (again - base).abs().max() > 1e-2


def test_merge_into_a_bias_the_config_cannot_declare_warns():
    pm = _steer(_build("qwen2"))
    with pytest.warns(UserWarning, match="save_pretrained -> from_pretrained drops them"):
        pm.merge_and_unload()


def test_merge_uses_the_models_family_not_the_adapters_provenance():
    """Vectors extracted from a llama-type model, applied to a gemma2 model: the gemma2 rule decides."""
    pm = _steer(_build("gemma2"), model_type="llama")
    with pytest.raises(ValueError, match="gemma2"):
        pm.merge_and_unload()


def test_merge_is_refused_for_a_family_without_a_known_bias():
    pm = _steer(_build("gptj"))  # registered without bias_proj
    with pytest.raises(ValueError, match="bias_proj"):
        pm.merge_and_unload()


def test_activating_another_adapter_on_a_merged_model_unmerges_first():
    # PEFT's convention (BaseTuner.set_adapter warns and unmerges): otherwise the merged adapter kept steering from
    # the bias while only the new one was reported active.
    vectors_b = {0: torch.randn(64, generator=torch.Generator().manual_seed(7))}
    only_b = _logits(steering.steering_adapter(_build("llama"), vectors_b, adapter_name="b", multiplier=1.0))
    only_a = _logits(_steer(_build("llama")))
    model = _steer(_build("llama"))
    model.merge_adapter()
    with pytest.warns(UserWarning, match="Unmerging the model first"):
        steering.steering_adapter(model, vectors_b, adapter_name="b", multiplier=1.0)
    assert not any(layer.merged for layer in model.base_model.steering_layers().values())
    torch.testing.assert_close(_logits(model), only_b, rtol=0, atol=1e-5)
    model.base_model.set_adapter("default")
    torch.testing.assert_close(_logits(model), only_a, rtol=0, atol=1e-5)
