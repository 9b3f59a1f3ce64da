"""Decomposition of source prompts into a task-agnostic ``P_0`` and task-specific ``S_k`` (SVD + InfoNCE).

Given ``K`` source prompts ``P_k`` (``l x d`` each), flattened to the rows of ``X`` (``K x l*d``):

1. SVD ``X = U diag(s) V^T``; keep the top ``r`` right singular vectors ``V_r`` (``r`` explicit, or the
   smallest rank whose singular values explain a given share of ``sum s^2``). The shared subspace is
   ``span(V_r)``; every prompt is projected into it, ``Xr_k = X_k V_r V_r^T`` (exact at full rank ``r = rank X``).
2. ``P_0`` = the mean of the projected prompts (what all sources share inside that subspace);
   ``S_k = Xr_k - P_0`` (what is specific to source ``k``). So ``P_0 + S_k = Xr_k``.
3. Contrastive refinement (optional): ``P_0`` and ``S_k`` are tuned to minimise
   ``mean_k ||P_0 + S_k - Xr_k||^2 / ||Xr_k||^2 + w * InfoNCE`` (each source's error relative to its own size),
   where the InfoNCE term takes each ``S_k`` as anchor, its SVD value as positive, and the other ``S_j`` and ``P_0`` as negatives (cosine similarities over
   the flattened prompts). It pulls redundant directions out of the ``S_k`` while the first term keeps the
   sources reconstructible. Skipped when every ``S_k`` is 0 (``K = 1``, identical sources): nothing to contrast.

The result is saved as ``decomposition.safetensors`` + ``decomposition.json`` (settings and diagnostics).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from peftplug.fileio import atomic_write
from peftplug.validation import check_int, check_real, python_number

TENSORS_FILE = "decomposition.safetensors"
META_FILE = "decomposition.json"
FORMAT_VERSION = 1


@dataclass
class Decomposition:
    """A decomposition of ``K`` source prompts.

    Args:
        p0: Task-agnostic prompt, ``[l, d]``.
        specific: Task-specific prompts ``S_k``, ``[K, l, d]``.
        source_names: One name per source task.
        rank: The SVD rank ``r`` that was kept.
        settings: The arguments :func:`decompose` ran with, plus diagnostics (explained variance, losses).
    """

    p0: torch.Tensor
    specific: torch.Tensor
    source_names: list[str]
    rank: int
    settings: dict = field(default_factory=dict)

    @property
    def num_sources(self) -> int:
        """Number of source tasks ``K``."""
        return self.specific.shape[0]

    def reconstruct(self) -> torch.Tensor:
        """The reconstructed source prompts ``P_0 + S_k``, ``[K, l, d]``."""
        return self.p0.unsqueeze(0) + self.specific


def info_nce(anchors: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
             temperature: float, negative_mask: torch.Tensor | None = None,
             eps: float | torch.Tensor = 1e-12) -> torch.Tensor:
    """InfoNCE over cosine similarities of flattened vectors.

    Args:
        anchors: ``[N, D]``.
        positives: ``[N, D]``; row ``i`` is the positive of anchor ``i``.
        negatives: ``[M, D]`` shared negatives.
        temperature: Softmax temperature (> 0).
        negative_mask: Optional ``[N, M]`` bool mask; ``False`` removes a negative for that anchor (e.g. itself).
        eps: Smallest norm a vector is divided by (``x / max(|x|, eps)``). The cosine of a vector near zero has a
            gradient of ``1/|x|``; a caller whose vectors can start at zero passes an ``eps`` on their own scale
            so the loss stays smooth there (it tends to ``log(1 + M)`` as the anchor shrinks to zero).

    Returns:
        The mean loss ``-log(exp(cos(a,p)/t) / (exp(cos(a,p)/t) + sum_n exp(cos(a,n)/t)))``.
    """

    def unit(x: torch.Tensor) -> torch.Tensor:  # F.normalize, with an eps that may be a tensor
        return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)

    a = unit(anchors)
    pos = (a * unit(positives)).sum(-1, keepdim=True) / temperature
    neg = a @ unit(negatives).T / temperature
    if negative_mask is not None:
        neg = neg.masked_fill(~negative_mask, float("-inf"))
    logits = torch.cat([pos, neg], dim=1)
    return (torch.logsumexp(logits, dim=1) - pos.squeeze(1)).mean()


def decomposition_infonce(p0: torch.Tensor, specific: torch.Tensor, positives: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """The decomposition's InfoNCE: each ``S_k`` near its positive, away from the other ``S_j`` and ``P_0``.

    Args:
        p0: ``[l, d]``.
        specific: ``[K, l, d]``.
        positives: ``[K, l, d]`` (the SVD values of ``S_k``).
        temperature: InfoNCE temperature.
    """
    k = specific.shape[0]
    flat = specific.reshape(k, -1)
    negatives = torch.cat([flat, p0.reshape(1, -1)], dim=0)
    mask = torch.ones(k, k + 1, dtype=torch.bool, device=flat.device)
    mask[torch.arange(k), torch.arange(k)] = False  # an anchor is not its own negative
    return info_nce(flat, positives.reshape(k, -1), negatives, temperature, mask)


def model_id(name: str | None) -> str | None:
    """A comparable identity of a base model name or path (``None``/empty: unknown).

    Local paths compare by their real path (a relative and an absolute spelling of one folder are one model);
    other names (hub ids, ``tiny:llama``) compare as written.

    Args:
        name: ``base_model_name_or_path`` of an adapter, or a model's ``name_or_path``.
    """
    if not name:
        return None
    name = str(name)
    return os.path.realpath(name) if os.path.exists(name) else name.rstrip("/")


def task_key(name: str) -> str:
    """A task name reduced to lower-case letters and digits (``SST-2``, ``sst2`` and ``sst_2`` are one task).

    Args:
        name: A task name.
    """
    return "".join(c for c in str(name).lower() if c.isalnum())


def _stack(prompts: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
    if isinstance(prompts, Mapping):
        names, tensors = list(prompts.keys()), list(prompts.values())
    else:
        tensors = list(prompts)
        names = [f"source_{i}" for i in range(len(tensors))]
    if not tensors:
        raise ValueError("prompts is empty: decompose needs at least one source prompt")
    for name in names:
        # They become PCTConfig.source_names, which refuses anything else: better here than at the target stage.
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"prompts: every source name must be a non-empty string, got {name!r}")
    shapes = [tuple(t.shape) for t in tensors]
    for name, t in zip(names, tensors):
        if t.dim() != 2:
            raise ValueError(f"source prompt {name!r} must be 2-D [num_virtual_tokens, token_dim], got {tuple(t.shape)}")
    if len(set(shapes)) != 1:
        detail = ", ".join(f"{n}: {s}" for n, s in zip(names, shapes))
        raise ValueError(f"source prompts must all have the same [num_virtual_tokens, token_dim]; got {detail}")
    stacked = torch.stack([t.detach().to(torch.float32).cpu() for t in tensors])
    if not torch.isfinite(stacked).all():
        bad = [n for n, t in zip(names, stacked) if not torch.isfinite(t).all()]
        raise ValueError(f"source prompts contain NaN/Inf values: {bad}")
    return stacked, names


def choose_rank(singular_values: torch.Tensor, explained_variance: float) -> int:
    """Smallest rank whose singular values explain at least ``explained_variance`` of ``sum s^2``.

    Args:
        singular_values: Descending singular values.
        explained_variance: Target share in ``(0, 1]``.

    Returns:
        A rank in ``[1, len(singular_values)]``.
    """
    energy = singular_values.double() ** 2
    total = energy.sum()
    if total <= 0:
        # All-zero prompts: rank 1 already reconstructs them exactly (the shares would all be 0, and the search
        # below would run past the last singular value).
        return 1
    share = torch.cumsum(energy, 0) / total
    found = int(torch.searchsorted(share, torch.tensor(explained_variance - 1e-12, dtype=share.dtype)).item()) + 1
    return min(found, len(singular_values))  # rounding can leave the last share a hair below the target


def check_decompose_settings(
    num_sources: int,
    rank: int | None = None,
    explained_variance: float | None = None,
    contrastive_weight: float = 0.1,
    contrastive_steps: int = 200,
    contrastive_temperature: float = 0.5,
    field_prefix: str = "",
) -> None:
    """Checks :func:`decompose`'s settings for ``num_sources`` prompts; the one set of rules for every caller.

    :func:`decompose` runs it on its arguments and the ``train-sources`` recipe check runs it on the recipe's
    ``decompose`` section before the first source trains, so a value is refused up front exactly when
    :func:`decompose` would refuse it after every source has trained.

    Args:
        num_sources: Number of source prompts ``K`` (the upper bound of ``rank``).
        rank: As for :func:`decompose`.
        explained_variance: As for :func:`decompose`.
        contrastive_weight: As for :func:`decompose`.
        contrastive_steps: As for :func:`decompose`.
        contrastive_temperature: As for :func:`decompose`.
        field_prefix: Put before each field name in messages (``"decompose."`` for a recipe section).

    Raises:
        ValueError: Naming the first bad field, its accepted range and the value given.
    """
    p = field_prefix
    if rank is not None and explained_variance is not None:
        raise ValueError(f"give {p}rank or {p}explained_variance, not both")
    if rank is not None:
        check_int(f"{p}rank", rank, 1, num_sources, hint=f"K = {num_sources}, the number of source prompts")
    if explained_variance is not None:
        check_real(f"{p}explained_variance", explained_variance, 0.0, 1.0, low_open=True)
    check_real(f"{p}contrastive_weight", contrastive_weight, low=0.0)
    check_int(f"{p}contrastive_steps", contrastive_steps, low=0)
    check_real(f"{p}contrastive_temperature", contrastive_temperature, low=0.0, low_open=True)


def decompose(
    prompts: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    rank: int | None = None,
    explained_variance: float | None = None,
    contrastive_weight: float = 0.1,
    contrastive_steps: int = 200,
    contrastive_temperature: float = 0.5,
    lr: float = 1e-2,
    base_model: str | None = None,
) -> Decomposition:
    """Decomposes ``K`` source prompts into ``P_0`` and ``S_k`` (see the module docstring).

    Args:
        prompts: The source prompts ``[l, d]`` each, as a sequence or a ``{task name: prompt}`` mapping.
        rank: SVD rank to keep, ``1 <= rank <= K``. Mutually exclusive with ``explained_variance``; when both are
            ``None`` the full rank ``K`` is kept (exact reconstruction).
        explained_variance: Keep the smallest rank explaining this share of ``sum s^2``, in ``(0, 1]``.
        contrastive_weight: Weight ``w`` of the InfoNCE term (0 or ``contrastive_steps=0`` skips refinement).
        contrastive_steps: Adam steps of the refinement.
        contrastive_temperature: InfoNCE temperature (> 0).
        lr: Adam learning rate of the refinement, relative to the prompts' RMS scale (the refinement is
            deterministic: it starts from the SVD solution).
        base_model: The base model the source prompts were trained on (recorded in ``settings["base_model"]``; a
            PCT adapter built on another model is then refused, naming both).

    Returns:
        The :class:`Decomposition`.

    Raises:
        ValueError: On an empty list, prompts of different shapes, non-finite values, out-of-range settings or
            a source name that is not a non-empty string.
    """
    x3, names = _stack(prompts)
    k, length, dim = x3.shape
    check_decompose_settings(k, rank, explained_variance, contrastive_weight, contrastive_steps,
                             contrastive_temperature)
    # A tensor or numpy setting passes the checks; the settings are written to JSON as plain numbers.
    rank, explained_variance, contrastive_weight, contrastive_steps, contrastive_temperature = (
        python_number(v) for v in (rank, explained_variance, contrastive_weight, contrastive_steps,
                                   contrastive_temperature))

    x = x3.reshape(k, -1).double()  # float64 SVD: full-rank reconstruction is then exact to ~1e-12
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    if explained_variance is not None:
        rank = choose_rank(s, explained_variance)
    elif rank is None:
        rank = k
    v_r = vh[:rank].T
    projected = (x @ v_r) @ v_r.T
    p0 = projected.mean(0)
    specific = projected - p0
    energy = s**2
    settings = {
        "rank": rank, "explained_variance": explained_variance, "contrastive_weight": contrastive_weight,
        "contrastive_steps": contrastive_steps, "contrastive_temperature": contrastive_temperature, "lr": lr,
        "singular_values": [float(v) for v in s],
        # All-zero prompts are reconstructed exactly at any rank: all of their (zero) energy is kept.
        "explained_variance_kept": float(energy[:rank].sum() / energy.sum()) if energy.sum() > 0 else 1.0,
        "base_model": base_model,
    }
    p0 = p0.float().reshape(length, dim)
    specific = specific.float().reshape(k, length, dim)
    target = projected.float().reshape(k, length, dim)
    if k == 1:
        # One source: S_1 = 0 and there is nothing to contrast it with; refinement would only move P_0.
        settings["contrastive_skipped"] = "single source"
    elif float(specific.norm(dim=1).max()) <= 1e-6 * float(projected.norm(dim=1).max()):
        # Identical (or all-zero) sources: every S_k is 0, so there is nothing task-specific to contrast. The cosine
        # of a zero S_k has a 1e12 gradient: refining moved every S_k off zero by a few percent of the prompt norm
        # along -P_0 (and raised the InfoNCE it minimises), inventing a task-specific part the sources do not have.
        settings["contrastive_skipped"] = "identical sources"
    elif contrastive_weight > 0 and contrastive_steps > 0:
        p0, specific, diag = _refine(p0, specific, target, contrastive_weight, contrastive_steps,
                                     contrastive_temperature, lr)
        settings.update(diag)
    return Decomposition(p0=p0.contiguous(), specific=specific.contiguous(), source_names=names, rank=rank,
                         settings=settings)


def _refine(p0, specific, target, weight, steps, temperature, lr):
    """Adam on the per-source relative reconstruction error + ``w * InfoNCE``; returns the tensors and diagnostics.

    Each source's error counts relative to its own size, ``mean_k ||P_0 + S_k - Xr_k||^2 / ||Xr_k||^2`` (equal to
    ``sum_k ||.||^2 / sum_k ||Xr_k||^2`` when the sources have one norm). Normalising by the pooled size instead let
    a source 3x larger than the others set the scale: the smaller ones came back 2-4% off (10x: 15-19%) while the
    pooled error read 1e-4.
    """
    scale = target.pow(2).mean().clamp_min(1e-12)
    rms = scale.sqrt()
    # Each source's mean square in RMS units (1 on average); the floor keeps an all-zero source finite.
    source_scale = (target / rms).pow(2).flatten(1).mean(1).clamp_min(1e-6)
    positives = specific.clone()
    # Optimise in units of the prompts' RMS so that lr means the same for any embedding scale.
    p0_v = (p0 / rms).clone().requires_grad_(True)
    s_v = (specific / rms).clone().requires_grad_(True)
    opt = torch.optim.Adam([p0_v, s_v], lr=lr)
    with torch.no_grad():
        start_nce = float(decomposition_infonce(p0, specific, positives, temperature))
    for _ in range(steps):
        opt.zero_grad()
        errors = ((p0_v.unsqueeze(0) + s_v) - target / rms).pow(2).flatten(1).mean(1)
        recon = (errors / source_scale).mean()
        nce = decomposition_infonce(p0_v, s_v, positives, temperature)
        loss = recon + weight * nce
        if not torch.isfinite(loss):
            raise FloatingPointError(f"decomposition refinement produced a non-finite loss ({loss.item()})")
        loss.backward()
        opt.step()
    p0_out, s_out = (p0_v.detach() * rms), (s_v.detach() * rms)
    with torch.no_grad():
        sq_err = ((p0_out.unsqueeze(0) + s_out) - target).pow(2).flatten(1).sum(1)
        rel_err = float(sq_err.sum() / target.pow(2).sum().clamp_min(1e-12))
        worst = float((sq_err / target.pow(2).flatten(1).sum(1).clamp_min(1e-12)).max())
        end_nce = float(decomposition_infonce(p0_out, s_out, positives, temperature))
    return p0_out, s_out, {"infonce_start": start_nce, "infonce_end": end_nce, "relative_reconstruction_error": rel_err,
                           "max_source_relative_error": worst}


def save_decomposition(dec: Decomposition, directory: str) -> None:
    """Writes ``decomposition.safetensors`` and ``decomposition.json`` into ``directory`` (atomically per file).

    Args:
        dec: The decomposition.
        directory: Target directory (created if missing).
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {"p0": dec.p0.contiguous().cpu(), "specific": dec.specific.contiguous().cpu()}
    meta = {
        "format_version": FORMAT_VERSION, "num_sources": dec.num_sources, "num_virtual_tokens": dec.p0.shape[0],
        "token_dim": dec.p0.shape[1], "source_names": dec.source_names, "rank": dec.rank, "settings": dec.settings,
    }
    # Tensors first, metadata last: a reader that finds the json finds matching tensors.
    atomic_write(os.path.join(directory, TENSORS_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))

    def write_meta(path: str) -> None:
        with open(path, "w") as f:
            json.dump(meta, f, indent=2)

    atomic_write(os.path.join(directory, META_FILE), write_meta)


def load_decomposition(directory: str) -> Decomposition:
    """Reads a decomposition written by :func:`save_decomposition`.

    Args:
        directory: The directory.

    Raises:
        FileNotFoundError: If a file is missing.
        ValueError: If the files are foreign or inconsistent.
    """
    from safetensors.torch import load_file

    meta_path, tensor_path = os.path.join(directory, META_FILE), os.path.join(directory, TENSORS_FILE)
    for p in (meta_path, tensor_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} not found: {directory} is not a PCT decomposition directory")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        tensors = load_file(tensor_path)
    except Exception as err:  # json, OS and safetensors' own header errors all mean the same to the caller
        raise ValueError(f"corrupt PCT decomposition in {directory}: {err}") from err
    if meta.get("format_version") != FORMAT_VERSION or set(tensors) != {"p0", "specific"}:
        raise ValueError(f"{directory} does not hold a PCT decomposition (format {meta.get('format_version')!r}, "
                         f"tensors {sorted(tensors)})")
    p0, specific = tensors["p0"], tensors["specific"]
    expected = (meta["num_sources"], meta["num_virtual_tokens"], meta["token_dim"])
    if tuple(specific.shape) != expected or tuple(p0.shape) != expected[1:]:
        raise ValueError(f"decomposition tensors in {directory} have shapes p0 {tuple(p0.shape)}, specific "
                         f"{tuple(specific.shape)}; the json says K, l, d = {expected}")
    return Decomposition(p0=p0, specific=specific, source_names=list(meta["source_names"]), rank=meta["rank"],
                         settings=meta.get("settings", {}))
