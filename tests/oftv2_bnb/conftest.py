"""Fixtures for the QOFT tests: tiny Llama checkpoints loaded through transformers' bitsandbytes integration.

The fused-kernel test runs Triton's interpreter on CPU, which must be enabled before the kernel modules are first
imported (see tests/kernels/conftest.py): set it here too, so this directory also works on its own.
"""

from __future__ import annotations

import os

import pytest
import torch

# On a CUDA machine PEFTPLUG_KERNELS_ON_GPU=1 (benchmarks/gpu/run_all.sh sets it) runs these tests on the GPU:
# models are quantized there by bitsandbytes' CUDA kernels and the fused path uses compiled Triton kernels.
ON_GPU = os.environ.get("PEFTPLUG_KERNELS_ON_GPU") == "1" and torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def device() -> str:
    """Where the quantized models of these tests live: ``cuda`` with ``PEFTPLUG_KERNELS_ON_GPU=1``, else ``cpu``."""
    return DEVICE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A saved tiny random Llama (hidden 64, widths multiple of the 64-element quantization block)."""
    from peftplug.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", seed=0).save_pretrained(path)
    return path


@pytest.fixture
def load_quantized(tiny_checkpoint):
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
        return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, quantization_config=qconfig, device_map=DEVICE)

    return load


@pytest.fixture
def batch():
    """Fixed token ids for the char-vocabulary tiny models."""
    ids = torch.randint(4, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids.to(DEVICE)}


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
