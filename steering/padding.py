"""Batches of token-id lists, padded: one implementation for extraction, training and evaluation."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_token_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS token (Llama and GPT-2 tokenizers ship without a
    pad token), else 0. Padded positions are masked, so the value only has to be a valid id.

    Args:
        tokenizer: The tokenizer.
    """
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``seqs`` padded to the longest, as CPU ``long`` tensors.

    Right padding keeps every real token at its unpadded position (absolute position embeddings too); left padding
    lets ``generate`` continue every row from its last token.

    Args:
        seqs: Token ids per row (an empty row is all padding).
        pad_id: The id of padded positions (:func:`pad_token_id`).
        left: Pad on the left instead of the right.
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, span] = torch.tensor(list(s), dtype=torch.long)
        mask[i, span] = 1
    return ids, mask
