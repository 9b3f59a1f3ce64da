"""The rotation itself: orthogonality of exact Cayley, Cayley–Neumann error vs theory, fp64 gradcheck."""

from __future__ import annotations

import math

import peft
import pytest
import torch

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from oftv2.layer import bound_q
from peftplug_kernels import ops
from peftplug_kernels.cayley_neumann.reference import skew_from_triangle


def _layer(form="cayley_neumann", terms=5, width=64, block=16, dtype=torch.float32, **kw):
    model = torch.nn.Sequential(torch.nn.Linear(width, 8, bias=False)).to(dtype)
    cfg = OFTv2Config(
        target_modules=["0"], block_size=block, orthogonalization=form, neumann_terms=terms, **kw
    )
    return peft.get_peft_model(model, cfg, autocast_adapter_dtype=False).base_model.model[0]


def _q_with_spectral_norm(n_blocks, b, theta, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_vec = torch.randn(n_blocks, b * (b - 1) // 2, generator=gen, dtype=dtype)
    norms = torch.linalg.matrix_norm(skew_from_triangle(q_vec, b), ord=2)
    return q_vec * (theta / norms)[:, None]


def test_exact_cayley_is_orthogonal_in_fp32():
    layer = _layer(form="cayley", block=32)
    with torch.no_grad():
        layer.oftv2_Q["default"].copy_(_q_with_spectral_norm(2, 32, 0.9).float())
    r = layer.get_rotation("default")
    assert r.dtype == torch.float32
    err = torch.linalg.matrix_norm(r.transpose(-1, -2) @ r - torch.eye(32)).pow(2).sum().sqrt()
    assert err < 1e-5, err


@pytest.mark.parametrize("theta", [0.1, 0.3, 0.5])
def test_cayley_neumann_error_matches_theory(theta):
    """Q is normal with eigenvalues μ = ±iλ, so the truncation errors have closed forms:

    Taylor form (n terms):  R_exact − R_n = 2 Qⁿ (I − Q)⁻¹       ->  ||·||₂ = 2 θⁿ / sqrt(1 + θ²);
    PEFT product form:      R_exact − R_n = Qⁿ⁻¹ (I + Q)(I − Q)⁻¹ ->  ||·||₂ = θⁿ⁻¹;
    orthogonality:          RᵀR − I has eigenvalues |1 + μ − 2μⁿ|² / |1 − μ|² − 1 (Taylor form), which is
                            O(λⁿ⁺¹) for odd n and O(λⁿ) for even n: the error falls every two terms.
                            Product form: R = Cayley(Q)(I − Qⁿ⁻¹), eigenvalues |1 − μⁿ⁻¹|² − 1, which is
                            λ²⁽ⁿ⁻¹⁾ for even n (μⁿ⁻¹ imaginary) and O(λⁿ⁻¹) for odd n.
    """
    b = 16
    q_vec = _q_with_spectral_norm(3, b, theta)
    mu = torch.linalg.eigvals(skew_from_triangle(q_vec, b))  # [3, b], purely imaginary
    exact = ops.cayley_neumann(q_vec, b, form="cayley", impl="torch")
    eye = torch.eye(b, dtype=torch.float64)
    orth_errors = {}
    for n in range(2, 10):
        taylor = ops.cayley_neumann(q_vec, b, terms=n, form="cayley_neumann", impl="torch")
        product = ops.cayley_neumann(q_vec, b, terms=n, form="peft_cn", impl="torch")
        # Every block is scaled to ||Q||₂ = θ, so the largest block error is the closed form at θ.
        err_t = torch.linalg.matrix_norm(exact - taylor, ord=2).max().item()
        err_p = torch.linalg.matrix_norm(exact - product, ord=2).max().item()
        assert err_t == pytest.approx(2 * theta**n / math.sqrt(1 + theta**2), rel=1e-6, abs=1e-14)
        assert err_p == pytest.approx(theta ** (n - 1), rel=1e-6, abs=1e-14)
        measured = torch.linalg.matrix_norm(taylor.transpose(-1, -2) @ taylor - eye)
        eig = ((1 + mu - 2 * mu**n).abs() ** 2 / (1 - mu).abs() ** 2 - 1).real
        predicted = eig.pow(2).sum(-1).sqrt()
        assert torch.allclose(measured, predicted, rtol=1e-6, atol=1e-13)
        orth_errors[n] = measured.max().item()
        measured_p = torch.linalg.matrix_norm(product.transpose(-1, -2) @ product - eye)
        predicted_p = ((1 - mu ** (n - 1)).abs() ** 2 - 1).pow(2).sum(-1).sqrt()
        assert torch.allclose(measured_p, predicted_p, rtol=1e-5, atol=1e-13)
    for n in range(2, 8):
        assert orth_errors[n + 2] < orth_errors[n]


def test_taylor_form_beats_product_form_below_one_over_sqrt3():
    # 2θⁿ/sqrt(1+θ²) < θⁿ⁻¹  <=>  θ < 1/sqrt(3): the Taylor form is the more accurate one for small Q.
    b = 8
    for theta, taylor_wins in ((0.3, True), (0.8, False)):
        q_vec = _q_with_spectral_norm(1, b, theta)
        exact = ops.cayley_neumann(q_vec, b, form="cayley", impl="torch")
        t = (exact - ops.cayley_neumann(q_vec, b, terms=5, form="cayley_neumann", impl="torch")).norm()
        p = (exact - ops.cayley_neumann(q_vec, b, terms=5, form="peft_cn", impl="torch")).norm()
        assert (t < p) == taylor_wins


@pytest.mark.parametrize("form", ["cayley_neumann", "cayley", "peft_cn"])
@pytest.mark.parametrize("extra", [{}, {"block_share": True}, {"max_q_norm": 0.3}])
def test_gradcheck_rotation_fp64(form, extra):
    layer = _layer(form=form, width=12, block=4, dtype=torch.float64, **extra)
    assert layer.oftv2_Q["default"].dtype == torch.float64
    q0 = _q_with_spectral_norm(layer.oftv2_Q["default"].shape[0], 4, 0.4, seed=3)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)

    def rotated(q_vec, inp):
        # The layer's own path: bound, then the Cayley map, then the block rotation.
        q = bound_q(q_vec, layer.oftv2_settings["default"].max_q_norm)
        r = ops.cayley_neumann(q, 4, terms=5, form=form, impl="torch")
        return ops.block_rotate(inp, r, impl="torch")

    assert torch.autograd.gradcheck(rotated, (q0.clone().requires_grad_(True), x))


def test_layer_backward_matches_reference_gradient():
    """Gradient w.r.t. the stored triangle through the real layer equals autograd through a dense reference."""
    layer = _layer(form="cayley_neumann", width=16, block=4, dtype=torch.float64)
    q0 = _q_with_spectral_norm(4, 4, 0.3, seed=5)
    with torch.no_grad():
        layer.oftv2_Q["default"].copy_(q0)
    x = torch.randn(5, 16, dtype=torch.float64)
    layer(x).pow(2).sum().backward()
    q_ref = q0.clone().requires_grad_(True)
    r = ops.cayley_neumann(q_ref, 4, terms=5, form="cayley_neumann", impl="torch")
    dense = torch.block_diag(*r)
    ((x @ dense) @ layer.base_layer.weight.T).pow(2).sum().backward()
    assert torch.allclose(layer.oftv2_Q["default"].grad, q_ref.grad, atol=1e-10)
