"""``torch.compile(model, fullgraph=True)`` on every adapter type of ours: OFTv2 on Linear, Conv2d and Embedding
layers (torch and Triton kernels), QOFT on an NF4 base, steering vectors and PCT.

``fullgraph=True`` turns any graph break into an error, so each passing case has zero breaks, in our code and in
everyone else's. The compiled loss and every adapter gradient must equal the eager ones to fp32 rounding, and a
second step (parameters changed, as an optimizer changes them) must reuse the graph instead of recompiling — the
first GPU run saw OFTv2 recompile to dynamo's limit and fall back to eager. ``backend="aot_eager"`` traces forward
and backward as Inductor would receive them without paying its C++ compile; one case runs the default Inductor
backend. The Triton kernels run in interpreter mode on CPU (tests/conftest.py), as ``torch.library`` custom ops.

Each compile costs seconds of tracing on CPU and each interpreted Triton kernel runs in Python once per block: the
checks on the tiny Llama's torch path share one compiled model, and its Triton cases adapt one linear of each shape
in blocks of 16.
"""

from __future__ import annotations

import peft
import pytest
import torch
from oftv2_helpers import MixedLayers, randomize_q
from torch import nn

import oftv2
import prompt_transfer as pt
import steering
from peftplug.tiny import char_tokenizer, tiny_model
from peftplug_kernels._triton_available import triton_usable

IMPLS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles new models through the same forward code objects: start from an empty dynamo cache, so
    that one test's guards never count as another's recompilations."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _needs_triton(impl: str) -> None:
    if impl == "triton":
        ok, why = triton_usable("block_rotate", torch.zeros(1))
        if not ok:
            pytest.skip(why)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def assert_compiled_matches_eager(model: nn.Module, batch: dict, loss_of, backend="aot_eager", rtol: float = 1e-5,
                                  atol: float = 1e-6, compiled: nn.Module | None = None) -> nn.Module:
    """Loss and adapter gradients of ``torch.compile(model, fullgraph=True)`` equal eager's; step 2 reuses the graph.

    Args:
        model: The adapted model (train mode).
        batch: Its keyword inputs.
        loss_of: Model output -> scalar loss.
        backend: Dynamo backend (name or callable).
        rtol: Relative tolerance (fp32 rounding).
        atol: Absolute tolerance.
        compiled: ``model`` compiled before (instead of compiling it here).

    Returns:
        The compiled model.
    """
    params = _trainable(model)
    assert params
    eager_loss = loss_of(model(**batch))
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)

    compiled = compiled if compiled is not None else torch.compile(model, fullgraph=True, backend=backend)
    loss = loss_of(compiled(**batch))
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=atol)
    assert any(g.abs().max() > 0 for g in eager_grads.values()), "no adapter gradient: the test would prove nothing"
    for name, param in params.items():
        torch.testing.assert_close(param.grad, eager_grads[name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    model.zero_grad(set_to_none=True)

    with torch.no_grad():
        for param in params.values():
            param.add_(torch.randn_like(param), alpha=1e-3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss_of(compiled(**batch)).backward()
    model.zero_grad(set_to_none=True)
    return compiled


def _tiny_llama(**overrides):
    return tiny_model("llama", seed=0, **{"num_hidden_layers": 1, **overrides})


def _lm_batch() -> dict:
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    enc = tokenizer(["hello world", "abc"], return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def _lm_loss(out) -> torch.Tensor:
    return out.loss


@pytest.mark.parametrize("conv_evaluation", ["weight", "input"])
@pytest.mark.parametrize("impl", IMPLS)
def test_oftv2_linear_conv_embedding(impl, conv_evaluation):
    _needs_triton(impl)
    config = oftv2.OFTv2Config(block_size=4, target_modules=["embed", "conv", "proj"], kernel_impl=impl,
                               conv_evaluation=conv_evaluation)
    model = peft.get_peft_model(MixedLayers(), config)
    randomize_q(model, std=0.05)
    model.train()
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(1))
    assert_compiled_matches_eager(model, {"ids": ids}, lambda out: out.square().mean())


def test_oftv2_tiny_llama_all_linear_then_stacked_rotations():
    # One compiled tiny Llama (all seven linears; r=8 gives blocks of 8 and of 16) serves three checks in turn:
    # 1. plain OFTv2 compiles whole and equals eager;
    # 2. oftv2.stack_rotations after compile is seen: dynamo does not guard module hooks, so the layers' stacking
    #    flag makes the plain graph fail its guards once the hooks are added, and a graph of the batched series (its
    #    source lines are in the graph's comments) is traced — whole, and equal to eager stacked;
    # 3. remove() reverts: the plain graph passes its guards and serves again.
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return aot_eager(gm, example_inputs)

    model = peft.get_peft_model(_tiny_llama(), oftv2.OFTv2Config(r=8, target_modules="all-linear"))
    randomize_q(model, std=0.05)
    model.train()
    batch = _lm_batch()
    compiled = assert_compiled_matches_eager(model, batch, _lm_loss, backend=backend)
    assert len(graphs) == 1

    plain_loss = compiled(**batch).loss.detach()
    handle = oftv2.stack_rotations(model)
    stacked_loss = compiled(**batch).loss.detach()
    # The second graph runs the batched series, the first not.
    assert len(graphs) == 2 and "stacked.py" not in graphs[0] and "stacked.py" in graphs[1]
    torch.testing.assert_close(stacked_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert_compiled_matches_eager(model, batch, _lm_loss, compiled=compiled)
    assert len(graphs) == 2

    handle.remove()
    torch.testing.assert_close(compiled(**batch).loss, model(**batch).loss)
    assert len(graphs) == 2  # the first graph serves again


def test_oftv2_tiny_llama_triton():
    # Triton's interpreter runs each kernel in Python, three times per layer (eager, compiled, second step), once per
    # block: one linear of each distinct shape (64→64, 64→32, 64→128, 128→64 in the tiny Llama) instead of all
    # seven, in blocks of 16 (the torch path runs all seven in test_oftv2_tiny_llama_all_linear_then_stacked_rotations).
    _needs_triton("triton")
    model = peft.get_peft_model(_tiny_llama(), oftv2.OFTv2Config(
        block_size=16, target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"], kernel_impl="triton"))
    randomize_q(model, std=0.05)
    model.train()
    assert_compiled_matches_eager(model, _lm_batch(), _lm_loss)


def test_oftv2_inductor():
    # The default backend: Inductor generates and compiles C++ for the forward and the backward (the one case that
    # pays for it, hence the smallest model: one adapted linear layer).
    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                oftv2.OFTv2Config(block_size=4, target_modules=["0"], kernel_impl="torch"))
    randomize_q(model, std=0.05)
    model.train()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    assert_compiled_matches_eager(model, {"input": x}, lambda out: out.square().mean(), backend="inductor",
                                  rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def nf4_llama(tmp_path_factory):
    """Factory ``nf4_llama(compute_dtype=torch.float32)`` of a 1-layer tiny Llama loaded as NF4 (double quant)
    through transformers."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    path = tmp_path_factory.mktemp("tiny_llama_1l")
    _tiny_llama().save_pretrained(path)
    logging.disable_progress_bar()

    def load(compute_dtype: torch.dtype = torch.float32):
        qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                     bnb_4bit_compute_dtype=compute_dtype)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig, device_map="cpu")

    return load


@pytest.mark.parametrize("impl", IMPLS)
def test_qoft_nf4(nf4_llama, impl):
    # "triton" forces the fused rotate + NF4 dequantize + matmul kernel in every 4-bit layer (it takes fp16/bf16
    # compute only); "torch" rotates, then calls bitsandbytes' Linear4bit, whose 4-bit ops (custom ops since
    # bitsandbytes 0.50) compile whole too.
    _needs_triton(impl)
    from oftv2 import bnb as qoft

    base = nf4_llama(torch.float16 if impl == "triton" else torch.float32)
    # The interpreted fused kernel: one 4-bit linear of each distinct shape, as in test_oftv2_tiny_llama_triton.
    targets = "all-linear" if impl == "torch" else ["q_proj", "k_proj", "gate_proj", "down_proj"]
    model = peft.get_peft_model(base, oftv2.OFTv2Config(block_size=16, target_modules=targets, kernel_impl=impl))
    randomize_q(model, std=0.05)
    model.train()
    layers = [m for m in model.modules() if isinstance(m, qoft.Linear4bit)]
    batch = _lm_batch()
    assert layers and all((m._fused_adapter(batch["input_ids"][..., None].float().expand(-1, -1, m.in_features))
                           is not None) == (impl == "triton") for m in layers)
    assert_compiled_matches_eager(model, batch, _lm_loss, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("operator", "positions"), [("add", "all"), ("ablate_then_add", "prompt")])
def test_steering(operator, positions):
    model = peft.get_peft_model(_tiny_llama(num_hidden_layers=2), steering.SteeringConfig(
        layers=[0, 1], operator=operator, positions=positions, multiplier=2.0))
    with torch.no_grad():
        for param in _trainable(model).values():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    model.train()
    assert_compiled_matches_eager(model, _lm_batch(), _lm_loss)


def test_steering_inference_path():
    # Without gradients the layer adds a cached, pre-scaled vector (the decoding hot path): compiled = eager.
    model = peft.get_peft_model(_tiny_llama(num_hidden_layers=2), steering.SteeringConfig(layers=[0, 1],
                                                                                          positions="prompt"))
    model.base_model.model.model.layers[1].set_vector("default", torch.linspace(-1, 1, 64))
    batch = {k: v for k, v in _lm_batch().items() if k != "labels"}
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(**batch).logits
        for _ in range(2):
            torch.testing.assert_close(compiled(**batch).logits, eager, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), model.disable_adapter():
        assert not torch.allclose(model(**batch).logits, eager)  # the vector does act


def test_pct(tmp_path):
    gen = torch.Generator().manual_seed(0)
    prompts = {f"src{i}": torch.randn(4, 64, generator=gen) * 0.5 for i in range(3)}
    pt.save_decomposition(pt.decompose(prompts, contrastive_steps=5), str(tmp_path / "dec"))
    model = peft.get_peft_model(_tiny_llama(), pt.PCTConfig(task_type="CAUSAL_LM",
                                                            decomposition_path=str(tmp_path / "dec")))
    with torch.no_grad():  # away from the uniform-attention init, so that every PCT parameter gets a gradient
        for param in _trainable(model).values():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.train()
    assert_compiled_matches_eager(model, _lm_batch(), _lm_loss)
