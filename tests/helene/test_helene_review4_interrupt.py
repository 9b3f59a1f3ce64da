"""Fourth review: a raise while a two-point step restores θ and applies its update (a Ctrl-C landing while z is
drawn the third time) must leave no parameter perturbed.

The closure-phase raise was covered (tests/helene/test_robustness.py); the restore is fused with the update, and a
raise there used to leave every tensor not yet reached at θ − εz. The fault is injected where a signal lands: in
the n-th draw of z after the last closure call (a ``TorchFunctionMode`` raising ``KeyboardInterrupt`` from
``torch.randn``); the references are real steps of identical models.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from helene import ZOSGD, Helene, ZOAdam

MAKERS = {
    "zosgd": lambda ps, m: ZOSGD(ps, lr=1e-2, weight_decay=0.1, seed=7, master_weights=m),
    "zoadam": lambda ps, m: ZOAdam(ps, lr=1e-2, seed=7, master_weights=m),
    "helene": lambda ps, m: Helene(ps, lr=1e-2, hessian="agnb", hessian_interval=1, anneal_horizon=5.0, seed=7,
                                   master_weights=m),
}


class _InterruptAtDraw(TorchFunctionMode):
    """Raises KeyboardInterrupt in the ``n``-th ``torch.randn`` after :attr:`armed` is set."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.armed, self.draws = n, False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed and func is torch.randn:
            self.draws += 1
            if self.draws == self.n:
                raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.randn(16, 4), torch.randn(16, 1)


def _closure(model, x, y, calls=None, arm=None, nan_at_minus=False):
    def closure():
        if calls is not None:
            calls[0] += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        if calls is not None and calls[0] == 2:  # L−: the restore-and-update pass comes next
            if arm is not None:
                arm.armed = True
            if nan_at_minus:
                loss = loss * float("nan")
        return loss
    return closure


@pytest.mark.parametrize("masters", ["auto", True])
@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("draw", [1, 2, 3])
def test_a_raise_during_the_update_leaves_no_parameter_perturbed(name, masters, draw):
    """Interrupted while drawing z for tensor ``draw − 1``: the tensors before it carry the uninterrupted step's
    update, it and every later one are back at θ bit for bit as a step skipped for a non-finite L− leaves them."""
    model, x, y = _problem()
    updated, skipped = copy.deepcopy(model), copy.deepcopy(model)
    MAKERS[name](updated.parameters(), masters).step(_closure(updated, x, y))
    MAKERS[name](skipped.parameters(), masters).step(_closure(skipped, x, y, [0], nan_at_minus=True))

    opt = MAKERS[name](model.parameters(), masters)
    mode = _InterruptAtDraw(draw)
    with pytest.raises(KeyboardInterrupt), mode:
        opt.step(_closure(model, x, y, [0], arm=mode))
    params = list(model.parameters())
    for i, (p, u, s) in enumerate(zip(params, updated.parameters(), skipped.parameters())):
        expected = u if i < draw - 1 else s
        assert torch.equal(p.detach(), expected.detach()), (i, (p - expected).abs().max().item())
    assert not any(torch.equal(p, u) for p, u in zip(params[draw - 1:], updated.parameters()))  # not a full step


@pytest.mark.parametrize("masters", ["auto", True])
def test_a_raise_while_a_nonfinite_step_restores_leaves_no_parameter_perturbed(masters):
    model, x, y = _problem()
    skipped = copy.deepcopy(model)
    ZOSGD(skipped.parameters(), lr=1e-2, seed=7, master_weights=masters).step(
        _closure(skipped, x, y, [0], nan_at_minus=True))
    opt = ZOSGD(model.parameters(), lr=1e-2, seed=7, master_weights=masters)
    mode = _InterruptAtDraw(2)
    with pytest.raises(KeyboardInterrupt), mode:
        opt.step(_closure(model, x, y, [0], arm=mode, nan_at_minus=True))
    for p, s in zip(model.parameters(), skipped.parameters()):
        assert torch.equal(p.detach(), s.detach())
