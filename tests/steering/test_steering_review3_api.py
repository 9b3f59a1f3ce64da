"""Third review: API inputs that produced silently wrong steering.

``add_weighted_adapter`` (and ``merge_vectors``) with a NaN or infinite weight created an adapter whose vectors were
NaN/inf: every steered forward then gave NaN logits, without an error where the bad value was given.
``generate(inputs=ids)`` left the prompt length unknown, so without a KV cache the position policies steered the
wrong tokens.
"""

from __future__ import annotations

import pytest
import torch

from steering import steering_adapter
from steering.merge import merge_vectors


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_merge_weight_is_refused_and_adds_no_adapter(tiny_model, bad):
    base = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(0)
    h = base.config.hidden_size
    model = steering_adapter(base, {1: torch.randn(h, generator=g)}, "a")
    model = steering_adapter(model, {1: torch.randn(h, generator=g)}, "b")
    with pytest.raises(ValueError, match=r"weights\[1\] must be a finite real number"):
        model.base_model.add_weighted_adapter(["a", "b"], [1.0, bad], "merged")
    assert "merged" not in model.peft_config
    with pytest.raises(ValueError, match=r"weights\[0\] must be a finite real number"):
        merge_vectors([torch.ones(4), torch.ones(4)], [bad, 1.0], "ties", density=0.5)


def test_finite_weights_still_merge_as_the_weighted_sum(tiny_model):
    # The control: the check keeps every finite weight (ints included) and the linear merge is sum_i w_i v_i.
    base = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(1)
    h = base.config.hidden_size
    va, vb = torch.randn(h, generator=g), torch.randn(h, generator=g)
    model = steering_adapter(base, {1: va}, "a", multiplier=2.0)
    model = steering_adapter(model, {1: vb}, "b")
    model.base_model.add_weighted_adapter(["a", "b"], [1, -0.5], "merged")
    torch.testing.assert_close(model.base_model.get_vectors("merged")[1], 2.0 * va - 0.5 * vb)


@pytest.mark.parametrize("policy", ["generated", "prompt", "from_last_prompt"])
def test_generate_with_the_inputs_keyword_steers_the_same_tokens(tiny_model, policy):
    # `generate(inputs=ids)` is transformers' own spelling. The prompt length was only read from `input_ids` or a
    # positional tensor, so without a KV cache (each step a fresh full forward) every token counted as prompt:
    # "generated" gave exactly the base model's scores (max |Δscore| 0.84 vs input_ids=).
    base = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(0)
    h = base.config.hidden_size
    model = steering_adapter(base, {0: torch.randn(h, generator=g) * 8, 1: torch.randn(h, generator=g) * 8},
                             positions=policy)
    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "temperature": None, "top_p": None,
              "top_k": None, "attention_mask": torch.ones_like(ids), "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        reference = model.generate(input_ids=ids, **kwargs)  # with the KV cache: steps after the prompt
        for use_cache in (True, False):
            out = model.generate(inputs=ids, use_cache=use_cache, **kwargs)
            assert out.sequences.tolist() == reference.sequences.tolist()
            for a, b in zip(out.scores, reference.scores):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
