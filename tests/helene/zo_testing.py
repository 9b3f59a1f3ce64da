"""Helpers shared by the zeroth-order optimizer tests: a tiny MLP, its data and loss, and the perturbation
directions of a step drawn independently of the optimizers, the documented way (seed stream, then per tensor)."""

from __future__ import annotations

import io

import torch

from helene.zo import rademacher


def mlp(seed=0, dtype=torch.float32):
    """Linear–Tanh–LayerNorm–Linear, 6 → 3, from a fixed global seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    return model.to(dtype)


def data(seed=1, n=16):
    """``n`` inputs of width 6 and class labels in 0..2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def closure(model, x, y, scale=1.0):
    """The cross-entropy closure a zeroth-order step calls (times ``scale``)."""
    return lambda: scale * torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def params(model):
    """A detached copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def step_seeds(opt_seed, step_index=0, n=1):
    """The ``n`` perturbation seeds of the ``step_index``-th step (one ``randint`` of ``n`` per step)."""
    seeds = torch.Generator().manual_seed(opt_seed)
    for _ in range(step_index + 1):
        drawn = torch.randint(0, 2**62, (n,), generator=seeds).tolist()
    return drawn


def directions(model, seed, perturbation="gaussian"):
    """z for every trainable parameter of ``model`` from one perturbation seed, in parameter order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            if perturbation == "rademacher":
                out[n] = rademacher(p.shape, gen, p.device)
            else:
                out[n] = torch.randn(p.shape, generator=gen, dtype=torch.float32)
    return out


def reference_directions(model, opt_seed, step_index=0, perturbation="gaussian"):
    """z of the ``step_index``-th step of a two-point optimizer seeded with ``opt_seed``."""
    return directions(model, step_seeds(opt_seed, step_index)[0], perturbation)


def checkpoint_round_trip(model, opt, dtype=torch.float32):
    """Saves model and optimizer through ``torch.save`` / ``torch.load(weights_only=True)``; returns a fresh
    :func:`mlp` (another init, so everything must come from the checkpoint) with the weights loaded, and the
    optimizer's loaded state dict."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = mlp(seed=99, dtype=dtype)
    resumed.load_state_dict(ckpt["model"])
    return resumed, ckpt["optim"]
