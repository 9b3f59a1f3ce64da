"""``oftv2.bnb.merge_and_export_full_precision`` on an 8-bit (LLM.int8()) base loaded through transformers (CPU):
the exported layers take the dtype the model was loaded in, so the export runs and computes what the adapter did."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from oftv2_helpers import randomize_q

import oftv2
from oftv2 import bnb as qoft

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny random Llama (widths multiples of 64, as bitsandbytes' blocks need)."""
    from peftplug.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny_llama_8bit")
    tiny_model("llama", seed=0).save_pretrained(path)
    return path


def _adapted_8bit(checkpoint, dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    base = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                device_map="cpu", dtype=dtype)
    model = peft.get_peft_model(base, oftv2.OFTv2Config(block_size=16, target_modules="all-linear",
                                                        kernel_impl="torch"))
    randomize_q(model, std=0.05)
    assert any(isinstance(m, qoft.Linear8bitLt) for m in model.modules())
    return model


def _logits(model, tokens):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' "inputs will be cast" notes
        return model(tokens).logits.float()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_8bit_export_takes_the_loaded_dtype_and_matches_the_adapter(checkpoint, tokens, dtype):
    model = _adapted_8bit(checkpoint, dtype).eval()
    adapter = _logits(model, tokens)
    with model.disable_adapter():
        base = _logits(model, tokens)
    exported = qoft.merge_and_export_full_precision(model)
    assert not any(isinstance(m, (bnb.nn.Linear8bitLt, oftv2.OFTv2Layer)) for m in exported.modules())
    assert {p.dtype for p in exported.parameters()} == {dtype or torch.float32}
    full = _logits(exported, tokens)
    # The unmerged 8-bit forward quantizes its inputs to int8 too; the export does not: a small difference, far
    # below what the adapter changes.
    scale = (adapter - base).norm()
    assert (full - adapter).norm() < 0.05 * scale, ((full - adapter).norm() / scale)


def test_8bit_export_equals_the_dequantized_adapter(checkpoint, tokens):
    # In train mode (no dropout in the tiny model) bitsandbytes' CPU path multiplies with the dequantized fp32
    # weight: the export, which folds the rotation into that weight, then equals the adapter to fp32 rounding.
    model = _adapted_8bit(checkpoint, None).train()
    adapter = _logits(model, tokens)
    exported = qoft.merge_and_export_full_precision(model)
    assert not getattr(exported, "is_loaded_in_8bit", False)
    torch.testing.assert_close(_logits(exported, tokens), adapter, rtol=1e-4, atol=1e-4)


def test_an_explicit_dtype_still_wins(checkpoint, tokens):
    exported = qoft.merge_and_export_full_precision(_adapted_8bit(checkpoint, torch.bfloat16), dtype=torch.float32)
    layer = exported.model.layers[0].self_attn.q_proj
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32
