"""Rotation diagnostics: values against direct computation, and the divergence warning."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

import oftv2  # noqa: F401
from oftv2 import NeumannDivergenceWarning, OFTv2Config, rotation_diagnostics
from oftv2.diagnostics import format_diagnostics
from peftplug_kernels.cayley_neumann.reference import skew_from_triangle


def _model(form="cayley_neumann", **kw):
    model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    cfg = OFTv2Config(target_modules=["0", "2"], block_size=4, orthogonalization=form, **kw)
    return peft.get_peft_model(model, cfg)


def test_values_match_direct_computation():
    peft_model = _model()
    layer = peft_model.base_model.model[0]
    with torch.no_grad():
        layer.oftv2_Q["default"].normal_(0, 0.2)
    reports = rotation_diagnostics(peft_model, warn=False)
    assert [r.layer.rsplit(".", 1)[-1] for r in reports] == ["0", "2"]
    first = reports[0]
    r = layer.get_delta_weight("default").double()
    assert first.orth_error == pytest.approx(
        torch.linalg.matrix_norm(r.T @ r - torch.eye(32, dtype=torch.float64)).item(), rel=1e-6
    )
    q = skew_from_triangle(layer.oftv2_Q["default"].double(), 4)
    assert first.q_spectral_norm == pytest.approx(torch.linalg.matrix_norm(q, ord=2).max().item(), rel=1e-6)
    assert reports[1].orth_error == 0.0 and reports[1].q_spectral_norm == 0.0  # untouched layer: R = I
    assert "DIVERGES" not in format_diagnostics(reports)


def test_shared_block_counts_once_per_position():
    model = torch.nn.Sequential(torch.nn.Linear(32, 4))
    peft_model = peft.get_peft_model(model, OFTv2Config(target_modules=["0"], block_size=8, block_share=True))
    layer = peft_model.base_model.model[0]
    with torch.no_grad():
        layer.oftv2_Q["default"].normal_(0, 0.2)
    report = rotation_diagnostics(peft_model, warn=False)[0]
    r = layer.get_delta_weight("default").double()
    assert report.orth_error == pytest.approx(
        torch.linalg.matrix_norm(r.T @ r - torch.eye(32, dtype=torch.float64)).item(), rel=1e-6
    )


def test_warns_when_neumann_series_diverges_only():
    for form, should_warn in (("cayley_neumann", True), ("peft_cn", True), ("cayley", False)):
        peft_model = _model(form=form)
        with torch.no_grad():
            peft_model.base_model.model[0].oftv2_Q["default"].normal_(0, 2.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = rotation_diagnostics(peft_model)
        hits = [w for w in caught if issubclass(w.category, NeumannDivergenceWarning)]
        assert bool(hits) == should_warn, form
        assert reports[0].q_spectral_norm > 1
        if should_warn:
            assert "base_model.model.0" in str(hits[0].message) and "DIVERGES" in format_diagnostics(reports)


def test_bound_keeps_reported_norm_below_one():
    peft_model = _model(max_q_norm=0.9)
    with torch.no_grad():
        peft_model.base_model.model[0].oftv2_Q["default"].normal_(0, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeumannDivergenceWarning)
        reports = rotation_diagnostics(peft_model)
    assert max(r.q_spectral_norm for r in reports) <= 0.9 + 1e-6
