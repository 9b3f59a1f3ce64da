"""Shared machinery of the zeroth-order optimizers: seeded in-place perturbation, restore, two-point SPSA.

MeZO, ZO-Adam and HELENE estimate the gradient from two forward passes (MeZO's two-point SPSA); FZOO
(:mod:`helene.fzoo`) uses the same seeds, perturbation and restore for N one-sided probes. The two-point step::

    θ += ε z ;  L+ = L(θ)        z ~ N(0, I) (or ±1), regenerated from a per-step seed, never stored
    θ −= 2ε z ;  L− = L(θ)
    θ += ε z                      restore (fused with the update, tensor by tensor)
    g = c · z,  c = (L+ − L−) / 2ε

Only the per-step seed is kept; ``z`` is drawn again from it, tensor by tensor, each time it is needed, so the
memory cost is one parameter-sized temporary at a time. Subclasses implement :meth:`_apply_update`.

Drawing ``z`` is what a step pays beyond its two forwards: three passes over every trainable parameter. A Gaussian
costs one generator draw per element (on one CPU core it takes about as long as a forward of a small LLM at batch
16, see docs/benchmarks/helene_llm.md); ``perturbation="rademacher"`` (z = ±1, Spall's original SPSA) takes 64
signs from each 64-bit draw. Both have E[z zᵀ] = I, so the SPSA estimate stays unbiased; the Rademacher one has
slightly lower variance (E[g gᵀ] loses the 2·diag(∇²) term) but z⊙z ≡ 1 carries no per-coordinate information.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer

from helene.zo_state import ZerothOrderState, is_dtensor
from peftplug.errors import ConfigError
from peftplug.validation import check_flag, check_int
from peftplug.validation import check_real as _check_real

_HALF = (torch.float16, torch.bfloat16)
_MASTER_CHOICES = ("auto", True, False)
#: Distributions of the perturbation direction z.
PERTURBATIONS = ("gaussian", "rademacher")
_SIGN_TABLES: dict[torch.device, torch.Tensor] = {}


def _sign_table(device: torch.device) -> torch.Tensor:
    """(256, 8) fp32: row b holds +1 where bit j of b is set and −1 elsewhere (one byte → eight signs)."""
    table = _SIGN_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _SIGN_TABLES[device] = (bits * 2 - 1).to(device=device, dtype=torch.float32)
    return table


def shard_seed(seed: int, position: int, coordinate: list[int] | None) -> int:
    """The generator seed of one shard of one tensor in a step: a 62-bit hash of (step seed, tensor, mesh position).

    Deterministic per tensor and shard, and independent of the order in which ranks draw.

    Args:
        seed: The step's perturbation seed (the same on every rank).
        position: The tensor's position in the trainable-parameter stream.
        coordinate: This rank's coordinate in the tensor's device mesh.
    """
    text = f"{seed}:{position}:{','.join(str(c) for c in (coordinate or []))}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def rademacher(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A fresh fp32 tensor of independent ±1 (probability ½ each), 64 of them per 64-bit generator draw.

    Args:
        shape: Shape of the result.
        generator: The generator to draw from (on ``device``); the result depends only on its state.
        device: Where the result lives.
    """
    numel = math.prod(shape)
    words = torch.empty((numel + 63) // 64, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # from int64's minimum: the full 64-bit range
    signs = _sign_table(device).index_select(0, words.view(torch.uint8).int())
    return signs.view(-1)[:numel].view(shape)


def check_real(name: str, value: Any, low: float | None = 0.0, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """:func:`peftplug.validation.check_real` with the lower bound of most optimizer options, 0, as default.

    Args:
        name: The field's name, as the message shows it.
        value: The value to check.
        low: Lower bound of the accepted range (``None``: none).
        high: Upper bound (``None``: none).
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.

    Returns:
        ``value`` as a float.
    """
    return _check_real(name, value, low, high, low_open=low_open, high_open=high_open)


def check_betas(betas: Any) -> None:
    """Raises ValueError unless ``betas`` is a pair of finite real numbers in [0, 1).

    Args:
        betas: The group's ``betas``.
    """
    def ok(b: Any) -> bool:
        if isinstance(b, torch.Tensor) and b.numel() == 1:
            b = b.reshape(())  # torch.optim.Adam takes one-element tensor betas too
        try:
            check_real("betas", b, 0.0, 1.0, high_open=True)
        except ValueError:
            return False
        return True

    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(ok(b) for b in betas)):
        raise ValueError(f"betas must be two finite real numbers in [0, 1), got {betas!r}")


def check_lr_wd(group: dict) -> None:
    """Raises ValueError unless the param group's ``lr`` and ``weight_decay`` are finite real numbers >= 0.

    Args:
        group: A param group with ``lr`` and ``weight_decay``.
    """
    check_real("lr", group["lr"])
    check_real("weight_decay", group["weight_decay"])


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class ZerothOrderOptimizer(ZerothOrderState, Optimizer):
    """Base class: perturb, evaluate, restore and hand ``(c, z)`` to the subclass's update rule.

    ``step(closure)`` calls ``closure()`` (which must return the scalar batch loss and must not call
    ``backward``) two times per step (three on steps where the update rule needs the unperturbed loss), under
    ``torch.no_grad()``. It returns the step's loss ``(L+ + L−)/2`` as a 0-dim fp32 tensor. If the closure raises
    (OOM, a data error, Ctrl-C), θ is put back before the exception propagates and the seed generator is rewound:
    exactly with master weights; in place otherwise, by subtracting what was added (a raise during L− leaves θ as
    a step skipped for a non-finite loss does, bit for bit; a raise during L+ within one rounding of θ).

    ``add_param_group`` works as at construction: the group's options are validated (same ValueErrors), masters
    are made for its parameters and per-group state (HELENE's scalar second moment) starts at 0.

    Per-parameter state tensors (moments; zeros) are made with the group, not at the first step: torch's
    ``set_optimizer_state_dict`` (FSDP2 resume) initialises an optimizer without state by a closure-less step,
    and loads into the state tensors it finds (each rank's shard). The numbers are the same either way.

    Args:
        params: Parameters or parameter groups (see :func:`helene.groups.layerwise_param_groups`). Parameters
            with ``requires_grad=False`` are ignored, so frozen bases of adapters are never perturbed.
        defaults: Per-group defaults of the subclass.
        eps: Perturbation scale ε (> 0). One value for all groups: the two losses measure one directional
            derivative of the whole parameter vector.
        seed: Seed of the private generator that draws one perturbation seed per step. The global torch RNG is
            never touched (it would clobber data-loader shuffling).
        master_weights: ``"auto"`` keeps fp32 master copies for fp16/bf16 parameters only; ``True`` keeps them
            for every parameter (bit-exact restore, +4 bytes per parameter; fp64 copies of fp64 parameters, since
            a master never lowers precision); ``False`` perturbs in place and raises for fp16/bf16 parameters,
            whose in-place restore would be silently inexact.
        sync_seed: Under ``torch.distributed`` broadcast each step's seed from rank 0, so every rank perturbs
            along the same ``z`` even if the optimizers were built with different seeds.
        perturbation: Distribution of ``z``: ``"gaussian"`` (MeZO's N(0, I)) or ``"rademacher"`` (±1, cheaper to
            draw; see the module docstring).
    """

    #: Tells the trainer to use manual optimization and to pass a loss-only closure.
    is_zeroth_order = True
    #: The running two-point step's per-tensor offsets (``θ + offset·ε·z``) while it restores; ``None`` otherwise.
    _step_offsets: list[float] | None = None

    def __init__(self, params, defaults: dict, *, eps: float, seed: int, master_weights: Any = "auto",
                 sync_seed: bool = True, perturbation: str = "gaussian"):
        check_real("eps", eps, low_open=True)
        if isinstance(seed, float) and seed.is_integer():
            seed = int(seed)  # 3.0 (YAML, arithmetic) was accepted before seeds were validated
        check_int("seed", seed, low=-(2**63), high=2**64 - 1)  # the range torch.Generator.manual_seed takes
        if master_weights not in _MASTER_CHOICES:
            raise ValueError(f"master_weights must be one of {_MASTER_CHOICES}, got {master_weights!r}")
        if perturbation not in PERTURBATIONS:
            raise ValueError(f"perturbation must be one of {PERTURBATIONS}, got {perturbation!r}")
        check_flag("sync_seed", sync_seed)
        # The defaults too: a group added later (add_param_group) takes every option it does not set from them.
        self._check_group(defaults)
        # add_param_group reads these; torch's __init__ calls it once per given group.
        self.perturbation = perturbation
        self.eps = float(eps)
        self.master_weights = master_weights
        super().__init__(params, defaults)
        self.seed = int(seed)
        self.sync_seed = bool(sync_seed)
        self._seed_gen = torch.Generator(device="cpu")
        self._seed_gen.manual_seed(self.seed)
        self._z_gens: dict[torch.device, torch.Generator] = {}
        #: id(param) -> the parameter's version counter after this optimizer last wrote it (see _sync_masters).
        self._master_versions: dict[int, int] = {}
        #: Steps attempted, steps whose update was applied, and skipped steps.
        self.step_count = 0
        self.update_count = 0
        self.skipped_nonfinite = 0
        #: Closure calls made so far (the forward passes a step costs differ between optimizers and steps).
        self.forward_passes = 0
        #: The last step's projected gradient c = (L+ − L−)/2ε (nan after a skipped step).
        self.last_projected_grad = float("nan")

    # ----------------------------------------------------------------------------------------- parameters
    def _check_group(self, group: dict) -> None:
        """Raises ValueError unless the group's options are valid (subclasses add theirs).

        Reads nothing but ``group``: it also checks the defaults before torch's ``__init__`` has run.

        Args:
            group: A param group, or the defaults.
        """
        check_lr_wd(group)

    def _group_added(self, group: dict) -> None:
        """Hook for per-group state kept outside ``self.state`` (called once per group, after validation).

        Args:
            group: The group just appended to ``param_groups``.
        """

    def _init_state(self, group: dict) -> None:
        """Hook: makes the per-parameter state tensors the update keeps, for the group's trainable parameters that
        lack them (after their masters exist: state is shaped and placed like the weights the update changes).

        Args:
            group: A param group.
        """

    def add_param_group(self, param_group: dict) -> None:
        """Adds a param group as at construction: options validated, masters and state made, per-group state added.

        Args:
            param_group: ``{"params": ..., **options}``; options it leaves out are taken from the defaults.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            self._check_dtypes(group)
        except Exception:
            # torch appended the group before any of our checks could run: leave the optimizer as it was.
            self.param_groups.pop()
            raise
        self._init_masters(group)
        self._init_state(group)
        self._group_added(group)

    def _trainable(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """(group, param) for every trainable parameter, in a fixed order (z is drawn in this order)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield group, p

    def _wants_master(self, p: torch.Tensor) -> bool:
        return self.master_weights is True or (self.master_weights == "auto" and p.dtype in _HALF)

    def _check_dtypes(self, group: dict) -> None:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if not p.is_floating_point():
                raise ValueError(f"zeroth-order optimizers need floating-point parameters, got {p.dtype}")
            if p.dtype in _HALF and not self._wants_master(p):
                raise ValueError(
                    f"a {p.dtype} parameter of shape {tuple(p.shape)} cannot be perturbed and restored exactly "
                    "in place; pass master_weights='auto' or True (fp32 master copies), or train in fp32")

    def _init_masters(self, group: dict) -> None:
        for p in group["params"]:
            if p.requires_grad and self._wants_master(p) and "master" not in self.state[p]:
                # fp32 for fp16/bf16/fp32 parameters, fp64 for fp64 ones: a master must never lower precision.
                dtype = torch.promote_types(p.dtype, torch.float32)
                self.state[p]["master"] = p.detach().to(dtype, copy=True)

    def _sync_masters(self) -> None:
        """Re-bases each master copy on its parameter if something else wrote the parameter since the last step.

        A step starts from the master, not from the parameter: weights loaded into the model after the optimizer
        was built (an adapter, a checkpoint without optimizer state), or written by any other code, would
        otherwise be silently replaced by the stale master on the next step. The parameter's version counter,
        recorded after each step, flags a write; the values are then compared, and a parameter still equal to its
        master's rounding keeps the more precise master (so that a resume stays bit-exact). Also moves a master
        to its parameter's device (``model.to(device)`` after building the optimizer), makes the masters a
        parameter that became trainable or half-precision needs (and their state tensors), moves state tensors to
        their parameter's device, and refuses, as at construction, a half-precision parameter that
        ``master_weights=False`` would perturb in place.
        """
        for group in self.param_groups:
            self._check_dtypes(group)
            self._init_masters(group)
            self._init_state(group)
        for _, p in self._trainable():
            st = self.state[p]
            if not is_dtensor(p):  # state made (eagerly) before model.to(device) follows its parameter
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.device != p.device:
                        st[key] = value.to(p.device)
            master = st.get("master")
            if master is None or self._master_versions.get(id(p)) == p._version:
                continue
            if is_dtensor(p):  # this rank's shard only: a comparison of whole DTensors would communicate
                local, master_local = p.to_local(), master.to_local()
            else:
                if master.device != p.device:
                    master = st["master"] = master.to(p.device)
                local, master_local = p, master
            if not torch.equal(master_local.to(local.dtype), local):
                master_local.copy_(local)

    def _note_master_versions(self) -> None:
        """Records the version counter of every master-backed parameter after this optimizer's writes."""
        self._master_versions = {id(p): p._version for _, p in self._trainable() if "master" in self.state[p]}

    def _run_step(self, body: Callable[[Callable[[], Any]], torch.Tensor],
                  closure: Callable[[], Any] | None) -> torch.Tensor:
        """Runs one step's ``body(closure)`` between :meth:`_sync_masters` and :meth:`_note_master_versions`.

        Args:
            body: The step proper.
            closure: The loss closure (``None`` is refused).
        """
        if closure is None:
            trainable = [p for _, p in self._trainable()]
            if trainable and not self.state and all(p.grad is not None for p in trainable):
                # torch.distributed.checkpoint's get/set_optimizer_state_dict: an optimizer without state gets zero
                # gradients and a closure-less step to make it; one keeping no per-parameter tensor cannot be
                # loaded that way at all (it finds no device to load onto).
                raise ConfigError(
                    f"{type(self).__name__} keeps no per-parameter state here (no master weights), which torch's "
                    "FSDP2 optimizer state dict (Lightning's ModelParallelStrategy checkpoints, --ckpt_path) cannot "
                    "restore; pass master_weights=True (also to the run that saves, for an exact resume)")
            raise ValueError("zeroth-order optimizers need a closure that returns the batch loss")
        self.check_zeroth_order_loaded()
        self._sync_masters()
        try:
            return body(closure)
        finally:
            self._note_master_versions()

    def counters(self) -> dict[str, float]:
        """Numbers worth logging: steps, applied updates, skipped non-finite steps, closure calls (forward passes),
        last projected gradient."""
        return {
            "zo_steps": float(self.step_count), "zo_updates": float(self.update_count),
            "zo_skipped_nonfinite": float(self.skipped_nonfinite), "zo_forward_passes": float(self.forward_passes),
            "zo_projected_grad": self.last_projected_grad,
        }

    # ------------------------------------------------------------------------------------------- seeds / z
    def _draw_seed(self) -> int:
        return self._draw_seeds(1)[0]

    def _draw_seeds(self, n: int) -> list[int]:
        """``n`` perturbation seeds from the private generator (rank 0's, in one broadcast, under DDP)."""
        seeds = torch.randint(0, 2**62, (n,), generator=self._seed_gen)
        if self.sync_seed and _dist_initialized():
            dist = torch.distributed
            device = torch.device("cpu")
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            seeds = seeds.to(device)
            dist.broadcast(seeds, src=0)
        return [int(s) for s in seeds.tolist()]

    def _z_stream(self, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function returning, for each trainable parameter in turn, its fp32 direction z for this seed."""
        seeded: set[torch.device] = set()
        index = itertools.count()  # the tensor's position in the stream (sharded tensors seed from it)

        def sample(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
            if self.perturbation == "rademacher":
                return rademacher(shape, gen, device)
            return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

        def draw(p: torch.Tensor) -> torch.Tensor:
            position = next(index)
            if is_dtensor(p):
                # FSDP2: each rank draws only its own shard, from a generator of its own seeded by (step seed,
                # tensor, shard), and the local block becomes a DTensor laid out like p, so every update on it
                # stays local (no communication besides the losses).
                gen = torch.Generator(device=p.device)
                gen.manual_seed(shard_seed(seed, position, p.device_mesh.get_coordinate()))
                local = sample(p.to_local().shape, gen, p.device)
                from torch.distributed.tensor import DTensor

                return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
            gen = self._z_gens.get(p.device)
            if gen is None:
                gen = self._z_gens[p.device] = torch.Generator(device=p.device)
            if p.device not in seeded:
                # The first device draws from the step seed itself; each further one (a model split over GPUs)
                # from a seed of its own: the same seed would give same-shape tensors on two devices the same z,
                # and correlated directions bias the estimate.
                gen.manual_seed(seed if not seeded else shard_seed(seed, -len(seeded), None))
                seeded.add(p.device)
            return sample(p.shape, gen, p.device)

        return draw

    def _perturb(self, seed: int, scale: float, absolute: float, offsets: list[float] | None = None) -> None:
        """Moves parameters along z: in place by ``scale·ε·z``, or to ``master + absolute·ε·z`` with masters.

        ``offsets[i]`` (when given) becomes ``absolute`` as soon as tensor ``i`` has moved, so that
        :meth:`_undo` can put back exactly the tensors moved so far if something raises mid-way.
        """
        draw = self._z_stream(seed)
        for i, (_, p) in enumerate(self._trainable()):
            z = draw(p)
            master = self.state[p].get("master")
            if master is None:
                p.add_(z, alpha=scale * self.eps)
            else:
                p.copy_(master.add(z, alpha=absolute * self.eps))
            if offsets is not None:
                offsets[i] = absolute

    def _undo(self, seed: int, offsets: list[float]) -> None:
        """Puts each parameter back from ``θ + offsets[i]·ε·z``: a copy of its master (bit-exact), else in place.

        The in-place arithmetic is the one of a normal restore (``θ −= offset·ε·z`` with the same z), so a
        parameter comes back exactly as a step skipped for a non-finite loss would leave it. Each offset is
        zeroed once its tensor is back, so an undo interrupted part-way can be finished by calling it again.
        """
        params = [p for _, p in self._trainable()]
        if all("master" in self.state[p] for p in params):
            for p in params:
                p.copy_(self.state[p]["master"])
            offsets[:] = [0.0] * len(offsets)
            return
        if not any(offsets):
            return
        draw = self._z_stream(seed)  # every tensor draws, so the stream stays aligned with the perturbation
        for i, p in enumerate(params):
            z = draw(p)
            master = self.state[p].get("master")
            if master is not None:
                p.copy_(master)
            elif offsets[i]:
                p.add_(z, alpha=-offsets[i] * self.eps)
            offsets[i] = 0.0

    def _n_trainable(self) -> int:
        return sum(1 for _ in self._trainable())

    def _restored(self, seed: int) -> Iterator[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Restores each parameter from θ − εz and yields ``(group, param, weights, z)``.

        ``weights`` is the fp32 tensor the update must modify (the master copy, or the parameter itself);
        after the caller's update a master copy is written back into the parameter. Each in-place tensor's entry
        of the step's offsets (when a step is running) is zeroed once it is back, so that :meth:`_undo` can put
        back the rest if the update raises part-way.
        """
        draw = self._z_stream(seed)
        offsets = self._step_offsets
        for i, (group, p) in enumerate(self._trainable()):
            z = draw(p)
            master = self.state[p].get("master")
            if master is None:
                p.add_(z, alpha=self.eps)
                if offsets is not None:
                    offsets[i] = 0.0
                yield group, p, p, z
            else:
                yield group, p, master, z
                p.copy_(master)

    # ----------------------------------------------------------------------------------------------- step
    def _needs_center_loss(self) -> bool:
        """Whether this step also needs L(θ) at the unperturbed point (e.g. a curvature estimate)."""
        return False

    def _evaluate(self, closure: Callable[[], Any]) -> float:
        """Calls the closure once (counted in ``forward_passes``) and returns its loss as a Python float."""
        self.forward_passes += 1
        loss = closure()
        if isinstance(loss, (tuple, list)):
            loss = loss[0]
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"the closure must return a scalar loss, got shape {tuple(loss.shape)}")
            return float(loss.detach().to(torch.float32).item())
        if not isinstance(loss, numbers.Real):
            # e.g. ``lambda: model(**batch)`` (a ModelOutput) or a closure that forgot to return
            raise TypeError(f"the closure must return the batch loss (a one-element tensor or a real number), got "
                            f"{type(loss).__name__}; e.g. return model(**batch).loss")
        return float(loss)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> torch.Tensor:
        """One zeroth-order step.

        Args:
            closure: Re-evaluates the model on the current batch and returns the loss (no ``backward``).

        Returns:
            The step's loss ``(L+ + L−)/2`` (0-dim fp32 tensor; non-finite when the step was skipped).
        """
        return self._run_step(self._two_point_step, closure)

    def _two_point_step(self, closure: Callable[[], Any]) -> torch.Tensor:
        """The body of :meth:`step`: L+ and L− (and L0 when asked), then the update or a skip."""
        generator_state = self._seed_gen.get_state()
        seed = self._draw_seed()
        offsets = [0.0] * self._n_trainable()
        try:
            center = self._evaluate(closure) if self._needs_center_loss() else None
            self._perturb(seed, +1.0, +1.0, offsets)
            loss_plus = self._evaluate(closure)
            self._perturb(seed, -2.0, -1.0, offsets)
            loss_minus = self._evaluate(closure)
        except BaseException:
            self._abandon(seed, offsets, generator_state)
            raise
        self.step_count += 1
        losses = [loss_plus, loss_minus] + ([center] if center is not None else [])
        # The restore is fused with the update (a third pass that draws z): a raise there (a Ctrl-C landing while
        # z is drawn, which costs about a forward) used to leave every tensor not yet reached at θ − εz, in a
        # model the user may save next. _restored zeroes each tensor's offset once it is back, so _undo can finish.
        self._step_offsets = offsets
        try:
            if not all(math.isfinite(v) for v in losses):
                # Restore exactly as a normal step would, but leave every state tensor untouched.
                for _ in self._restored(seed):
                    pass
                self.skipped_nonfinite += 1
                self.last_projected_grad = float("nan")
                return torch.tensor(float("nan"))
            projected = (loss_plus - loss_minus) / (2.0 * self.eps)
            self.last_projected_grad = projected
            self._apply_update(seed, projected, loss_plus, loss_minus, center)
        except BaseException:
            # Tensors already updated keep their update (the step is partly applied); none stays perturbed.
            self._undo(seed, offsets)
            raise
        finally:
            self._step_offsets = None
        self.update_count += 1
        return torch.tensor(0.5 * (loss_plus + loss_minus), dtype=torch.float32)

    def _apply_update(self, seed: int, projected: float, loss_plus: float, loss_minus: float,
                      center: float | None) -> None:
        raise NotImplementedError

    def _abandon(self, seed: int, offsets: list[float], generator_state: torch.Tensor) -> None:
        """Undoes a step the closure raised in (OOM, a data error, Ctrl-C) before the exception propagates.

        θ comes back (exactly with masters; in place, a raise during L− as a skipped non-finite step leaves it and
        one during L+ within one rounding), and the seed generator is rewound, so
        that retrying the batch takes the step the uninterrupted run would have taken. Only ``forward_passes``
        keeps the calls made.
        """
        self._undo(seed, offsets)
        self._seed_gen.set_state(generator_state)
