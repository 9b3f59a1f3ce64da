"""Models the seq2seq (encoder-decoder) tests share: a tiny BART, and seeded noise that makes a tiny model answer."""

from __future__ import annotations

import torch

from peftplug.tiny import CHAR_VOCAB_SIZE


def shaken(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """The model with seeded noise on every weight: a freshly initialised tiny model answers with padding only.

    Args:
        model: The model (changed in place and returned).
        seed: Seed of the noise.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp(min=0.05))
    return model


def tiny_bart(positions: int = 64) -> torch.nn.Module:
    """A tiny BART for the char tokenizer (learned absolute positions: padding on the wrong side would change its
    answers, and its encoder and decoder each have a table of ``positions`` to run past).

    Args:
        positions: ``max_position_embeddings`` (the size of each table).
    """
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=CHAR_VOCAB_SIZE, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=None, forced_bos_token_id=None,
                        init_std=0.5)  # wide weights: answers of several tokens, not EOS at once
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BartForConditionalGeneration(config).eval()
