"""OFTv2 on ``nn.Embedding``: the rotation acts on the embedding dimension of the looked-up vectors.

``y = E[ids] R`` (``E``: num_embeddings × dim, ``R`` block-diagonal over ``dim``), as PEFT's OFT ``Embedding``
(PEFT >= 0.19) computes it: the rotation sits on the layer's *output*, since a token id has no vector to rotate.
Merge: ``E ← E R₁ … Rₙ`` (every row rotated); unmerge by the exact inverse, as for Linear.

An embedding tied to an output head (``tie_word_embeddings``) shares its weight with that head, so merging
rotates the head's weight too; PEFT's OFT behaves the same. Keep such models unmerged or untie them first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import OFTv2Config
from .layer import OFTv2Layer, OFTv2Module, type_dispatcher


class Embedding(OFTv2Module):
    """OFTv2 around ``nn.Embedding``: ``y = embedding(ids) R₁ … Rₙ`` (rotation width ``embedding_dim``).

    Args:
        base_layer: The ``nn.Embedding`` to adapt.
        adapter_name: Name of the first adapter.
        config: Its configuration.
        **kwargs: ``layer_name`` for error messages.
    """

    rotates_output = True
    width_label = "embedding dimension"

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: OFTv2Config, **kwargs) -> None:
        super().__init__()
        OFTv2Layer.__init__(self, base_layer, **kwargs)
        base = self.get_base_layer()
        # PEFT's convention for embeddings: in_features is the rotated (embedding) dimension.
        self.in_features, self.out_features = base.embedding_dim, base.num_embeddings
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.adapters_bypassed():
            return self.base_layer(x, *args, **kwargs)
        # rotate_input rotates the last dimension by the active adapters: here the looked-up vectors.
        return self.rotate_input(self.base_layer(x, *args, **kwargs))

    def __repr__(self) -> str:
        return "oftv2." + super().__repr__()


dispatch_embedding = type_dispatcher(nn.Embedding, Embedding)
