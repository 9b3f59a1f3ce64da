"""bitsandbytes' CPU repacking of 4-bit weights, case by case: adapters attached before or after the first eval
forward, OFTv2 and PEFT's LoRA; forward, gradients and merge compared with the same adapter on the exactly
dequantized model.

On AVX512-BF16 CPUs bitsandbytes 0.50 repacks a ``Linear4bit`` in place at its first eval forward without
gradients (the ``real`` cases); elsewhere ``_convert_weight_packed_for_cpu`` (plain torch) is called directly to put
the weights in the same state (the ``simulated`` cases), so both kinds of machine test the refusals.
"""

from __future__ import annotations

import peft
import pytest
import torch
from torch import nn

import oftv2
from oftv2 import bnb as qoft
from peftplug.quantized_layout import (
    RepackedWeightError,
    four_bit_layers,
    is_repacked,
    keep_exact_4bit_layout,
    repacked_layers,
)

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def cpu_repacks() -> bool:
    from bitsandbytes.backends.cpu.ops import has_avx512bf16  # what Linear4bit.__init__ consults

    return bool(has_avx512bf16())


def repack(model, how: str, batch) -> None:
    """Puts every 4-bit layer of ``model`` in bitsandbytes' CPU inference layout, as a first forward would."""
    if how == "real":
        if not cpu_repacks():
            pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack here (see the simulated case)")
        model.eval()
        with torch.no_grad():
            model(**batch)
    else:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu

        for _, layer in four_bit_layers(model):
            layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(
                layer.weight.data, layer.weight.quant_state)
    assert repacked_layers(model), "the weights were not repacked"


def dequantized_reference(qmodel, tiny_checkpoint) -> nn.Module:
    """The full-precision model whose linear weights are the exact dequantization of ``qmodel``'s 4-bit weights."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    ref.to(next(qmodel.parameters()).device)  # beside the 4-bit model (cuda with PEFTPLUG_KERNELS_ON_GPU=1)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, layer in four_bit_layers(qmodel):
            assert not is_repacked(layer)
            weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
            # A PeftModel's names carry its wrapper's prefix and the adapted layer's base_layer.
            name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
            modules[name].weight.copy_(weight)
    return ref


def oftv2_config():
    return oftv2.OFTv2Config(block_size=16, target_modules="all-linear", kernel_impl="torch")


def lora_config():
    return peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)


def copy_adapter(src, dst) -> None:
    """Copies the adapter parameters of ``src`` into ``dst`` by name (both PeftModels of the same config)."""
    source = {n: p for n, p in src.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in dst.named_parameters():
            if param.requires_grad:
                param.copy_(source[name])


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("method", ["oftv2", "lora"])
def test_attached_before_the_first_forward_matches_the_dequantized_model(method, load_quantized, tiny_checkpoint,
                                                                         randomize, batch):
    qmodel = load_quantized(4, "nf4", True)
    ref = dequantized_reference(qmodel, tiny_checkpoint)
    if method == "oftv2":
        config = oftv2_config()  # our dispatcher protects the layers it wraps
    else:
        keep_exact_4bit_layout(qmodel)  # what peftplug's loader does for every 4-bit base
        config = lora_config()
    adapted, ref = peft.get_peft_model(qmodel, config), peft.get_peft_model(ref, config)
    if method == "oftv2":
        randomize(adapted, std=0.05)
    copy_adapter(adapted, ref)
    adapted.eval()
    with torch.no_grad():  # the zero-shot check / validation that repacks an unprotected layer
        adapted(**batch)
    assert not repacked_layers(adapted)
    logits, grads = loss_and_grads(adapted, batch)
    ref_logits, ref_grads = loss_and_grads(ref, batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    worst = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < 1e-3, f"adapter gradients differ from the dequantized model's by {worst:.2e}"
    # Merge: OFTv2 folds its rotations into full-precision weights; LoRA's merge into 4-bit requantizes, so it is
    # compared through PEFT's own dequantize -> add -> requantize, against the reference's exact merge.
    with torch.no_grad(), ref.disable_adapter():
        ref_base = ref(**batch).logits
    with torch.no_grad():
        ref_merged = ref.merge_and_unload()(**batch).logits
        if method == "oftv2":
            merged = qoft.merge_and_export_full_precision(adapted)(**batch).logits
            torch.testing.assert_close(merged, ref_merged, rtol=1e-4, atol=1e-4)
        else:
            merged = adapted.merge_and_unload()(**batch).logits
            # Requantization moves weights by up to half a 4-bit step; it must stay nearer the merged reference
            # than the unadapted base is.
            assert (merged - ref_merged).abs().mean() < 0.5 * (ref_base - ref_merged).abs().mean()


@pytest.mark.parametrize("how", ["real", "simulated"])
@pytest.mark.parametrize("method", ["oftv2", "lora"])
def test_attached_after_a_repacking_forward_is_refused(method, how, load_quantized, batch):
    qmodel = load_quantized(4, "nf4", True)
    repack(qmodel, how, batch)
    with pytest.raises(RepackedWeightError, match="repacked in place by an earlier eval forward.*reload the model"):
        if method == "oftv2":
            peft.get_peft_model(qmodel, oftv2_config())
        else:
            keep_exact_4bit_layout(qmodel)  # the check peftplug runs before attaching any adapter type


def test_unprotected_lora_after_a_repacking_forward_gets_wrong_gradients(load_quantized, tiny_checkpoint, batch):
    # Why the refusal exists: bitsandbytes' repacked matmul has no autograd, so gradients stop at each 4-bit layer.
    if not cpu_repacks():
        pytest.skip("only an AVX512-BF16 CPU runs bitsandbytes' repacked matmul")
    qmodel = load_quantized(4, "nf4", True)
    ref = dequantized_reference(qmodel, tiny_checkpoint)
    repack(qmodel, "real", batch)
    adapted, ref = peft.get_peft_model(qmodel, lora_config()), peft.get_peft_model(ref, lora_config())
    copy_adapter(adapted, ref)
    with pytest.warns(UserWarning):
        _, grads = loss_and_grads(adapted, batch)
    _, ref_grads = loss_and_grads(ref, batch)
    total = rel(torch.cat([g.flatten() for g in grads.values()]), torch.cat([g.flatten() for g in ref_grads.values()]))
    assert total > 0.1, f"expected the repacked model's LoRA gradients to be off, got {total:.3f}"


def test_protection_is_idempotent_and_counts_layers(load_quantized, batch):
    qmodel = load_quantized(4, "nf4", False)
    assert keep_exact_4bit_layout(qmodel) == 14
    assert keep_exact_4bit_layout(qmodel) == 14
    qmodel.eval()
    with torch.no_grad():
        qmodel(**batch)
    assert not repacked_layers(qmodel)


def test_models_without_4bit_layers_pass(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    assert keep_exact_4bit_layout(AutoModelForCausalLM.from_pretrained(tiny_checkpoint)) == 0


@pytest.mark.parametrize("method", ["oftv2", "lora"])
def test_peft_module_protects_every_adapter_type_before_any_forward(method, tiny_checkpoint, randomize, batch,
                                                                   device):
    # Through the trainer, with no user mistake: validation / evaluate_before_fit run eval forwards before the
    # first training step. The loader keeps every 4-bit layer exact, so the gradients equal the dequantized model's.
    from peftplug.lightning import PeftModule

    config = oftv2_config() if method == "oftv2" else lora_config()
    module = PeftModule(str(tiny_checkpoint), task="causal_lm", quantization="nf4", peft=config).to(device)
    if method == "oftv2":
        randomize(module.model, std=0.05)
    module.model.eval()
    with torch.no_grad():
        module.model(**batch)  # a plain eval forward outside Lightning
    assert not repacked_layers(module.model)
    ref = peft.get_peft_model(dequantized_reference(module.model, tiny_checkpoint), config)
    copy_adapter(module.model, ref)
    logits, grads = loss_and_grads(module.model, batch)
    ref_logits, ref_grads = loss_and_grads(ref, batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    worst = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < 1e-3, f"adapter gradients differ from the dequantized model's by {worst:.2e}"


@pytest.mark.parametrize("how", ["real", "simulated"])
def test_peft_module_refuses_a_built_model_that_was_repacked(how, load_quantized, batch):
    from peftplug.lightning import PeftModule

    qmodel = load_quantized(4, "nf4", False)
    repack(qmodel, how, batch)
    with pytest.raises(RepackedWeightError, match="reload the model"):
        PeftModule(qmodel, task="causal_lm", peft=lora_config())
