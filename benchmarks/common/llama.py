"""The random Llama-shaped models several studies time (only shapes matter, not weights), their linear layers, and
their 4-bit versions (bitsandbytes ``Linear4bit`` in place of the decoder's linear layers)."""

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


def llama_of_shape(shape: dict, device, dtype: torch.dtype, max_positions: int = 2048, seed: int = 0) -> nn.Module:
    """A randomly initialised, frozen Llama of an exact shape, built on ``device`` in ``dtype`` (the GPU step
    benchmarks compare against published shapes: TinyLlama's 1.1B, 7B-class widths).

    Args:
        shape: ``LlamaConfig`` fields (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``).
        device: Where the weights are created (initialising 1.1B parameters on a GPU takes a second, on a CPU
            a minute).
        dtype: Weight dtype.
        max_positions: ``max_position_embeddings``.
        seed: Initialisation seed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=max_positions)).to(dtype)
    return model.requires_grad_(False)


def quantize_linears_(model: nn.Module, dtype: torch.dtype, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Replaces every ``nn.Linear`` of a Llama's decoder layers by a bitsandbytes ``Linear4bit`` holding the same
    weight, quantized on the layer's device (the lm head and embeddings stay as they are, as with
    ``BitsAndBytesConfig``). bitsandbytes' in-place CPU repacking is switched off, so that adapters see exact
    4-bit weights on any CPU.

    Args:
        model: A ``LlamaForCausalLM``.
        dtype: Compute dtype of the 4-bit layers.
        quant_type: ``nf4`` or ``fp4``.
        double_quant: Quantize the scales too (``compress_statistics``).

    Returns:
        How many layers were replaced.
    """
    import bitsandbytes as bnb

    layers, replaced = model.model.layers, 0
    for name, module in list(layers.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, bnb.nn.Linear4bit):
            continue
        parent = layers.get_submodule(name.rpartition(".")[0]) if "." in name else layers
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=dtype, quant_type=quant_type, compress_statistics=double_quant,
                              device="meta")
        q.weight = bnb.nn.Params4bit(module.weight.data.to(dtype), requires_grad=False, quant_type=quant_type,
                                     compress_statistics=double_quant, module=q)
        if module.bias is not None:
            q.bias = nn.Parameter(module.bias.data, requires_grad=False)
        q = q.to(module.weight.device)
        q.support_avx512bf16_for_cpu = False
        setattr(parent, name.rpartition(".")[2], q)
        replaced += 1
    return replaced
