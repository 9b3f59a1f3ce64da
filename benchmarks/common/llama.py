"""The random Llama-shaped models several studies time (only shapes matter, not weights), and its linear layers."""

from __future__ import annotations

import torch
from torch import nn

#: Every linear layer of a Llama decoder block: what the benchmarks adapt (OFTv2, QOFT, LoRA).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(width: int, layers: int, vocab: int, seed: int = 0) -> nn.Module:
    """A randomly initialised Llama of the given width (intermediate ≈ 8/3 width, rounded to a multiple of 64).

    Args:
        width: Hidden size.
        layers: Decoder layers.
        vocab: Vocabulary size.
        seed: Initialisation seed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    inter = round(width * 8 / 3 / 64) * 64
    cfg = LlamaConfig(
        hidden_size=width,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
        vocab_size=vocab,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg)
