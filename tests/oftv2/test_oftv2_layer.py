"""OFTv2 layers: identity at init, input-centric forward, merge/unmerge, composition, dropout, parameter counts."""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from transformers.pytorch_utils import Conv1D

import oftv2  # noqa: F401
from oftv2 import OFTv2Config, OFTv2Layer
from peftplug_kernels.cayley_neumann.reference import cayley_neumann


def _oft_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, OFTv2Layer)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_identity_at_init(tiny_model, tokens, family):
    model = tiny_model(family)
    with torch.no_grad():
        base = model(tokens).logits
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules="all-linear", block_size=8))
    with torch.no_grad():
        assert torch.equal(peft_model(tokens).logits, base)
    assert _oft_layers(peft_model)


def test_forward_rotates_input_block_wise():
    base = torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(base)
    peft_model = peft.get_peft_model(
        model, OFTv2Config(target_modules=["0"], block_size=4, orthogonalization="cayley")
    )
    layer = peft_model.base_model.model[0]
    randomize_q(peft_model, std=0.3)
    q = layer.oftv2_Q["default"].detach()
    r = torch.block_diag(*cayley_neumann(q, 4, form="cayley"))
    x = torch.randn(5, 8)
    expected = (x @ r) @ base.weight.T + base.bias
    assert torch.allclose(layer(x), expected, atol=1e-6)


@pytest.mark.parametrize("family, target", [("llama", "all-linear"), ("gpt2", ["c_attn", "c_fc", "c_proj"])])
@pytest.mark.parametrize("form", ["cayley_neumann", "cayley", "peft_cn"])
def test_merge_matches_adapter_and_unmerge_restores(tiny_model, tokens, family, target, form):
    model = tiny_model(family)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = peft.get_peft_model(
        model, OFTv2Config(target_modules=target, block_size=16, orthogonalization=form)
    )
    # Q large enough that the Neumann forms are visibly non-orthogonal: unmerge must still be exact.
    randomize_q(peft_model, std=0.05)
    with torch.no_grad():
        adapted = peft_model(tokens).logits
        peft_model.merge_adapter()
        merged = peft_model(tokens).logits
        peft_model.unmerge_adapter()
    assert torch.allclose(merged, adapted, atol=1e-4), (merged - adapted).abs().max()
    restored = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in peft_model.named_parameters()
    }
    for name, before in weights.items():
        assert torch.allclose(restored[name], before, atol=2e-6), name


def test_merge_and_unload_gives_plain_model(tiny_model, tokens):
    model = tiny_model("gpt2")
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["c_attn", "c_proj"], block_size=8))
    randomize_q(peft_model)
    with torch.no_grad():
        adapted = peft_model(tokens).logits
    merged = peft_model.merge_and_unload(safe_merge=True)
    assert not _oft_layers(merged)
    assert isinstance(merged.transformer.h[0].attn.c_attn, Conv1D)
    with torch.no_grad():
        assert torch.allclose(merged(tokens).logits, adapted, atol=1e-4)


def test_safe_merge_rejects_nan_and_leaves_weight(tiny_model):
    model = tiny_model("llama")
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["q_proj"], block_size=8))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    before = layer.base_layer.weight.detach().clone()
    with torch.no_grad():
        layer.oftv2_Q["default"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="default"):
        layer.merge(safe_merge=True)
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


def test_several_adapters_compose_as_successive_rotations(tiny_model, tokens):
    model = tiny_model("llama")
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["q_proj", "down_proj"], block_size=8))
    peft_model.add_adapter("second", OFTv2Config(target_modules=["q_proj", "down_proj"], r=4))
    randomize_q(peft_model, std=0.05, seed=1)
    layer = peft_model.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    layer.set_adapter(["default", "second"])
    r1 = torch.block_diag(*layer.get_rotation("default"))
    r2 = torch.block_diag(*layer.get_rotation("second"))
    expected = layer.base_layer(x @ r1 @ r2)
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, atol=1e-5)
        # Merging both (one call) must reproduce the composed forward on the whole model.
        peft_model.base_model.set_adapter(["default", "second"])
        composed = peft_model(tokens).logits
        peft_model.merge_adapter(["default", "second"])
        assert torch.allclose(peft_model(tokens).logits, composed, atol=1e-4)
        peft_model.unmerge_adapter()
        # Listed in the other order: still folded in the order the forward applies them.
        peft_model.merge_adapter(["second", "default"])
        assert torch.allclose(peft_model(tokens).logits, composed, atol=1e-4)
        peft_model.unmerge_adapter()


def test_adapter_management(tiny_model, tokens):
    model = tiny_model("llama")
    with torch.no_grad():
        base = model(tokens).logits
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8))
    peft_model.add_adapter("other", OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=16))
    randomize_q(peft_model, std=0.05)
    with torch.no_grad():
        out_default = peft_model(tokens).logits
        peft_model.set_adapter("other")
        out_other = peft_model(tokens).logits
        assert not torch.allclose(out_default, out_other)
        with peft_model.disable_adapter():
            assert torch.allclose(peft_model(tokens).logits, base, atol=1e-6)
        # Only the active adapter is trainable.
        trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
        assert trainable and all(".other" in n for n in trainable)
        peft_model.delete_adapter("default")
        assert all("default" not in n for n, _ in peft_model.named_parameters())
        assert torch.allclose(peft_model(tokens).logits, out_other, atol=1e-6)


def _expected_trainable(model, block_size, target_types, shared):
    total = 0
    for _, module in model.named_modules():
        if isinstance(module, target_types):
            width = module.weight.shape[0] if isinstance(module, Conv1D) else module.in_features
            total += block_size * (block_size - 1) // 2 if shared else width * (block_size - 1) // 2
    return total


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trainable_parameter_count(tiny_model, family, shared):
    model = tiny_model(family)
    # all-linear excludes the LM head: count every Linear/Conv1D except it.
    head = model.get_output_embeddings()
    expected = _expected_trainable(model, 8, (torch.nn.Linear, Conv1D), shared)
    expected -= (8 * 7 // 2) if shared else head.in_features * 7 // 2
    peft_model = peft.get_peft_model(
        model, OFTv2Config(target_modules="all-linear", block_size=8, block_share=shared)
    )
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == expected


def test_block_size_not_dividing_width_lists_valid_sizes(tiny_model):
    model = tiny_model("llama")  # widths 64 and 128
    with pytest.raises(ValueError, match=r"valid block sizes: \[2, 4, 8, 16, 32, 64\]"):
        peft.get_peft_model(model, OFTv2Config(target_modules=["q_proj"], block_size=24))
    with pytest.raises(ValueError, match="valid r"):
        peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["q_proj"], r=3))


def test_unknown_target_is_reported_with_what_exists(tiny_model):
    with pytest.raises(ValueError, match="not_a_layer") as caught:
        peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["not_a_layer"]))
    listed = str(caught.value).split("Adaptable modules", 1)[1]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in listed
    assert "embed_tokens" in listed  # nn.Embedding is adaptable too
    assert "base_layer" not in listed and "norm" not in listed


def test_module_dropout_is_applied_in_training_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    config = OFTv2Config(target_modules=["0"], block_size=8, module_dropout=0.5)
    peft_model = peft.get_peft_model(model, config)
    randomize_q(peft_model, std=0.1)
    layer = peft_model.base_model.model[0]
    x = torch.randn(4, 64)
    layer.eval()
    with torch.no_grad():
        eval_out = layer(x)
        assert torch.equal(layer(x), eval_out)
        layer.train()
        rotation = layer.get_rotation("default")
        eye = torch.eye(8)
        dropped_fraction = []
        for _ in range(40):
            blocks = layer.get_rotation("default", apply_dropout=True)
            is_eye = torch.tensor([torch.equal(blk, eye) for blk in blocks])
            kept_ok = torch.tensor([torch.equal(b1, b0) for b1, b0 in zip(blocks, rotation)])
            assert bool((is_eye | kept_ok).all())  # each block is either kept or exactly identity
            dropped_fraction.append(is_eye.float().mean())
        assert 0.3 < float(torch.stack(dropped_fraction).mean()) < 0.7
        train_outs = [layer(x) for _ in range(5)]
    assert any(not torch.allclose(t, eval_out) for t in train_outs)


def test_max_q_norm_bounds_each_block():
    model = torch.nn.Sequential(torch.nn.Linear(32, 4, bias=False))
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["0"], block_size=8, max_q_norm=0.5))
    layer = peft_model.base_model.model[0]
    with torch.no_grad():
        layer.oftv2_Q["default"].copy_(torch.randn(4, 28))
        layer.oftv2_Q["default"][0].mul_(1e-3)  # inside the bound: untouched
    from peftplug_kernels.cayley_neumann.reference import skew_from_triangle

    q = skew_from_triangle(layer.effective_q("default"), 8)
    norms = torch.linalg.matrix_norm(q)
    assert torch.allclose(norms[1:], torch.full((3,), 0.5), atol=1e-5)
    assert torch.allclose(layer.effective_q("default")[0], layer.oftv2_Q["default"][0])
    # Differentiable: gradients reach the raw parameters.
    layer(torch.randn(2, 32)).sum().backward()
    assert layer.oftv2_Q["default"].grad is not None and torch.isfinite(layer.oftv2_Q["default"].grad).all()


def test_training_steps_change_output_and_lower_loss(tiny_model, tokens):
    model = tiny_model("llama")
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules="all-linear", block_size=8))
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(8):
        loss = peft_model(tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    frozen = [p for n, p in peft_model.named_parameters() if "oftv2_" not in n]
    assert all(not p.requires_grad for p in frozen)


def test_dispatch_order_and_unsupported_layers(tiny_model):
    import importlib.util

    from oftv2.conv import dispatch_conv2d
    from oftv2.embedding import dispatch_embedding
    from oftv2.layer import dispatch_default
    from oftv2.model import dispatchers

    found = dispatchers()
    assert found[-3:] == [dispatch_default, dispatch_conv2d, dispatch_embedding]
    if importlib.util.find_spec("oftv2.bnb") is not None:
        import oftv2.bnb

        assert found[:-3] == list(getattr(oftv2.bnb, "DISPATCHERS", found[:-3]))
    with pytest.raises(TypeError, match="'model.norm' of type LlamaRMSNorm: supported are torch.nn.Linear"):
        peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules=["model.norm"], block_size=8))
