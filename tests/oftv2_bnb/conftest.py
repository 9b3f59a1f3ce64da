"""Fixtures for the QOFT tests: tiny Llama checkpoints loaded through transformers' bitsandbytes integration, on
the ``device`` of tests/conftest.py (CPU with the Triton interpreter, or CUDA with ``PEFTPLUG_KERNELS_ON_GPU=1``).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A saved tiny random Llama (hidden 64, widths multiple of the 64-element quantization block) with its tokenizer."""
    from peftplug.tiny import char_tokenizer, tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", seed=0).save_pretrained(path)
    char_tokenizer().save_pretrained(path)  # so PeftModule can load it by path, like any saved model
    return path


@pytest.fixture
def load_quantized(tiny_checkpoint, device):
    """Factory: ``load_quantized(bits=4, quant_type="nf4", double_quant=False, compute_dtype=torch.float32)``."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging

    def load(bits=4, quant_type="nf4", double_quant=False, compute_dtype=torch.float32):
        if bits == 4:
            qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                         bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype)
        else:
            qconfig = BitsAndBytesConfig(load_in_8bit=True)
        logging.disable_progress_bar()
        return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, quantization_config=qconfig, device_map=device)

    return load


@pytest.fixture
def batch(device):
    """Fixed token ids for the char-vocabulary tiny models."""
    ids = torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids.to(device)}


def randomize_q(model, std: float, seed: int = 0) -> None:
    """Fills every OFTv2 parameter with N(0, std²), so rotations differ clearly from the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "oftv2_Q" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


@pytest.fixture
def randomize():
    """``randomize(model, std)``: see :func:`randomize_q`."""
    return randomize_q
