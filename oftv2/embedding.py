"""OFTv2 on ``nn.Embedding``: the rotation acts on the embedding dimension of the looked-up vectors.

``y = E[ids] R`` (``E``: num_embeddings × dim, ``R`` block-diagonal over ``dim``), as PEFT's OFT ``Embedding``
(PEFT >= 0.19) computes it: the rotation sits on the layer's *output*, since a token id has no vector to rotate.
Merge: ``E ← E R₁ … Rₙ`` (every row rotated); unmerge by the exact inverse, as for Linear.

With ``max_norm`` the bound applies to the rotated vectors, ``renorm(E[ids] R)``, which is what the merged table
computes (``F.embedding`` rescales rows of ``E R`` in place). Bounding ``E[ids]`` and rotating afterwards (the base
layer's lookup, as PEFT's OFT does) gives another result unless the norm is rotation-invariant: ``norm_type`` other
than 2, or a Neumann ``R`` that is only nearly orthogonal, made the merged model differ from the unmerged one.

An embedding tied to an output head (``tie_word_embeddings``) shares its weight with that head, so merging
rotates the head's weight too; PEFT's OFT behaves the same. Keep such models unmerged or untie them first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
        # (Only around the plain nn.Embedding: a wrapper in between would be bypassed by the lookup done here.)
        if self.get_base_layer().max_norm is not None and self.base_layer is self.get_base_layer():
            return self._bounded_forward(x)
        # rotate_input rotates the last dimension by the active adapters: here the looked-up vectors.
        return self.rotate_input(self.base_layer(x, *args, **kwargs))

    def _bounded_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``renorm(E[ids] R)`` for a base with ``max_norm``: what the merged table computes.

        Like ``F.embedding``, vectors whose ``norm_type``-norm exceeds ``max_norm`` are scaled by
        ``max_norm / (norm + 1e-7)`` (no gradient through the scale) and the table rows are rescaled in place, here
        the rows of ``E`` by the same factor, so that ``E R`` stays the table a merged layer would hold.

        Args:
            x: Token ids.
        """
        base = self.get_base_layer()
        rows = F.embedding(x, base.weight, base.padding_idx, None, base.norm_type, base.scale_grad_by_freq, base.sparse)
        out = self.rotate_input(rows)
        with torch.no_grad():
            norms = torch.linalg.vector_norm(out.float(), ord=base.norm_type, dim=-1, keepdim=True)
            over = norms > base.max_norm
            scale = torch.where(over, base.max_norm / (norms + 1e-7), torch.ones_like(norms))
            # Every looked-up row is written back (unbounded ones unchanged, repeated ids with equal values): no
            # data-dependent branch or shape.
            scaled = (rows * scale.to(rows.dtype)).reshape(-1, rows.shape[-1]).to(base.weight.dtype)
            base.weight.index_copy_(0, x.reshape(-1), scaled)
        return out * scale.to(out.dtype)

    def __repr__(self) -> str:
        return "oftv2." + super().__repr__()


dispatch_embedding = type_dispatcher(nn.Embedding, Embedding)
