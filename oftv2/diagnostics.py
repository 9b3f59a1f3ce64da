"""Per-layer health of OFTv2 rotations: orthogonality error and skew norms.

The two Neumann forms approximate the Cayley map by a truncated series that converges only for ||Q||_2 < 1; a
layer past that point no longer applies anything close to a rotation. These checks say which layers are there.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from peftplug_kernels.cayley_neumann.reference import skew_from_triangle

from .config import NEUMANN_FORMS
from .layer import OFTv2Layer


class NeumannDivergenceWarning(RuntimeWarning):
    """A layer's ||Q||_2 >= 1 under a Neumann form: the series does not converge, R is far from orthogonal."""


@dataclass(frozen=True)
class LayerDiagnostics:
    """Health of one adapter on one layer.

    Args:
        layer: Module name.
        adapter: Adapter name.
        form: Orthogonalisation form.
        block_size: b.
        n_blocks: Number of blocks across the width.
        orth_error: ||RᵀR − I||_F of the whole block-diagonal R (a shared block counts ``n_blocks`` times).
        q_spectral_norm: max over blocks of ||Q_i||_2 (after the ``max_q_norm`` bound, i.e. what the forward uses).
    """

    layer: str
    adapter: str
    form: str
    block_size: int
    n_blocks: int
    orth_error: float
    q_spectral_norm: float

    @property
    def diverging(self) -> bool:
        """Whether the Neumann series of this layer fails to converge."""
        return self.form in NEUMANN_FORMS and self.q_spectral_norm >= 1.0


def layer_diagnostics(layer: OFTv2Layer, adapter: str, name: str = "") -> LayerDiagnostics:
    """Diagnostics of one adapter on one layer (computed in fp64, without dropout).

    Args:
        layer: An OFTv2 layer.
        adapter: Adapter name.
        name: Module name to report.
    """
    b = layer.oftv2_block_size[adapter]
    n_blocks = layer.oftv2_n_blocks[adapter]
    with torch.no_grad():
        rotation = layer.get_rotation(adapter).double()
        eye = torch.eye(b, dtype=torch.float64, device=rotation.device)
        per_block = torch.linalg.matrix_norm(rotation.transpose(-1, -2) @ rotation - eye) ** 2
        # A shared block repeats n_blocks times on the diagonal of the full R.
        total = per_block.sum() * (n_blocks if per_block.numel() == 1 else 1)
        q = skew_from_triangle(layer.effective_q(adapter).double(), b)
        q_norm = torch.linalg.matrix_norm(q, ord=2).max()
    return LayerDiagnostics(
        layer=name,
        adapter=adapter,
        form=layer.oftv2_settings[adapter].form,
        block_size=b,
        n_blocks=n_blocks,
        orth_error=math.sqrt(float(total)),
        q_spectral_norm=float(q_norm),
    )


def rotation_diagnostics(
    model: nn.Module, adapter: str | None = None, warn: bool = True
) -> list[LayerDiagnostics]:
    """Reports ||RᵀR − I||_F and ||Q||_2 for every OFTv2 layer of ``model``.

    Args:
        model: A model containing OFTv2 layers (a ``PeftModel`` or the tuned model itself).
        adapter: Only this adapter (default: every adapter of every layer).
        warn: Emit one :class:`NeumannDivergenceWarning` listing the layers whose ||Q||_2 >= 1 under a Neumann form.

    Returns:
        One :class:`LayerDiagnostics` per (layer, adapter), in module order.
    """
    reports = []
    for name, module in model.named_modules():
        if not isinstance(module, OFTv2Layer):
            continue
        for adapter_name in module.oftv2_Q:
            if adapter is None or adapter_name == adapter:
                reports.append(layer_diagnostics(module, adapter_name, name))
    bad = [r for r in reports if r.diverging]
    if warn and bad:
        listed = ", ".join(f"{r.layer}[{r.adapter}] ||Q||_2={r.q_spectral_norm:.3f}" for r in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        warnings.warn(
            f"{len(bad)} OFTv2 layer(s) have ||Q||_2 >= 1, where the Cayley–Neumann series diverges: {listed}{more}. "
            "Lower the learning rate, set max_q_norm < 1, or use orthogonalization='cayley'.",
            NeumannDivergenceWarning,
            stacklevel=2,
        )
    return reports


def format_diagnostics(reports: list[LayerDiagnostics]) -> str:
    """A plain-text table of :func:`rotation_diagnostics` output.

    Args:
        reports: The reports.
    """
    lines = [f"{'layer':60s} {'adapter':10s} {'form':15s} {'b':>4s} {'|RtR-I|_F':>11s} {'|Q|_2':>8s}"]
    for r in reports:
        flag = "  DIVERGES" if r.diverging else ""
        lines.append(
            f"{r.layer[-60:]:60s} {r.adapter[:10]:10s} {r.form:15s} {r.block_size:4d} "
            f"{r.orth_error:11.3e} {r.q_spectral_norm:8.4f}{flag}"
        )
    return "\n".join(lines)
