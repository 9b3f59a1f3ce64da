"""Third review of the zeroth-order optimizers' options: on/off switches given as strings."""

import pytest
import torch

from helene import FZOO, ZOSGD, Helene, ZOAdam


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("make, field", [
    (lambda v: Helene(_params(), anneal=v), "anneal"),
    (lambda v: Helene(_params(), bias_correction=v), "bias_correction"),
    (lambda v: ZOSGD(_params(), sync_seed=v), "sync_seed"),
    (lambda v: ZOAdam(_params(), sync_seed=v), "sync_seed"),
    (lambda v: FZOO(_params(), sync_seed=v), "sync_seed"),
])
@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_a_switch_that_is_not_a_bool_names_the_field(make, field, value):
    # bool("false") is True: Helene(anneal="false") annealed and bias_correction="false" corrected, silently.
    with pytest.raises(ValueError, match=rf"^{field} must be True or False, got {value!r}$"):
        make(value)


def test_helene_without_annealing_uses_beta1_from_the_first_update():
    opt = Helene(_params(), anneal=False, bias_correction=False, anneal_horizon=10)
    assert (opt.anneal, opt.bias_correction) == (False, False)
    assert opt.alpha(0, 0.9) == 0.9  # annealing would give 1.0 at t = 0
    assert Helene(_params(), anneal=True, anneal_horizon=10).alpha(0, 0.9) == 1.0
