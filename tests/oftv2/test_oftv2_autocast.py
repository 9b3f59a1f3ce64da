"""OFTv2 under ``torch.autocast`` (what Lightning's ``precision: bf16-mixed`` and HF ``Trainer(bf16=True)`` run).

The rotation keeps its own compute dtype under autocast: the input a base layer receives, and the gradient of the
adapter through it, equal those computed without autocast bit for bit, on every path (torch Function, shared
block, stacked rotations, Triton in interpreter mode, the composed references of the other forms), with
``backward()`` called inside the autocast block or after it (inside it, the composed references' native backward
follows autocast, as any model's does). Before the fix the Function paths failed on the first step ("Expected out
tensor to have dtype BFloat16") and the references rotated in bf16. A Lightning ``bf16-mixed`` fit of the tiny
Llama trains (QOFT on nf4 too), and a compiled model called under autocast equals eager.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from oftv2_helpers import MixedLayers, randomize_q
from peft import get_peft_model
from torch import nn

import oftv2
from peftplug.data import CausalLMData
from peftplug.lightning import PeftModule

PATHS = {
    "torch": {"kernel_impl": "torch"},
    "block_share": {"kernel_impl": "torch", "block_share": True},
    "stacked": {"kernel_impl": "torch", "stack_rotations": True},
    "triton": {"kernel_impl": "triton"},
    # The composed references (no single Function): longer series, exact Cayley, PEFT's product form.
    "terms6": {"kernel_impl": "torch", "neumann_terms": 6},
    "exact_cayley": {"kernel_impl": "torch", "orthogonalization": "cayley"},
    "peft_cn": {"kernel_impl": "torch", "orthogonalization": "peft_cn"},
}
# Paths whose backward is PyTorch's own (native ops): called inside the autocast block it runs in autocast's dtype,
# as it would for any model (PyTorch advises against backward under autocast). Our hand-written backwards do not.
NATIVE_BACKWARD = {"terms6", "exact_cayley", "peft_cn"}


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _model(path: str, dtype: torch.dtype) -> nn.Module:
    if path == "triton":
        pytest.importorskip("triton")
    config = oftv2.OFTv2Config(block_size=4, target_modules=["a", "b"], **PATHS[path])
    model = get_peft_model(TwoLinear().to(dtype), config)
    randomize_q(model, std=0.1)
    return model.to(dtype)


def _rotated_inputs_and_grads(model, x, autocast_dtype, backward_inside: bool):
    """The inputs both base layers received, and dL/dQ for a loss of layer a's input alone (no base product on its
    path: a's gradient then comes from the rotation only)."""
    seen = []
    hooks = [layer.base_layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
             for layer in (model.base_model.model.a, model.base_model.model.b)]
    model.zero_grad()
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        model(x)
        loss = (seen[0].float() * torch.linspace(-1, 1, seen[0].shape[-1])).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [s.detach() for s in seen], grads


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after", "backward-inside"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-model", "bf16-model"])
def test_rotation_under_autocast_equals_rotation_without(path, dtype, backward_inside):
    model = _model(path, dtype)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_inputs, ref_grads = _rotated_inputs_and_grads(model, x, None, backward_inside)
    inputs, grads = _rotated_inputs_and_grads(model, x, torch.bfloat16, backward_inside)
    # Layer a's input is the rotated x in x's dtype. Layer b's follows a's bf16 autocast product, so only its
    # dtype is compared there (its values differ by the base layer's rounding, not ours).
    assert inputs[0].dtype == ref_inputs[0].dtype == dtype
    torch.testing.assert_close(inputs[0], ref_inputs[0], rtol=0, atol=0)
    assert inputs[1].dtype == torch.bfloat16 and ref_inputs[1].dtype == dtype
    name_a = next(n for n in grads if ".a." in n)
    if backward_inside and path in NATIVE_BACKWARD:
        assert (grads[name_a] - ref_grads[name_a]).norm() <= 0.05 * ref_grads[name_a].norm()
    else:
        torch.testing.assert_close(grads[name_a], ref_grads[name_a], rtol=0, atol=0)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("conv_evaluation", ["input", "weight"])
def test_embedding_and_conv_layers_train_under_autocast(conv_evaluation):
    config = oftv2.OFTv2Config(block_size=4, target_modules=["embed", "conv", "proj"], kernel_impl="torch",
                               conv_evaluation=conv_evaluation)
    model = get_peft_model(MixedLayers(), config)
    randomize_q(model, std=0.1)
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(2))

    def grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids).float().square().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "oftv2_Q" in n}

    reference, mixed = grads(False), grads(True)
    for name, grad in mixed.items():
        # bf16 base products: the adapter gradients agree to bf16 precision (relative norm), not bit for bit.
        assert torch.isfinite(grad).all(), name
        assert (grad - reference[name]).norm() <= 0.05 * reference[name].norm() + 1e-6, name


def test_compiled_model_called_under_autocast_equals_eager():
    model = _model("torch", torch.float32)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))

    def step(fn):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x).float().square().sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eager_loss, eager_grads = step(model)
    torch._dynamo.reset()
    # AOTAutograd is where autocast enters the compiled graph (forward and backward); Inductor's code generation of
    # our ops is tests/test_compile_adapters.py::test_oftv2_inductor's. Inductor here cost ~23 s of cold C++
    # compiles in CI for nothing more.
    compiled_loss, compiled_grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch._dynamo.reset()
    # The forward rotation runs in fp32 in both; under compile the backward's products follow autocast
    # (peftplug_kernels/_autocast.py says why), so the gradients agree to bf16 precision.
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for name, grad in compiled_grads.items():
        assert (grad - eager_grads[name]).norm() <= 0.02 * eager_grads[name].norm() + 1e-6, name


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_lightning_bf16_mixed_fit_trains_oftv2(tmp_path, quantization):
    # The precision every recipes/oftv2/*.yaml uses; nf4: QOFT (unfused on CPU: rotation, then bitsandbytes).
    if quantization == "nf4":
        pytest.importorskip("bitsandbytes")
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    module = PeftModule("tiny:llama", peft=oftv2.OFTv2Config(block_size=16, target_modules=["q_proj", "v_proj"]),
                        quantization=quantization, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    data = CausalLMData(train_file=str(tmp_path / "train.jsonl"), prompt_column="prompt",
                        response_column="response", batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    after = dict(module.model.named_parameters())
    assert all(after[n].dtype == torch.float32 for n in before)
    assert any(not torch.equal(before[n], after[n].detach()) for n in before), "nothing trained"
