"""Decomposition: SVD reconstruction, rank selection, InfoNCE, save/load, bad inputs."""

import json
import os

import pytest
import torch

import prompt_transfer as pt
from prompt_transfer.decompose import choose_rank, decomposition_infonce


def _prompts(k=4, length=5, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(length, dim, generator=g)
    return {f"task{i}": shared + 0.5 * torch.randn(length, dim, generator=g) for i in range(k)}


def test_full_rank_reconstructs_sources_exactly():
    prompts = _prompts()
    dec = pt.decompose(prompts, contrastive_weight=0.0)
    assert dec.rank == 4 and dec.source_names == list(prompts)
    torch.testing.assert_close(dec.reconstruct(), torch.stack(list(prompts.values())), atol=1e-5, rtol=0)
    # P_0 is the mean source prompt at full rank; the task-specific parts sum to zero.
    torch.testing.assert_close(dec.p0, torch.stack(list(prompts.values())).mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(dec.specific.sum(0), torch.zeros(5, 16), atol=1e-5, rtol=0)


def test_truncated_rank_equals_svd_projection_computed_here():
    prompts = _prompts(k=5)
    x = torch.stack(list(prompts.values())).reshape(5, -1).double()
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    expected = (x @ vh[:2].T @ vh[:2]).float().reshape(5, 5, 16)
    dec = pt.decompose(prompts, rank=2, contrastive_weight=0.0)
    torch.testing.assert_close(dec.reconstruct(), expected, atol=1e-5, rtol=1e-5)
    # The reconstruction error is exactly the discarded singular energy.
    err = (dec.reconstruct().double() - x.reshape(5, 5, 16)).pow(2).sum()
    assert err.item() == pytest.approx((s[2:] ** 2).sum().item(), rel=1e-4)


def test_explained_variance_picks_smallest_sufficient_rank():
    prompts = _prompts(k=5)
    x = torch.stack(list(prompts.values())).reshape(5, -1)
    s = torch.linalg.svdvals(x.double())
    share = torch.cumsum(s**2, 0) / (s**2).sum()
    target = float((share[1] + share[2]) / 2)  # between rank 2 and rank 3
    dec = pt.decompose(prompts, explained_variance=target, contrastive_weight=0.0)
    assert dec.rank == 3
    assert dec.settings["explained_variance_kept"] >= target
    assert pt.decompose(prompts, explained_variance=1.0, contrastive_weight=0.0).rank == 5


def test_contrastive_refinement_separates_and_keeps_reconstruction():
    prompts = _prompts(k=4)
    base = pt.decompose(prompts, contrastive_weight=0.0)
    dec = pt.decompose(prompts, contrastive_weight=1.0, contrastive_steps=150, lr=2e-2)
    assert dec.settings["infonce_end"] < dec.settings["infonce_start"]
    assert dec.settings["infonce_start"] == pytest.approx(
        float(decomposition_infonce(base.p0, base.specific, base.specific, 0.5)), rel=1e-5)
    rel = (dec.reconstruct() - base.reconstruct()).pow(2).mean() / base.reconstruct().pow(2).mean()
    assert rel.item() < 0.05
    assert dec.settings["relative_reconstruction_error"] == pytest.approx(rel.item(), rel=1e-3, abs=1e-6)


def test_info_nce_matches_hand_computation():
    a, p, n = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    t = 0.5
    cos_p, cos_n = 2**-0.5, torch.tensor([0.0, -1.0])
    expected = -(cos_p / t - torch.logsumexp(torch.cat([torch.tensor([cos_p / t]), cos_n / t]), 0))
    assert pt.info_nce(a, p, n, t).item() == pytest.approx(expected.item(), rel=1e-6)


def test_single_source_edge_case():
    prompt = torch.randn(3, 8)
    dec = pt.decompose([prompt], contrastive_steps=20)
    assert dec.rank == 1 and dec.num_sources == 1
    torch.testing.assert_close(dec.p0, prompt, atol=1e-5, rtol=0)
    assert torch.isfinite(dec.specific).all()
    torch.testing.assert_close(dec.reconstruct()[0], prompt, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[1, 1\] \(K = 1, the number"):
        pt.decompose([prompt], rank=2)


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts is empty"),
        ({}, {}, "prompts is empty"),
        ([torch.randn(3, 8), torch.randn(3, 9)], {}, "same .num_virtual_tokens, token_dim."),
        ([torch.randn(3, 8), torch.randn(4, 8)], {}, "same"),
        ([torch.randn(8)], {}, "must be 2-D"),
        ([torch.randn(3, 8)] * 2, {"rank": 3}, r"rank must be an int in \[1, 2\] \(K = 2, the number"),
        ([torch.randn(3, 8)] * 2, {"rank": 0}, "rank must be"),
        ([torch.randn(3, 8)] * 2, {"rank": 1, "explained_variance": 0.9}, "not both"),
        ([torch.randn(3, 8)] * 2, {"explained_variance": 1.5}, "explained_variance must be a finite real number in"),
        ([torch.randn(3, 8)] * 2, {"contrastive_weight": -1.0}, "contrastive_weight"),
        ([torch.randn(3, 8)] * 2, {"contrastive_temperature": 0.0}, "contrastive_temperature"),
        ([torch.full((3, 8), float("nan"))], {}, "NaN/Inf"),
        # Wrong types get the field's own message, not a bare TypeError or int() error.
        ([torch.randn(3, 8)] * 2, {"rank": 1.5}, r"rank must be an int in \[1, 2\] \(K = 2, the number"),
        ([torch.randn(3, 8)] * 2, {"rank": "two"}, r"rank must be an int in \[1, 2\] \(K = 2, the number.*'two'"),
        ([torch.randn(3, 8)] * 2, {"rank": True}, "rank must be an int"),
        ([torch.randn(3, 8)] * 2, {"explained_variance": "0.9"}, "explained_variance must be a finite real number in"),
        ([torch.randn(3, 8)] * 2, {"contrastive_weight": "0.1"}, "contrastive_weight must be a finite real number >= 0"),
        ([torch.randn(3, 8)] * 2, {"contrastive_steps": -5}, "contrastive_steps must be an int >= 0"),
        ([torch.randn(3, 8)] * 2, {"contrastive_steps": 2.5}, "contrastive_steps must be an int >= 0"),
    ],
)
def test_bad_inputs_raise_clear_errors(prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pt.decompose(prompts, **kwargs)


def test_save_load_roundtrip_atomic_and_corrupt(tmp_path):
    dec = pt.decompose(_prompts(k=3), rank=2, contrastive_steps=10)
    pt.save_decomposition(dec, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["decomposition.json", "decomposition.safetensors"]  # no temp files
    back = pt.load_decomposition(str(tmp_path))
    torch.testing.assert_close(back.p0, dec.p0, atol=0, rtol=0)
    torch.testing.assert_close(back.specific, dec.specific, atol=0, rtol=0)
    assert back.source_names == dec.source_names and back.rank == 2
    meta = json.loads((tmp_path / "decomposition.json").read_text())
    assert meta["settings"]["rank"] == 2 and meta["num_sources"] == 3
    meta["num_sources"] = 5
    (tmp_path / "decomposition.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shapes"):
        pt.load_decomposition(str(tmp_path))
    (tmp_path / "decomposition.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt PCT decomposition"):
        pt.load_decomposition(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a PCT decomposition"):
        pt.load_decomposition(str(tmp_path / "missing"))


def test_explained_variance_on_zero_prompts_keeps_a_valid_rank():
    """All-zero prompts have no energy to explain: rank 1 (exact), not K + 1."""
    dec = pt.decompose({"a": torch.zeros(2, 4), "b": torch.zeros(2, 4)}, explained_variance=0.9)
    assert dec.rank == 1 and dec.settings["explained_variance_kept"] == 1.0
    torch.testing.assert_close(dec.reconstruct(), torch.zeros(2, 2, 4), atol=0, rtol=0)
    for share in (0.5, 1.0):
        assert 1 <= choose_rank(torch.tensor([3.0, 2.0, 1.0]), share) <= 3
