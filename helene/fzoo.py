"""FZOO: N one-sided Rademacher probes, the step normalised by the standard deviation of their losses.

FZOO ("FZOO: Fast Zeroth-Order Optimizer for Fine-Tuning Large Language Models towards Adam-Scale Speed", Dang et
al., 2025; code github.com/DKmiyan/FZOO, read for the update, not copied). Per step, on one batch::

    l0 = L(θ)                                        the unperturbed loss (this step's returned loss)
    l_i = L(θ + ε u_i),  i = 1..N                    u_i = ±1, each from its own seed; θ restored after each
    σ = sqrt( Σ (l_i − l̄)² / N ),  l̄ = Σ l_i / N     population std of the N probe losses (l0 not included)
    θ −= lr · ( Σ_i (l_i − l0) u_i / (N σ) + wd·θ )

As in the authors' code (``zo_step``: ``torch.std(losses, unbiased=False)`` over the N perturbed losses, then
``(l_i − l0) / (N·σ)`` per probe), the update has no 1/ε: ``l_i − l0 ≈ ε·∇L·u_i`` and ``σ ≈ ε·‖∇L‖``, so the
step is a normalised gradient step whose size is set by ``lr`` alone, and it is exactly invariant to multiplying
the loss by a constant (no threshold on σ anywhere). Their default is N = 8 (``run.py``, ``fzoo.sh``) and lr 1e-5
(``fzoo.sh``, OPT-1.3B, full parameters). Their code also sketches the paper's FZOO-R (reusing half the probe
losses of the previous batch for σ), but never enables it (``self.losses`` stays ``None``), so it is not here.

Cost per step: N + 1 forward passes; 3N passes over the parameters that draw a u_i (perturb, restore, update; 2N
with master weights, whose restore is a copy); no optimizer state beyond the seed generator and counters, since
every u_i is drawn again from its seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from helene.zo import ZerothOrderOptimizer, check_int


def probe_std(losses: list[float]) -> float:
    """Population standard deviation of the probe losses, in float64 (exact under power-of-two scaling).

    Args:
        losses: The N probe losses.
    """
    mean = sum(losses) / len(losses)
    return math.sqrt(sum((v - mean) ** 2 for v in losses) / len(losses))


class FZOO(ZerothOrderOptimizer):
    """FZOO: batched one-sided Rademacher estimates, normalised by the std of the probe losses.

    ``step(closure)`` calls the closure N + 1 times (first at θ, then once per probe) under ``torch.no_grad()``
    and returns the unperturbed loss ``l0``. A step whose losses are not all finite restores θ and is counted in
    ``skipped_nonfinite``; one whose N probe losses are all equal (σ = 0) is counted in ``skipped_zero_std`` and
    leaves θ unchanged (no division by zero). Under ``torch.distributed`` the N seeds are broadcast from rank 0 and
    the closure must return the all-reduced loss: nothing else is communicated.

    Args:
        params: Parameters or param groups (a group may override ``lr`` and ``weight_decay``); only
            ``requires_grad`` ones are used.
        lr: Learning rate (the authors': 1e-5 for OPT-1.3B full finetuning).
        eps: Perturbation scale ε (> 0).
        n_probes: Number of probes N (>= 2: σ of one loss is 0). The authors use 8.
        weight_decay: Decoupled weight decay, ``θ −= lr·wd·θ`` once per step.
        seed: Seed of the private generator of the per-probe seeds.
        master_weights: See :class:`helene.zo.ZerothOrderOptimizer` (``True``: bit-exact restore after each probe).
        sync_seed: Broadcast the probe seeds from rank 0 under ``torch.distributed``.
        perturbation: ``"rademacher"`` (the authors') or ``"gaussian"``.
    """

    def __init__(self, params, lr: float = 1e-5, eps: float = 1e-3, n_probes: int = 8, weight_decay: float = 0.0,
                 seed: int = 0, master_weights="auto", sync_seed: bool = True, perturbation: str = "rademacher"):
        check_int("n_probes", n_probes, low=2, hint="the std of one probe loss is 0")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, eps=eps, seed=seed,
                         master_weights=master_weights, sync_seed=sync_seed, perturbation=perturbation)
        self.n_probes = int(n_probes)
        #: Steps skipped because every probe loss was the same (σ = 0).
        self.skipped_zero_std = 0
        #: σ of the last step's probe losses (nan after a non-finite step).
        self.last_probe_std = float("nan")

    def counters(self) -> dict[str, float]:
        """The base counters (without the two-point projected gradient) plus σ and the σ = 0 skips."""
        out = super().counters()
        del out["zo_projected_grad"]
        out["zo_skipped_zero_std"] = float(self.skipped_zero_std)
        out["zo_probe_std"] = self.last_probe_std
        return out

    # ------------------------------------------------------------------------------------------- probes
    def _update(self, seeds: list[int], weights: list[float]) -> None:
        """θ ← θ·(1 − lr·wd) − lr·Σ_i weights_i·u_i, one pass over the parameters per probe."""
        for i, (seed, weight) in enumerate(zip(seeds, weights)):
            draw = self._z_stream(seed)
            for group, p in self._trainable():
                u = draw(p)
                target = self.state[p].get("master", p)
                lr, wd = group["lr"], group["weight_decay"]
                if i == 0 and wd:
                    target.mul_(1.0 - lr * wd)
                target.add_(u, alpha=-lr * weight)
        for _, p in self._trainable():
            master = self.state[p].get("master")
            if master is not None:
                p.copy_(master)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:
        """One FZOO step.

        Args:
            closure: Re-evaluates the model on the current batch and returns the loss (no ``backward``).

        Returns:
            The unperturbed loss ``l0`` (0-dim fp32 tensor; nan when a loss was not finite).
        """
        return self._run_step(self._probe_step, closure)

    def _probe_step(self, closure: Callable[[], Any]) -> torch.Tensor:
        """The body of :meth:`step`: l0, the N probes, then the update or a skip."""
        generator_state = self._seed_gen.get_state()
        seeds = self._draw_seeds(self.n_probes)
        # Every closure call happens whatever the losses are: under DDP each one is a collective.
        losses = []
        seed, offsets = seeds[0], [0.0] * self._n_trainable()
        try:
            center = self._evaluate(closure)
            for seed in seeds:
                self._perturb(seed, +1.0, +1.0, offsets)
                losses.append(self._evaluate(closure))
                self._undo(seed, offsets)  # a copy from the masters, else θ −= ε u; zeroes the offsets
        except BaseException:
            self._abandon(seed, offsets, generator_state)  # θ back at the probe's start, then re-raised
            raise
        self.step_count += 1
        if not all(math.isfinite(v) for v in [center, *losses]):
            self.skipped_nonfinite += 1
            self.last_probe_std = float("nan")
            return torch.tensor(float("nan"))
        sigma = probe_std(losses)
        self.last_probe_std = sigma
        if sigma == 0.0:
            self.skipped_zero_std += 1
            return torch.tensor(center, dtype=torch.float32)
        weights = [(v - center) / (self.n_probes * sigma) for v in losses]
        self._update(seeds, weights)
        self.update_count += 1
        return torch.tensor(center, dtype=torch.float32)

    # -------------------------------------------------------------------------------------------- state
    def zeroth_order_state(self) -> dict:
        """The base entry plus the σ = 0 skip counter."""
        zo = super().zeroth_order_state()
        zo["skipped_zero_std"] = self.skipped_zero_std
        return zo

    def load_zeroth_order_state(self, zo: dict) -> None:
        """Restores a :meth:`zeroth_order_state`.

        Args:
            zo: The saved entry of an FZOO over the same parameters.
        """
        super().load_zeroth_order_state(zo)
        self.skipped_zero_std = int(zo.get("skipped_zero_std", 0))
