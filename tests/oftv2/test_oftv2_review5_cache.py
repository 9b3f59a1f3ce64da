"""The inference rotation cache (oftv2/rotation_cache.py) with parameters that carry derivatives: ``torch.func``
transforms (``vmap`` over stacked adapters, ``jvp``) and forward-mode AD dual tensors swapped in by
``torch.func.functional_call``, in eval mode without autograd. Before, ``vmap``/``jvp`` raised ``RuntimeError: Cannot
access data pointer of Tensor that doesn't have storage`` and a dual tensor read the blocks an earlier plain forward
had cached, so its tangent came back ``None``. Tangents are compared with central finite differences (the per-forward
series Function has no forward-mode rule, so "the cache off" cannot compute them), batched outputs with unbatched."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.autograd.forward_ad as fw_ad

import oftv2
from oftv2 import rotation_cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def model_and_q(tiny_model):
    base = tiny_model("llama", num_hidden_layers=1)
    base.set_attn_implementation("eager")  # (SDPA on CPU has no forward-mode derivative)
    model = peft.get_peft_model(base, oftv2.OFTv2Config(block_size=8, target_modules="all-linear",
                                                        init_weights=False)).eval()
    name = next(n for n, _ in model.named_parameters() if "oftv2_Q" in n)
    return model, name, model.get_parameter(name).detach()


def _logits(model, name, q, tokens):
    return torch.func.functional_call(model, {name: q}, (tokens,)).logits


def _finite_difference(model, name, q, v, tokens, eps=1e-3):
    with torch.no_grad():
        rotation_cache.clear(model)  # (each evaluation its own blocks)
        plus = _logits(model, name, q + eps * v, tokens)
        minus = _logits(model, name, q - eps * v, tokens)
    return (plus - minus) / (2 * eps)


def test_forward_ad_tangent_is_not_dropped_by_a_filled_cache(model_and_q, tokens):
    model, name, q = model_and_q
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))

    def tangent():
        with torch.no_grad(), fw_ad.dual_level():
            return fw_ad.unpack_dual(_logits(model, name, fw_ad.make_dual(q, v), tokens)).tangent

    expected = _finite_difference(model, name, q, v, tokens)
    with torch.no_grad():
        model(tokens)  # fills the cache from the same parameter storage the dual tensor shares
    got = tangent()
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=5e-4)
    assert expected.abs().max() > 1e-3


def test_func_jvp_and_vmap_in_eval_without_autograd(model_and_q, tokens):
    model, name, q = model_and_q
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens)
        _, tangent = torch.func.jvp(lambda p: _logits(model, name, p, tokens), (q,), (v,))
        batched = torch.func.vmap(lambda p: _logits(model, name, p, tokens))(torch.stack([q, q + 0.05 * v]))
        second = _logits(model, name, q + 0.05 * v, tokens)
    torch.testing.assert_close(tangent, _finite_difference(model, name, q, v, tokens), rtol=1e-2, atol=5e-4)
    torch.testing.assert_close(batched[1], second, rtol=1e-5, atol=1e-6)
    assert (batched[0] - batched[1]).abs().max() > 1e-3  # (each slice saw its own parameter)
