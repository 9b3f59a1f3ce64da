"""What the recorded closure values say about a zeroth-order run: its projected gradients and HELENE's Hessian EMA.

A zeroth-order result keeps every step's closure values (``closure_values``: L+, L−), so the projected gradient
``c = (L+ − L−) / 2ε`` of each step is on record. HELENE's A-GNB estimate is ``B·c²·z⊙z``; with ``E[z_i²] = 1``
the mean of its Hessian EMA over coordinates follows from the c's alone::

    h̄ ← β2·h̄ + (1 − β2)·B·c²      on every ``hessian_interval``-th applied update (the first included)

and HELENE divides each coordinate's step by ``γ·max(h_i, λ)``. So ``h̄`` far above λ = 1 means HELENE's steps are
``h̄`` times smaller than its annealed momentum alone would take: the check of the freezing docs/helene.md infers.
"""

from __future__ import annotations

import inspect
import math
import statistics

#: Step windows (1-based, inclusive) over which the mean |c| is shown.
WINDOWS = ((1, 10), (11, 50), (51, 300))
#: Steps after which HELENE's mean Hessian EMA is shown.
CHECKPOINTS = (10, 50, 300)


def projected_gradients(result: dict) -> list[float]:
    """Each step's ``c = (L+ − L−)/2ε`` (NaN for a step whose losses were not finite), from ``closure_values``.

    Args:
        result: A zeroth-order result JSON (:mod:`benchmarks.helene.smollm2.runs`) with ``closure_values``.
    """
    eps = result["spec"]["eps"]
    out = []
    for values in result["closure_values"]:
        plus, minus = values[-2], values[-1]  # L0, when present, is evaluated first
        out.append((plus - minus) / (2 * eps) if math.isfinite(plus) and math.isfinite(minus) else math.nan)
    return out


def hessian_mean(cs: list[float], beta2: float, interval: int, batch_size: int) -> list[float]:
    """HELENE's A-GNB Hessian EMA averaged over coordinates (in expectation over z) after each step.

    Args:
        cs: Projected gradient per step (a NaN step is skipped, as the optimizer skips it).
        beta2: The EMA's decay β2.
        interval: ``hessian_interval``: h is refreshed on every such applied update, the first included.
        batch_size: B in A-GNB's ``B·c²``.
    """
    h, updates, out = 0.0, 0, []
    for c in cs:
        if math.isfinite(c):
            if updates % interval == 0:
                h = beta2 * h + (1.0 - beta2) * batch_size * c * c
            updates += 1
        out.append(h)
    return out


def _helene_default(name: str):
    from helene import Helene

    return inspect.signature(Helene).parameters[name].default


def _beta2(result: dict) -> float:
    """HELENE's β2 as the run recorded it (its first param group), else the optimizer's default."""
    betas = (result.get("optimizer") or {}).get("betas") or _helene_default("betas")
    return float(betas[1])


def projected_gradient_section(results: list[dict], names: dict[str, str]) -> list[str]:
    """Markdown lines: mean |c| per step window for every finished ZO run with closure values, and for HELENE
    runs the mean Hessian EMA h̄ (the factor its steps are divided by, where above λ).

    Args:
        results: Finished result JSONs of the core grid.
        names: Display name per method.
    """
    rows = [r for r in results if r.get("closure_values")]
    if not rows:
        return []
    interval = _helene_default("hessian_interval")
    helene = [r for r in rows if r["spec"]["method"] == "helene"]
    beta2 = _beta2(helene[0]) if helene else float(_helene_default("betas")[1])
    lines = ["", ("Projected gradients c = (L+ − L−)/2ε from the recorded closure values (mean |c| per window of "
                  "steps) and, for HELENE, the mean over coordinates of its A-GNB Hessian EMA h̄ after a step "
                  f"(β2 = {beta2:g}, refreshed every {interval} updates; with λ = 1 a coordinate's step is divided by max(h_i, 1), so h̄ ≫ 1 means steps h̄ times "
                  "smaller than the annealed momentum alone; see `benchmarks/helene/smollm2/diagnostics.py`):"), "",
             "| task | seed | optimizer | " + " | ".join(f"mean \\|c\\| steps {a}–{b}" for a, b in WINDOWS)
             + " | " + " | ".join(f"h̄ after {s}" for s in CHECKPOINTS) + " |",
             "|---|---|---|" + "---|" * (len(WINDOWS) + len(CHECKPOINTS))]
    for r in sorted(rows, key=lambda r: (r["spec"]["task"], r["spec"]["method"], -r["spec"]["split_seed"])):
        spec = r["spec"]
        cs = projected_gradients(r)
        means = []
        for a, b in WINDOWS:
            window = [abs(c) for c in cs[a - 1:b] if math.isfinite(c)]
            means.append(f"{statistics.mean(window):.2f}" if window else "—")
        hs = ["—"] * len(CHECKPOINTS)
        if spec["method"] == "helene":
            h = hessian_mean(cs, _beta2(r), interval, spec["batch_size"])
            hs = [f"{h[s - 1]:.3g}" if s <= len(h) else "—" for s in CHECKPOINTS]
        lines.append(f"| {spec['task']} | {spec['split_seed']} | {names[spec['method']]} | " + " | ".join(means)
                     + " | " + " | ".join(hs) + " |")
    return lines
