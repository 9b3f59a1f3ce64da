"""HELENE and its baselines: ZO-SGD (MeZO) and a ZO-Adam-style variant.

All three share :class:`helene.zo.ZerothOrderOptimizer` (two-point SPSA with seeded in-place perturbation) and
differ only in how ``g = c·z`` becomes an update. See docs/helene.md for the algorithm and the switches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

from helene.estimators import get_estimator
from helene.groups import GRANULARITIES, layerwise_param_groups
from helene.zo import ZerothOrderOptimizer, check_betas, check_int, check_real, is_dtensor
from peftplug.validation import check_flag

CLIP_MODES = ("layer", "coordinate", "none")
#: What divides HELENE's momentum: the EMA of a diagonal Hessian estimate (the paper), or one scale-free scalar.
PRECONDITIONERS = ("hessian", "scalar", "scalar_global")
#: Estimators whose h can be 0 or negative: with clip="layer" the floor λ is all that keeps the denominator > 0.
_SIGNLESS = ("none", "curvature", "curvature_layer")
_AUTO_HORIZON_FRACTION = 0.1  # anneal_horizon="auto": T = 10% of the run's total steps
_FALLBACK_HORIZON = 1000.0


def _per_tensor_zero(w: torch.Tensor) -> torch.Tensor:
    """The fp32 zero a per-tensor estimate's EMA starts from: 0-dim, or for an FSDP2 shard one float per shard.

    A shard's estimate is its own (the mean over the local shard), so it is kept as a DTensor of one element per
    mesh coordinate: torch's FSDP2 optimizer state dict then saves and restores every rank's value (a plain 0-dim
    tensor would be saved from rank 0 and loaded into every rank).
    """
    if not is_dtensor(w):
        return torch.zeros((), dtype=torch.float32, device=w.device)
    from torch.distributed.tensor import DTensor, Shard

    mesh = w.device_mesh
    local = torch.zeros((1,) * mesh.ndim, dtype=torch.float32, device=w.device)
    return DTensor.from_local(local, mesh, [Shard(i) for i in range(mesh.ndim)], run_check=False)


def _as_pair(betas):
    """``betas`` as a tuple when it is a sequence; anything else is left for :func:`check_betas` to refuse."""
    return tuple(betas) if isinstance(betas, (tuple, list)) else betas


class ZOSGD(ZerothOrderOptimizer):
    """MeZO: two-point SPSA with the plain SGD update ``θ −= lr·(c·z + wd·θ)``.

    Args:
        params: Parameters or param groups (only ``requires_grad`` ones are used).
        lr: Learning rate (MeZO: 1e-6…1e-7 full finetuning, 1e-4…5e-5 LoRA).
        eps: Perturbation scale ε (MeZO: 1e-3).
        weight_decay: Decoupled weight decay (set it to 0 for biases and norms through param groups).
        seed: Seed of the private generator of per-step seeds.
        master_weights: See :class:`helene.zo.ZerothOrderOptimizer`.
        sync_seed: Broadcast the step seed from rank 0 under ``torch.distributed``.
        perturbation: ``"gaussian"`` (MeZO) or ``"rademacher"``, see :class:`helene.zo.ZerothOrderOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-6, eps: float = 1e-3, weight_decay: float = 0.0, seed: int = 0,
                 master_weights="auto", sync_seed: bool = True, perturbation: str = "gaussian"):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, eps=eps, seed=seed,
                         master_weights=master_weights, sync_seed=sync_seed, perturbation=perturbation)

    def _apply_update(self, seed, projected, loss_plus, loss_minus, center):
        for group, _, w, z in self._restored(seed):
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                w.mul_(1.0 - lr * wd)
            w.add_(z, alpha=-lr * projected)


class ZOAdam(ZerothOrderOptimizer):
    """ZO-Adam-style baseline: Adam's moments of the SPSA estimate ``g = c·z`` (decoupled weight decay).

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        eps: Perturbation scale ε.
        betas: Adam's (β1, β2).
        adam_eps: Adam's denominator constant.
        weight_decay: Decoupled weight decay.
        seed: Seed of the private generator of per-step seeds.
        master_weights: See :class:`helene.zo.ZerothOrderOptimizer`.
        sync_seed: Broadcast the step seed from rank 0 under ``torch.distributed``.
        perturbation: ``"gaussian"`` or ``"rademacher"``, see :class:`helene.zo.ZerothOrderOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-4, eps: float = 1e-3, betas=(0.9, 0.999), adam_eps: float = 1e-8,
                 weight_decay: float = 0.0, seed: int = 0, master_weights="auto", sync_seed: bool = True,
                 perturbation: str = "gaussian"):
        super().__init__(params, {"lr": lr, "betas": _as_pair(betas), "adam_eps": adam_eps,
                                  "weight_decay": weight_decay},
                         eps=eps, seed=seed, master_weights=master_weights, sync_seed=sync_seed,
                         perturbation=perturbation)

    def _check_group(self, group: dict) -> None:
        """Adds Adam's ``betas`` and ``adam_eps`` to the base checks.

        Args:
            group: A param group, or the defaults.
        """
        super()._check_group(group)
        check_betas(group["betas"])
        check_real("adam_eps", group["adam_eps"], low_open=True)

    def _init_state(self, group: dict) -> None:
        """Adam's moments m and v, fp32 zeros like each trainable parameter's master (or the parameter).

        Args:
            group: A param group.
        """
        for p in group["params"]:
            if p.requires_grad and "exp_avg" not in self.state[p]:
                w = self.state[p].get("master", p)
                self.state[p]["exp_avg"] = torch.zeros_like(w, dtype=torch.float32)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(w, dtype=torch.float32)

    def _apply_update(self, seed, projected, loss_plus, loss_minus, center):
        t = self.update_count + 1
        for group, p, w, z in self._restored(seed):
            st = self.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            g = z.mul_(projected)
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            if wd:
                w.mul_(1.0 - lr * wd)
            denom = v.div(1.0 - b2**t).sqrt_().add_(group["adam_eps"])
            w.addcdiv_(m, denom, value=-lr / (1.0 - b1**t))


#: Keys of a given group that name or locate its parameters rather than set an option of its own.
_GROUP_LAYOUT_KEYS = ("params", "param_names", "names", "layer")


def _regroup(params, granularity: str, lam, weight_decay: float) -> list[dict]:
    """Per-layer param groups from parameters given with or without names, each group's options kept.

    Each given param group is split into layers on its own, so every option it sets (``lr``, ``betas``,
    ``gamma``, ``lam``, ``weight_decay``, ...) carries over to the layer groups derived from it; what it leaves
    out comes from the optimizer's defaults as usual. Biases, norms and 1-d tensors still get weight decay 0.
    """
    params = list(params)
    plain = not params or not isinstance(params[0], dict)
    if plain:
        given = [{"params": params}]  # plain parameters or (name, parameter) pairs: one group, no options
    elif all(isinstance(item, dict) for item in params):
        given = params
    else:
        raise ValueError("params must be all param groups (dicts) or all parameters, not a mix")
    groups: list[dict] = []
    for i, item in enumerate(given):
        members = item["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        # torch's "param_names", or "names" from helene.groups.layerwise_param_groups
        names = item.get("param_names") or item.get("names") or [None] * len(members)
        named: list[tuple[str, torch.Tensor]] = []
        for j, (name, member) in enumerate(zip(names, members)):
            if isinstance(member, tuple):
                name, member = member
            if name is None and granularity != "tensor":
                raise ValueError(f"layerwise={granularity!r} needs parameter names; pass named_parameters()")
            named.append((name or (f"param{j}" if plain else f"param{i}.{j}"), member))
        if not any(p.requires_grad for _, p in named):
            continue  # a wholly frozen group: nothing to optimize in it, as without layerwise
        options = {k: v for k, v in item.items() if k not in _GROUP_LAYOUT_KEYS}
        groups += layerwise_param_groups(named, granularity, lam=options.pop("lam", lam),
                                         weight_decay=options.pop("weight_decay", weight_decay), **options)
    if not groups:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to optimize")
    for g in groups:
        g["param_names"] = g.pop("names")  # torch's own key, so state_dict keeps the names
    return groups


class Helene(ZerothOrderOptimizer):
    """HELENE: SPSA gradient, annealed momentum, EMA of a diagonal Hessian estimate, layer-wise clipping.

    Per step ``t`` (``t`` counts applied updates)::

        g = c·z                                   (two-point SPSA, see ZerothOrderOptimizer)
        α_t = β1 + (1 − β1)·exp(−t/T)             (anneal=True; α_t = β1 when anneal=False)
        m = β1·m + α_t·g
        preconditioner="hessian" (the paper's reading):
            if t % k == 0:  h = β2·h + (1 − β2)·ĥ      (ĥ from the chosen estimator; n = refreshes so far)
            h' = h / (1 − β2ⁿ) with bias_correction, else h
            clip="layer":       u = m / (γ·max(h', λ_group))
            clip="coordinate":  u = clamp(m / max(γ·h', λ_group), −ρ, ρ)     (Sophia-like)
            clip="none":        u = m / (γ·|h'| + 1e-12)
        preconditioner="scalar" / "scalar_global" (every step, one float per group / for all groups):
            s = β2·s + (1 − β2)·c² ;  s' = s / (1 − β2^(t+1)) with bias_correction, else s
            u = m / (γ·√s')       (clip="coordinate": clamped to ±ρ; no λ floor, u = 0 while s' = 0)
        θ −= lr·(u + wd·θ)

    The scalar preconditioners make the step a normalised annealed-momentum step: m and √s both scale with the
    loss, so the update does not change when the loss is multiplied by a constant (bit for bit for powers of two).
    Because ``c`` is one number shared by every parameter, ``"scalar"`` differs from ``"scalar_global"`` only
    where groups have their own β2 (``"scalar_global"`` uses the optimizer's default β2) — a ZO step cannot see a
    per-layer gradient scale. State: m alone (4 bytes per parameter) against m and h for ``"hessian"``.

    Args:
        params: Parameters or param groups; a group may override ``lr``, ``betas``, ``gamma``, ``lam``
            (its clipping floor λ) and ``weight_decay`` — :func:`helene.groups.layerwise_param_groups` builds
            one group per layer. Groups added later by ``add_param_group`` are used as given (not regrouped).
        lr: Learning rate.
        eps: Perturbation scale ε.
        betas: (β1, β2): momentum and Hessian EMA decays, each in [0, 1).
        gamma: Scale γ > 0 of the preconditioner.
        lam: Default clipping floor λ >= 0 (per group through ``lam``); with ``layerwise`` also a mapping from a
            regular expression on the layer name to λ, or a function of it (see
            :func:`helene.groups.layerwise_param_groups`); groups added later then default to the mapping's
            ``"default"`` (1.0 for a function).
        weight_decay: Decoupled weight decay.
        hessian_interval: Refresh the Hessian EMA every ``k`` >= 1 steps (the first step always refreshes). The
            scalar preconditioners refresh every step (c² costs nothing).
        anneal: Switch for gradient annealing.
        anneal_horizon: T > 0, or ``"auto"``: 10% of the total steps given to :meth:`set_total_steps` (the
            trainer calls it; without it T = 1000 and a warning).
        clip: ``"layer"`` (paper), ``"coordinate"`` (Sophia-like) or ``"none"``.
        rho: Clamp bound for ``clip="coordinate"``.
        hessian: Estimator name for ``preconditioner="hessian"``, see :mod:`helene.estimators`; ``None`` means
            ``"agnb"`` (the paper's) there. The scalar preconditioners take no estimator: pass ``None``.
        preconditioner: ``"hessian"`` (the paper's EMA of ``hessian``), ``"scalar"`` (one EMA of c² per param
            group) or ``"scalar_global"`` (one for all groups); see above. ``None`` (default): ``"hessian"`` when
            ``hessian`` is given, else ``"scalar"``. The paper's reading is ``preconditioner="hessian"``.
        bias_correction: Adam's correction of the EMA's start from 0, ``h / (1 − β2ⁿ)`` (an ablation switch: it
            makes the early preconditioner larger, not smaller). The momentum is not corrected: α_0 = 1 already
            makes m_1 = g_1 when ``anneal=True``.
        batch_size: Batch size B scaling the A-GNB estimate (``B·ĝ⊙ĝ``).
        layerwise: ``None`` (use ``params`` as given) or a granularity, ``"tensor"``, ``"block"`` or ``"model"``:
            regroup the parameters per layer with their λ and weight decay off for biases and norms. Each given
            param group is split on its own and its options (``lr``, ``betas``, ``gamma``, ``lam``,
            ``weight_decay``, ...) carry over to its layer groups. Needs parameter names
            (``model.named_parameters()`` or torch's named param groups) except for ``"tensor"``.
        seed: Seed of the private generator of per-step seeds.
        master_weights: See :class:`helene.zo.ZerothOrderOptimizer`.
        sync_seed: Broadcast the step seed from rank 0 under ``torch.distributed``.
        perturbation: ``"gaussian"`` or ``"rademacher"``, see :class:`helene.zo.ZerothOrderOptimizer`. With
            Rademacher ``z⊙z ≡ 1``: ``"agnb"`` then equals ``"agnb_layer"`` (at a float per parameter) and the
            curvature estimators, which weigh ``z⊙z − 1``, are identically zero, so they are refused.
    """

    def __init__(self, params, lr: float = 1e-6, eps: float = 1e-3, betas=(0.9, 0.99), gamma: float = 1.0,
                 lam: float = 1.0, weight_decay: float = 0.0, hessian_interval: int = 10, anneal: bool = True,
                 anneal_horizon="auto", clip: str = "layer", rho: float = 1.0, hessian: str | None = None,
                 batch_size: int = 1, layerwise: str | None = None, seed: int = 0, master_weights="auto",
                 sync_seed: bool = True, perturbation: str = "gaussian", preconditioner: str | None = None,
                 bias_correction: bool = False):
        if layerwise is not None:
            if layerwise not in GRANULARITIES:
                raise ValueError(f"layerwise must be None or one of {GRANULARITIES}, got {layerwise!r}")
            params = _regroup(params, layerwise, lam, weight_decay)
            # The default λ of groups added later (add_param_group): the mapping's "default", as for an unmatched
            # layer, and 1.0 for a function, which needs a layer name to answer.
            if isinstance(lam, Mapping):
                lam = lam.get("default", 1.0)
            elif callable(lam):
                lam = 1.0
        if clip not in CLIP_MODES:
            raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}")
        check_flag("anneal", anneal)
        check_flag("bias_correction", bias_correction)
        check_int("hessian_interval", hessian_interval, low=1)
        if not (isinstance(anneal_horizon, str) and anneal_horizon == "auto"):
            try:
                check_real("anneal_horizon", anneal_horizon, low_open=True)
            except ValueError:
                raise ValueError(f"anneal_horizon must be 'auto' or a finite real number > 0, "
                                 f"got {anneal_horizon!r}") from None
        check_int("batch_size", batch_size, low=1)
        check_real("rho", rho, low_open=True)
        if preconditioner is None:
            # An estimator names the paper's preconditioner; without one the default is the scalar one, which beat
            # the paper's reading on both seeds of the SmolLM2 SST-2 comparison (docs/helene.md, "Defaults").
            preconditioner = "hessian" if hessian is not None else "scalar"
        if preconditioner not in PRECONDITIONERS:
            raise ValueError(f"preconditioner must be one of {PRECONDITIONERS}, got {preconditioner!r}")
        if preconditioner != "hessian" and hessian is not None:
            raise ValueError(f"hessian={hessian!r} applies only to preconditioner='hessian'; with "
                             f"preconditioner={preconditioner!r} leave hessian unset (None)")
        if hessian == "none" and clip == "none":
            # (One field named as the subject: the CLI names the recipe field an error is about from its message.)
            raise ValueError("clip must be 'layer' (with a floor lam > 0: the annealing-only ablation) or 'coordinate' "
                             "when hessian is 'none': h is always zero, and clip 'none' would divide the momentum by "
                             "1e-12")
        self.preconditioner = preconditioner
        self.clip = clip  # read by _check_group, which also checks the defaults before torch's __init__
        self.bias_correction = bool(bias_correction)
        self.estimator = get_estimator("agnb" if hessian is None else hessian) if preconditioner == "hessian" else None
        if self.estimator is not None and self.estimator.needs_center and perturbation == "rademacher":
            raise ValueError(f"hessian={hessian!r} needs a Gaussian perturbation (it weighs z⊙z − 1, which is 0 for "
                             "every Rademacher z); use perturbation='gaussian' or hessian in "
                             "('agnb', 'agnb_layer', 'none')")
        #: EMA of c²: one per param group ("scalar", an entry added with each group), or one for all
        #: ("scalar_global"); set before torch's __init__, whose add_param_group calls extend it.
        self.second_moment: list[float] = [0.0] if preconditioner == "scalar_global" else []
        defaults = {"lr": lr, "betas": _as_pair(betas), "gamma": gamma, "lam": lam, "weight_decay": weight_decay}
        super().__init__(params, defaults, eps=eps, seed=seed, master_weights=master_weights, sync_seed=sync_seed,
                         perturbation=perturbation)
        self.hessian_interval = int(hessian_interval)
        self.anneal = bool(anneal)
        self.anneal_horizon = anneal_horizon
        self.rho = float(rho)
        self.batch_size = int(batch_size)
        self.total_steps: int | None = None
        self._warned_horizon = False

    def _check_group(self, group: dict) -> None:
        """Adds ``betas``, ``gamma`` and ``lam`` to the base checks.

        Args:
            group: A param group, or the defaults.
        """
        super()._check_group(group)
        check_betas(group["betas"])
        check_real("gamma", group["gamma"], low_open=True)
        lam = group["lam"]
        if isinstance(lam, Mapping) or callable(lam):
            # ValueError like every other bad option (TRY004 would want TypeError): callers catch one type.
            raise ValueError(  # noqa: TRY004
                f"lam (clipping floor λ) must be a finite real number >= 0, got {lam!r}: a mapping or function of "
                "layer names needs layerwise='tensor' or 'block'")
        check_real("lam (clipping floor λ)", lam)
        if lam == 0 and self.clip == "layer" and self.estimator is not None and self.estimator.name in _SIGNLESS:
            raise ValueError(f"lam must be > 0 (the clipping floor λ) when hessian is {self.estimator.name!r} and clip "
                             "is 'layer': its h can be 0 or negative, and the floor is then the whole denominator")

    def _init_state(self, group: dict) -> None:
        """The momentum m (and, for ``preconditioner="hessian"``, h), fp32 zeros like each trainable parameter's
        master (or the parameter); a per-tensor estimator's h is one 0-dim float.

        Args:
            group: A param group.
        """
        for p in group["params"]:
            if not p.requires_grad:
                continue
            st = self.state[p]
            w = st.get("master", p)
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(w, dtype=torch.float32)
            if self.preconditioner == "hessian" and "hessian" not in st:
                st["hessian"] = (_per_tensor_zero(w) if self.estimator.per_tensor
                                 else torch.zeros_like(w, dtype=torch.float32))  # (a DTensor for an FSDP2 shard)

    def _group_added(self, group: dict) -> None:
        """Gives a new group its own scalar second moment (``preconditioner="scalar"``), starting from 0.

        Args:
            group: The group just appended to ``param_groups``.
        """
        if self.preconditioner == "scalar":
            self.second_moment.append(0.0)

    def set_total_steps(self, total_steps: float) -> None:
        """Tells the optimizer the run's length, which ``anneal_horizon="auto"`` derives T from.

        Args:
            total_steps: Number of optimizer steps the run will take (e.g. ``trainer.estimated_stepping_batches``),
                or ``math.inf`` for a run without a fixed length (what Lightning estimates for ``max_steps: -1``
                with ``max_epochs: -1``, a run bounded by ``max_time`` or a callback).

        Raises:
            ValueError: If ``total_steps`` is not an int >= 1 or ``inf``, or is ``inf`` with
                ``anneal_horizon="auto"`` (10% of an unbounded run is no horizon).
        """
        if isinstance(total_steps, float) and total_steps == math.inf:
            if self.anneal_horizon == "auto":
                raise ValueError("anneal_horizon must be a number of steps > 0 for a run without a fixed length "
                                 "(total_steps=inf: max_steps and max_epochs unbounded); 'auto' is 10% of the run")
            self.total_steps = None  # a numeric horizon does not read it
            return
        self.total_steps = check_int("total_steps", total_steps, low=1)

    def horizon(self) -> float:
        """The annealing horizon T in effect."""
        if self.anneal_horizon != "auto":
            return float(self.anneal_horizon)
        if self.total_steps is None:
            if not self._warned_horizon:
                warnings.warn("Helene(anneal_horizon='auto') without set_total_steps(): using T = 1000",
                              stacklevel=3)
                self._warned_horizon = True
            return _FALLBACK_HORIZON
        return max(1.0, _AUTO_HORIZON_FRACTION * self.total_steps)

    def alpha(self, t: int, beta1: float) -> float:
        """The momentum weight α_t of the SPSA gradient at update ``t``.

        Args:
            t: Update index (0 for the first update).
            beta1: The group's β1.
        """
        if not self.anneal:
            return beta1
        return beta1 + (1.0 - beta1) * math.exp(-t / self.horizon())

    def _refresh_hessian(self) -> bool:
        return self.update_count % self.hessian_interval == 0

    def _needs_center_loss(self) -> bool:
        return self.estimator is not None and self.estimator.needs_center and self._refresh_hessian()

    def _apply_update(self, seed, projected, loss_plus, loss_minus, center):
        if self.preconditioner != "hessian":
            self._apply_scalar_update(seed, projected)
            return
        t = self.update_count
        refresh = self._refresh_hessian()
        for group, p, w, z in self._restored(seed):
            st = self.state[p]
            m, h = st["exp_avg"], st["hessian"]
            if self.estimator.per_tensor and is_dtensor(h):
                h = h.to_local().view(())  # this shard's float, a view: the in-place EMA below updates the state
            b1, b2 = group["betas"]
            if refresh:
                # A per-tensor estimate of an FSDP2 shard is the mean over this rank's shard (a plain scalar): a
                # mean over the whole tensor would be one more all-reduce per tensor, and z is i.i.d. either way.
                zt = z.to_local() if self.estimator.per_tensor and is_dtensor(z) else z
                est = self.estimator(zt, projected, loss_plus, loss_minus, center, self.eps, self.batch_size)
                h.mul_(b2).add_(est, alpha=1.0 - b2)
                del est
            m.mul_(b1).add_(z, alpha=self.alpha(t, b1) * projected)
            lr, wd, gamma, lam = group["lr"], group["weight_decay"], group["gamma"], group["lam"]
            if wd:
                w.mul_(1.0 - lr * wd)
            if self.bias_correction:
                # n = refreshes so far, this step's included; a temporary, so the stored h stays the plain EMA.
                h = h.div(1.0 - b2 ** (t // self.hessian_interval + 1))
            if self.clip == "layer":
                denom = h.clamp(min=lam).mul_(gamma).add_(1e-12)
                w.addcdiv_(m, denom, value=-lr)
            elif self.clip == "coordinate":
                u = m.div(h.mul(gamma).clamp_(min=max(lam, 1e-12))).clamp_(-self.rho, self.rho)
                w.add_(u, alpha=-lr)
            else:
                w.addcdiv_(m, h.abs().mul_(gamma).add_(1e-12), value=-lr)

    def _apply_scalar_update(self, seed: int, projected: float) -> None:
        """The scalar preconditioners: every group's m divided by γ·√s, s the EMA of c² (Python floats)."""
        t = self.update_count
        if self.preconditioner == "scalar":
            betas2 = [group["betas"][1] for group in self.param_groups]
        else:  # one EMA for all groups, with the optimizer's default β2
            betas2 = [self.defaults["betas"][1]]
        for j, b2 in enumerate(betas2):
            self.second_moment[j] = b2 * self.second_moment[j] + (1.0 - b2) * projected * projected
        scales = []
        for i, group in enumerate(self.param_groups):
            j = i if self.preconditioner == "scalar" else 0
            s = self.second_moment[j]
            if self.bias_correction:
                s = s / (1.0 - betas2[j] ** (t + 1))
            scales.append(group["gamma"] * math.sqrt(s))
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        for group, p, w, z in self._restored(seed):
            m = self.state[p]["exp_avg"]
            b1 = group["betas"][0]
            m.mul_(b1).add_(z, alpha=self.alpha(t, b1) * projected)
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                w.mul_(1.0 - lr * wd)
            denom = scales[index[id(group)]]
            if denom == 0.0:
                continue  # every c so far was 0, so m is 0 as well: no step, and no 0/0
            if self.clip == "coordinate":
                w.add_(m.div(denom).clamp_(-self.rho, self.rho), alpha=-lr)
            else:
                w.add_(m, alpha=-lr / denom)

    def zeroth_order_state(self) -> dict:
        """Adds the Helene-specific total steps (T must not change on resume) and scalar moments to the base entry."""
        zo = super().zeroth_order_state()
        zo["total_steps"] = self.total_steps
        zo["second_moment"] = list(self.second_moment)
        return zo

    def load_zeroth_order_state(self, zo: dict) -> None:
        """Restores a :meth:`zeroth_order_state`.

        Args:
            zo: The saved entry.
        """
        total, moments = zo.get("total_steps"), zo.get("second_moment")
        if moments is not None and len(moments) != len(self.second_moment):
            raise ValueError(f"state_dict has {len(moments)} scalar second moments, this optimizer "
                             f"(preconditioner={self.preconditioner!r}) keeps {len(self.second_moment)}")
        super().load_zeroth_order_state(zo)
        if total is not None:
            self.total_steps = int(total)
        if moments is not None:
            self.second_moment = [float(v) for v in moments]
