"""A folder saved already 4-bit quantized (e.g. ``peftplug export --merge`` of a QOFT run) and loaded with the default
``quantization="none"`` still gets bitsandbytes' 4-bit layers: they must be kept in the exact layout as when peftplug
quantizes the model itself (peftplug.quantized_layout)."""

from __future__ import annotations

import pytest
import torch

from peftplug.loading import load_model
from peftplug.quantized_layout import REPACK_SWITCH, four_bit_layers, is_repacked
from peftplug.tiny import char_tokenizer, tiny_model


def test_a_prequantized_folder_loaded_without_quantization_keeps_the_exact_layout(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", seed=0).save_pretrained(tmp_path / "fp32")
    char_tokenizer().save_pretrained(tmp_path / "fp32")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp32", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    quantized.save_pretrained(tmp_path / "nf4")
    char_tokenizer().save_pretrained(tmp_path / "nf4")

    model = load_model(str(tmp_path / "nf4"), task="causal_lm")
    layers = list(four_bit_layers(model))
    assert layers  # the saved quantization config made them 4-bit
    assert all(getattr(layer, REPACK_SWITCH, False) is False for _, layer in layers)
    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()(input_ids=ids)  # the eval forward that repacks unprotected layers on AVX512-BF16 CPUs
    assert not any(is_repacked(layer) for _, layer in layers)
