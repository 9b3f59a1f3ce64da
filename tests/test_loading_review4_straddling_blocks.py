"""4-bit layers whose ``in_features`` is not a multiple of the quantization blocksize: bitsandbytes 0.50's AVX512
CPU kernels compute them with a scrambled weight (QOFT-adapted layers decode their weight themselves, oftv2.bnb), so
every other such layer of a model peftplug protects warns once, at the first CPU forward that runs the kernel,
naming the layer; models without such layers, and layers QOFT adapts, stay silent. On an AVX2-only CPU bitsandbytes
takes its scalar path, which is exact: nothing warns there (it warned on every such model, falsely)."""

from __future__ import annotations

import copy
import io
import warnings

import peft
import pytest
import torch

pytest.importorskip("bitsandbytes")

import oftv2
from peftplug.loading import load_model
from peftplug.quantized_layout import cpu_dequantize_restarts_blocks
from peftplug.tiny import tiny_model
from peftplug_kernels import ops

IDS = torch.tensor([[5, 9, 14, 20]])
#: Whether this CPU's bitsandbytes kernel scrambles a width-96 nf4 layer (AVX512: yes; AVX2-only: no).
SCRAMBLES = cpu_dequantize_restarts_blocks(96, 64, "nf4")
#: How many warnings one model gives: one where the kernel scrambles, none where it is exact.
WARNED = 1 if SCRAMBLES else 0


@pytest.fixture(scope="module")
def wide96(tmp_path_factory):
    """A tiny Llama of width 96 (not a multiple of bitsandbytes' 4-bit blocksize 64) saved as a folder, and the
    model itself (the fp32 reference weights)."""
    folder = tmp_path_factory.mktemp("wide96")
    model = tiny_model("llama", seed=0, hidden_size=96, intermediate_size=160)
    model.save_pretrained(folder)
    return str(folder), model


def _straddle_warnings(model, train: bool = False) -> list[str]:
    """The block-straddling warnings of one eval forward (and, with ``train``, one training forward after it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.eval()(input_ids=IDS)
        if train:
            logits = model.train()(input_ids=IDS).logits
            if logits.requires_grad:  # a bare quantized model has no trainable weight
                logits.sum().backward()
    return [str(w.message) for w in caught if "multiple of the blocksize" in str(w.message)]


def test_the_kernel_is_wrong_on_such_a_layer_exactly_where_the_probe_says_and_the_first_forward_says_so_once(wide96):
    folder, original = wide96
    model = load_model(folder, quantization="nf4")
    layer = model.model.layers[0].self_attn.k_proj
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    reference = x @ original.model.layers[0].self_attn.k_proj.weight.detach().T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            kernel = layer(x)
    decoded = x @ ops.dequantize_4bit(layer.weight.data, layer.weight.quant_state, torch.float32).T
    # Why the warning exists: the kernel's error is far above nf4's own (what decoding the stored weight gives).
    error = ((kernel - reference).norm() / reference.norm()).item()
    own = ((decoded - reference).norm() / reference.norm()).item()
    assert own < 0.13 and (error > 1.5 * own) == SCRAMBLES, (error, own, SCRAMBLES)
    if not SCRAMBLES:  # the scalar path decodes the stored weight as it is
        torch.testing.assert_close(kernel, decoded, rtol=1e-5, atol=1e-5)

    fresh = load_model(folder, quantization="nf4")
    messages = _straddle_warnings(fresh, train=True)
    assert len(messages) == WARNED, messages  # once per model, not once per layer or per forward
    if not SCRAMBLES:
        return
    assert "'model.layers.0.self_attn.q_proj' (in_features 96, not a multiple of the blocksize 64)" in messages[0]
    assert "model.layers.0.self_attn.k_proj" in messages[0] and "and 10 more" in messages[0]
    assert _straddle_warnings(fresh) == []


def test_layers_qoft_adapts_are_not_named_and_the_untouched_ones_are(wide96):
    folder, _ = wide96
    everywhere = peft.get_peft_model(load_model(folder, quantization="nf4"),
                                     oftv2.OFTv2Config(block_size=8, target_modules="all-linear"))
    assert _straddle_warnings(everywhere, train=True) == []
    some = peft.get_peft_model(load_model(folder, quantization="nf4"),
                               oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"]))
    messages = _straddle_warnings(some)
    assert len(messages) == WARNED, messages
    assert not SCRAMBLES or messages[0].startswith("4-bit layer 'model.layers.0.self_attn.k_proj'"), messages


def test_lora_on_such_layers_runs_the_kernel_and_is_warned_about(wide96):
    folder, _ = wide96
    model = peft.get_peft_model(load_model(folder, quantization="nf4"), peft.LoraConfig(target_modules="all-linear"))
    messages = _straddle_warnings(model)
    assert len(messages) == WARNED, messages
    if SCRAMBLES:
        assert "'base_model.model.model.layers.0.self_attn.q_proj" not in messages[0]
        assert messages[0].startswith("4-bit layer 'model.layers.0.self_attn.q_proj'")


def test_a_model_whose_blocks_fit_its_rows_stays_silent_and_copies():
    model = load_model("tiny:llama", quantization="nf4")  # widths 64 and 128
    assert not any(module._forward_pre_hooks for module in model.modules())
    assert _straddle_warnings(model, train=True) == []


def test_a_warned_model_still_deep_copies_and_pickles(wide96):
    folder, _ = wide96
    model = load_model(folder, quantization="nf4")
    copied = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    assert len(_straddle_warnings(copied)) == WARNED
    assert len(_straddle_warnings(model)) == WARNED  # the copy's warning is its own

