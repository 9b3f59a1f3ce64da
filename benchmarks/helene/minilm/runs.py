"""One training run of the HELENE benchmark: an optimizer, a setting, a task; curves, accuracy, time, memory."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from helene import ZOSGD, Helene, ZOAdam, layerwise_param_groups

# "HELENE-curv" is HELENE with the HiZOO-style curvature estimator, the variant the switch study favoured.
OPTIMIZERS = ("MeZO", "HELENE", "HELENE-curv", "ZO-Adam", "AdamW")


@dataclass
class Problem:
    """A trainable model and its data, ready for runs.

    Args:
        name: Setting and task, for tables.
        setting: ``"head"``, ``"top"`` or ``"lora"``.
        model: The model whose ``requires_grad`` parameters are trained.
        forward: ``forward(split, idx) -> logits`` for ``split`` in {"train", "test"}.
        y_train: Training labels.
        y_test: Test labels.
        batch: Minibatch size.
        train_eval: Indices of training examples the training loss is measured on.
        total_params: Parameters of the whole model (trainable and frozen), for memory ratios.
    """

    name: str
    setting: str
    model: torch.nn.Module
    forward: object
    y_train: torch.Tensor
    y_test: torch.Tensor
    batch: int
    train_eval: torch.Tensor
    total_params: int
    init_state: dict = field(default_factory=dict)

    def __post_init__(self):
        self.init_state = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def reset(self) -> None:
        """Puts the trainable parameters back to their initial values (same start for every optimizer)."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.init_state:
                    p.copy_(self.init_state[n])
                p.grad = None

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]


def make_optimizer(name: str, problem: Problem, hp: dict, steps: int):
    """Builds an optimizer from a name and hyper-parameters.

    Args:
        name: One of :data:`OPTIMIZERS`.
        problem: The problem (its trainable parameters are optimized).
        hp: ``lr``, ``eps`` and, for HELENE, any :class:`helene.Helene` keyword.
        steps: Run length (HELENE's ``anneal_horizon="auto"``).
    """
    params = problem.trainable()
    if name == "MeZO":
        return ZOSGD(params, lr=hp["lr"], eps=hp["eps"], seed=hp.get("seed", 0))
    if name == "ZO-Adam":
        return ZOAdam(params, lr=hp["lr"], eps=hp["eps"], seed=hp.get("seed", 0))
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=hp["lr"], weight_decay=0.0)
    if name in ("HELENE", "HELENE-curv"):
        kw = {k: v for k, v in hp.items() if k not in ("lr", "eps", "lam", "seed")}
        if name == "HELENE-curv":
            kw.setdefault("hessian", "curvature")
        groups = layerwise_param_groups(problem.model, "tensor", lam=hp.get("lam", 1.0))
        # The paper's preconditioner, which these results were measured with (Helene's default is now "scalar").
        kw.setdefault("preconditioner", "hessian")
        opt = Helene(groups, lr=hp["lr"], eps=hp["eps"], batch_size=problem.batch, seed=hp.get("seed", 0), **kw)
        opt.set_total_steps(steps)
        return opt
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


@torch.no_grad()
def _loss(problem: Problem, idx: torch.Tensor) -> float:
    return F.cross_entropy(problem.forward("train", idx).float(), problem.y_train[idx]).item()


@torch.no_grad()
def accuracy(problem: Problem, chunk: int = 128) -> float:
    """Test accuracy of the current parameters."""
    correct = 0
    n = len(problem.y_test)
    for i in range(0, n, chunk):
        idx = torch.arange(i, min(n, i + chunk))
        correct += (problem.forward("test", idx).argmax(-1) == problem.y_test[idx]).sum().item()
    return correct / n


def state_bytes(opt) -> int:
    """Bytes of every tensor the optimizer keeps between steps."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def run(problem: Problem, opt_name: str, hp: dict, steps: int, eval_every: int, seed: int = 0) -> dict:
    """Trains from the problem's initial parameters; returns the curve, accuracy, times and memory.

    Args:
        problem: What to train.
        opt_name: One of :data:`OPTIMIZERS`.
        hp: Hyper-parameters (see :func:`make_optimizer`).
        steps: Optimizer steps.
        eval_every: Steps between training-loss measurements.
        seed: Minibatch order (the same for every optimizer).
    """
    problem.reset()
    opt = make_optimizer(opt_name, problem, hp, steps)
    zo = getattr(opt, "is_zeroth_order", False)
    gen = torch.Generator().manual_seed(seed)
    n = len(problem.y_train)
    curve, times, saved = [(0, _loss(problem, problem.train_eval))], [], [0]
    order = torch.randperm(n, generator=gen)
    pos = 0

    # Parameters (and views of them) saved for backward are not extra memory: count activations only, once each.
    param_storages = {p.untyped_storage().data_ptr() for p in problem.model.parameters()}
    seen_storages: set[int] = set()

    def count_saved(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages and ptr not in seen_storages:
            seen_storages.add(ptr)
            saved[0] += t.untyped_storage().nbytes()
        return t

    for step in range(1, steps + 1):
        if pos + problem.batch > n:
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos:pos + problem.batch] if n > problem.batch else order
        pos += problem.batch
        y = problem.y_train[idx]
        t0 = time.perf_counter()
        if zo:
            loss = opt.step(lambda idx=idx, y=y: F.cross_entropy(problem.forward("train", idx).float(), y)).item()
        else:
            opt.zero_grad(set_to_none=True)
            saved[0] = 0
            seen_storages.clear()
            with torch.autograd.graph.saved_tensors_hooks(count_saved, lambda t: t):
                out = F.cross_entropy(problem.forward("train", idx).float(), y)
            out.backward()
            opt.step()
            loss = out.item()
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            break
        if step % eval_every == 0 or step == steps:
            curve.append((step, _loss(problem, problem.train_eval)))
    trainable = sum(p.numel() for p in problem.trainable())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in problem.trainable() if p.grad is not None)
    largest = max(p.numel() for p in problem.trainable()) * 4  # one fp32 z (or update temporary) at a time
    extra = state_bytes(opt) + grads + (largest if zo else saved[0])
    result = {
        "optimizer": opt_name, "hp": dict(hp), "curve": curve, "acc": accuracy(problem),
        "final_loss": statistics.fmean(v for _, v in curve[-3:]), "step_time": statistics.median(times),
        "extra_bytes": extra, "trainable": trainable, "diverged": not all(math.isfinite(v) for _, v in curve),
        "skipped": getattr(opt, "skipped_nonfinite", 0),
    }
    if result["diverged"]:
        result["final_loss"] = float("inf")
    problem.reset()
    return result


def inference_time(problem: Problem, repeats: int = 5) -> float:
    """Median time of one forward pass over a training batch (the unit a ZO step costs two of)."""
    idx = torch.arange(min(problem.batch, len(problem.y_train)))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            problem.forward("train", idx)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steps_to_reach(curve: list[tuple[int, float]], target: float | None) -> int | None:
    """First measured step whose training loss is <= target (None if never, or if there is no target)."""
    if target is None:
        return None
    return next((s for s, v in curve if v <= target), None)


def sweep(problem: Problem, opt_name: str, grid: list[dict], steps: int, eval_every: int) -> tuple[dict, list]:
    """Runs every point of a grid; returns the best run (lowest final training loss) and all runs.

    Args:
        problem: What to train.
        opt_name: Optimizer name.
        grid: Hyper-parameter dicts.
        steps: Steps per run.
        eval_every: Steps between loss measurements.
    """
    runs = [run(problem, opt_name, hp, steps, eval_every) for hp in grid]
    return min(runs, key=lambda r: r["final_loss"]), runs
