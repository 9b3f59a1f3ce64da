"""Instrumenting HELENE's diagonal Hessian estimators on a small real model against backprop references.

The model is MiniLM's pooler + a fresh classifier on cached [CLS] features of a real task (the benchmark's
"head" setting). References, computed exactly by per-example backprop (torch.func):

- ``gn``: the diagonal Gauss–Newton / Fisher matrix, mean over examples of Σ_k p_k(x)·g(x,k)⊙g(x,k) — what
  Sophia's GNB estimates and what A-GNB is meant to approximate;
- ``g2``: the gradient second moment with the true labels (empirical Fisher), mean of g(x,y)⊙g(x,y);
- ``fo_agnb``: A-GNB computed with the *true* minibatch gradient, B·∇L_B⊙∇L_B (the idea without ZO noise).

The zeroth-order estimates are produced by :class:`helene.Helene` itself (lr = 0, β2 = 0 so that ``h`` holds the
newest estimate) on random minibatches, averaged over N draws (HELENE's EMA with β2 = 0.99 averages ≈ 100).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from helene import Helene


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm() + 1e-300))


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    rank = lambda x: torch.argsort(torch.argsort(x.double().flatten())).double()
    return _pearson(rank(a), rank(b))


def references(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, n_batches: int = 200,
               seed: int = 0, chunk: int = 32) -> dict[str, dict[str, torch.Tensor]]:
    """Exact backprop references per parameter tensor: ``gn``, ``g2`` and ``fo_agnb``.

    Args:
        head: The model (inputs ``x`` → logits).
        x: Inputs (N, D).
        y: Labels (N,).
        batch: Minibatch size B of the first-order A-GNB reference.
        n_batches: Minibatches averaged for ``fo_agnb``.
        seed: Minibatch sampling seed.
        chunk: Examples per vectorised per-example-gradient call.
    """
    params = {n: p.detach() for n, p in head.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(head, p, (xi[None],)), yi[None])

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    with torch.no_grad():
        probs = torch.softmax(head(x), -1)
    gn = {n: torch.zeros_like(p) for n, p in params.items()}
    g2 = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(0, len(y), chunk):  # chunks: per-example gradients of all examples would not fit in memory
        xs, ys, ps = x[i:i + chunk], y[i:i + chunk], probs[i:i + chunk]
        for n, g in per_example(params, xs, ys).items():
            g2[n] += g.square().sum(0) / len(y)
        for k in range(probs.shape[1]):
            for n, g in per_example(params, xs, torch.full_like(ys, k)).items():
                w = ps[:, k].view(-1, *([1] * params[n].dim()))
                gn[n] += (w * g.square()).sum(0) / len(y)
    gen = torch.Generator().manual_seed(seed)
    fo = {n: torch.zeros_like(p) for n, p in params.items()}
    for _ in range(n_batches):
        idx = torch.randint(0, len(y), (batch,), generator=gen)
        gb = torch.autograd.grad(F.cross_entropy(head(x[idx]), y[idx]), list(head.parameters()))
        for n, g in zip(params, gb):
            fo[n] += batch * g.square() / n_batches
    return {"gn": gn, "g2": g2, "fo_agnb": fo}


def zo_estimates(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, estimator: str, batch: int,
                 draws: tuple[int, ...], eps: float = 1e-3, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Averages of HELENE's own estimate over the first N draws, for each N in ``draws``.

    Args:
        head: The model (left unchanged: lr = 0).
        x: Inputs.
        y: Labels.
        estimator: Name in :data:`helene.HESSIAN_ESTIMATORS`.
        batch: Minibatch size B.
        draws: Numbers of draws to report.
        eps: Perturbation scale.
        seed: Seed of minibatches and perturbations.
    """
    opt = Helene(head.parameters(), lr=0.0, eps=eps, betas=(0.9, 0.0), hessian=estimator, hessian_interval=1,
                 batch_size=batch, seed=seed, anneal_horizon=1.0)
    names = [n for n, _ in head.named_parameters()]
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in head.named_parameters()}
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for i in range(1, max(draws) + 1):
        idx = torch.randint(0, len(y), (batch,), generator=gen)
        opt.step(lambda idx=idx: F.cross_entropy(head(x[idx]), y[idx]))
        for n, p in zip(names, head.parameters()):
            total[n] += opt.state[p]["hessian"].double()  # 0-dim for per-tensor estimators: broadcast
        if i in draws:
            out[i] = {n: (t / i).float() for n, t in total.items()}
    return out


def compare(estimate: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    """Agreement of an estimate with a reference.

    Returns:
        ``pearson`` and ``spearman`` across all coordinates; ``layer_spread`` and ``true_layer_spread``:
        log10 of max/min of the per-tensor means of the estimate and of the reference (an isotropic estimate has
        spread ≈ 0 whatever the truth's); ``scale``: ratio of overall means.
    """
    est = torch.cat([estimate[n].flatten() for n in truth])
    ref = torch.cat([truth[n].flatten() for n in truth])
    def spread(d: dict[str, torch.Tensor]) -> float:
        logs = torch.tensor([d[n].double().mean().abs().clamp(min=1e-300).log10().item() for n in truth])
        return float(logs.max() - logs.min())

    return {
        "pearson": _pearson(est, ref), "spearman": _spearman(est, ref), "layer_spread": spread(estimate),
        "true_layer_spread": spread(truth), "scale": float(est.double().mean() / ref.double().mean()),
    }


def instrument(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
               draws: tuple[int, ...] = (1, 100, 1000)) -> list[dict]:
    """Rows ``(estimator, draws, reference, pearson, spearman, layer_spread, true_layer_spread, scale)``.

    Args:
        head: Model at the point of measurement.
        x: Inputs.
        y: Labels.
        batch: Minibatch size.
        draws: Numbers of averaged draws.
    """
    refs = references(head, x, y, batch)
    rows = []
    for ref_name in ("g2", "fo_agnb"):
        rows.append(dict(estimator=f"backprop {ref_name}", draws="exact", reference="gn",
                         **compare(refs[ref_name], refs["gn"])))
    for est in ("agnb", "agnb_layer", "curvature", "curvature_layer"):
        for n, estimate in zo_estimates(head, x, y, est, batch, draws).items():
            rows.append(dict(estimator=est, draws=n, reference="gn", **compare(estimate, refs["gn"])))
    return rows
