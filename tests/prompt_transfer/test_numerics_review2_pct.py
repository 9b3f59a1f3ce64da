"""Second numerics review of PCT: decomposition, fusion, auxiliary loss and CLI, each against a reference here."""

import peft
import pytest
import torch

import prompt_transfer as pt
from prompt_transfer.model import PCTPromptEncoder

L, D, K = 4, 32, 3


def _encoder(tmp_path, prompts, contrastive_weight=0.0, **config):
    """A PCT prompt encoder (no base model) on the decomposition of ``prompts``."""
    dec = pt.decompose(prompts, contrastive_weight=contrastive_weight, contrastive_steps=50)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    cfg = pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec"), token_dim=D, **config)
    cfg.num_transformer_submodules = 1
    return PCTPromptEncoder(cfg), dec


def _reference_info_nce(anchor, positive, negative, t, eps):
    """-log softmax of the positive among [positive, negative], cosines with norms floored at eps."""
    unit = [v / max(float(v.norm()), eps) for v in (anchor, positive, negative)]
    pos, neg = float(unit[0] @ unit[1]) / t, float(unit[0] @ unit[2]) / t
    return -pos + float(torch.logsumexp(torch.tensor([pos, neg], dtype=torch.float64), 0))


@pytest.mark.parametrize("k", [1, K])
def test_auxiliary_loss_gradient_is_bounded_when_the_specific_part_starts_at_zero(tmp_path, k):
    # Uniform attention at init gives sum_k a_k S_k = mean_k S_k = 0 (the SVD centres the S_k; K = 1: S_1 = 0) and
    # R = 0: the anchor and the positive are ~0. The plain cosine's 1/|x| gradient was 3e3 here (task: ~1e-5).
    g = torch.Generator().manual_seed(0)
    enc, dec = _encoder(tmp_path, {f"s{i}": torch.randn(L, D, generator=g) for i in range(k)})
    aux = enc.auxiliary_loss()
    aux.backward()
    grads = [p.grad.abs().max().item() for p in enc.parameters() if p.grad is not None]
    assert grads and max(grads) < 0.1, grads
    # Reference: the documented loss with norms floored at a tenth of the sources' task-specific scale.
    fus = enc.embedding
    scale = float(dec.specific.flatten(1).norm(dim=1).pow(2).mean().sqrt()) or float(dec.p0.norm())
    mix = torch.einsum("k,kld->ld", fus.attention().detach(), dec.specific).flatten().double()
    ref = _reference_info_nce(mix + fus.residual.detach().flatten().double(), mix, dec.p0.flatten().double(),
                              0.5, 0.1 * scale)
    assert aux.item() == pytest.approx(0.01 * ref, rel=1e-4)


def test_auxiliary_loss_of_an_ordinary_anchor_is_the_plain_cosine_info_nce(tmp_path):
    g = torch.Generator().manual_seed(1)
    enc, dec = _encoder(tmp_path, {f"s{i}": torch.randn(L, D, generator=g) for i in range(K)}, contrastive_weight=0.1)
    fus = enc.embedding
    with torch.no_grad():
        fus.query.copy_(torch.randn(D, generator=g) * 3)
        fus.residual.copy_(torch.randn(L, D, generator=g))
    mix = torch.einsum("k,kld->ld", fus.attention().detach(), dec.specific).flatten().double()
    anchor = mix + fus.residual.detach().flatten().double()
    ref = _reference_info_nce(anchor, mix, dec.p0.flatten().double(), 0.5, 1e-12)
    assert enc.auxiliary_loss().item() == pytest.approx(0.01 * ref, rel=1e-4)


def test_auxiliary_weight_does_not_take_over_target_training(tiny_model, tmp_path):
    """A 0.01-weighted regulariser must not decide the attention: its first gradient drove it one-hot."""
    g = torch.Generator().manual_seed(0)
    width = tiny_model("llama").get_input_embeddings().weight.shape[1]
    dec = pt.decompose({f"s{i}": 0.5 * torch.randn(L, width, generator=g) for i in range(K)}, contrastive_weight=0)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    ids = torch.randint(5, 100, (2, 6), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    runs = {}
    for weight in (0.0, 0.01):
        model = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(
            task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec"), contrastive_weight=weight))
        runs[weight] = pt.train_prompt(model, [batch], steps=10, lr=0.05)
    plain, with_aux = runs[0.0], runs[0.01]
    # Before the fix: attention [0, 0, 1] against [0.28, 0.24, 0.48], and a loss of 4.62 against 4.42.
    assert max(with_aux["attention"][-1].values()) < 0.8
    assert with_aux["loss"][-1] < plain["loss"][-1] + 0.05


def test_identical_sources_have_no_task_specific_part():
    x = torch.randn(L, D, generator=torch.Generator().manual_seed(0))
    dec = pt.decompose({"a": x, "b": x.clone(), "c": x.clone()})
    # Before: every S_k was ~6% of |x| along -P_0 (refinement on zero vectors) and the InfoNCE rose 1.39 -> 2.77.
    assert dec.specific.abs().max().item() < 1e-5
    torch.testing.assert_close(dec.p0, x, atol=1e-5, rtol=0)
    assert dec.settings["contrastive_skipped"] == "identical sources"


def test_refinement_keeps_each_source_reconstructible_whatever_its_norm():
    g = torch.Generator().manual_seed(0)
    prompts = {"big": 10 * torch.randn(L, 16, generator=g), "a": torch.randn(L, 16, generator=g),
               "b": torch.randn(L, 16, generator=g)}
    x = torch.stack(list(prompts.values()))
    dec = pt.decompose(prompts)
    sq_err = (dec.reconstruct() - x).flatten(1).pow(2).sum(1) / x.flatten(1).pow(2).sum(1)
    # Before: the small sources came back 15-19% off (norm ratio) while the pooled error read 4e-4.
    assert sq_err.sqrt().max().item() < 0.05
    assert dec.settings["max_source_relative_error"] == pytest.approx(sq_err.max().item(), rel=1e-3)
    assert dec.settings["relative_reconstruction_error"] == pytest.approx(
        ((dec.reconstruct() - x).pow(2).sum() / x.pow(2).sum()).item(), rel=1e-3)


@pytest.mark.parametrize("fusion", ["attention", "mean"])
def test_fused_prompt_matches_the_documented_formula(tmp_path, fusion):
    g = torch.Generator().manual_seed(2)
    enc, dec = _encoder(tmp_path, {f"s{i}": torch.randn(L, D, generator=g) for i in range(K)},
                        contrastive_weight=0.1, fusion=fusion, attention_temperature=0.3)
    fus = enc.embedding
    with torch.no_grad():
        fus.residual.copy_(torch.randn(L, D, generator=g))
        if fusion == "attention":
            fus.query.copy_(torch.randn(D, generator=g))
            fus.key_offsets.copy_(0.1 * torch.randn(K, D, generator=g))
    s = dec.specific.double()
    if fusion == "attention":
        pooled = s.max(dim=1).values
        keys = pooled / pooled.norm(dim=1, keepdim=True) + fus.key_offsets.detach().double()
        a = torch.softmax(keys @ fus.query.detach().double() / (0.3 * D**0.5), 0)
    else:
        a = torch.full((K,), 1.0 / K, dtype=torch.float64)
    ref = dec.p0.double() + torch.einsum("k,kld->ld", a, s) + fus.residual.detach().double()
    torch.testing.assert_close(fus.fused().double(), ref, atol=1e-5, rtol=1e-5)
    if fusion == "mean":
        assert sorted(n for n, _ in fus.named_parameters()) == ["residual"]


@pytest.mark.parametrize("command", ["decompose", "export"])
def test_cli_output_that_is_a_file_is_a_one_line_error(tiny_model, tmp_path, capsys, command):
    from prompt_transfer.cli import main

    for i in range(2):
        m = peft.get_peft_model(tiny_model("llama"), pt.prompt_tuning_config("CAUSAL_LM", 3, init="vocab"))
        m.save_pretrained(str(tmp_path / f"src{i}"))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    if command == "decompose":
        argvs = [["decompose", str(tmp_path / "src0"), str(tmp_path / "src1"), "--out", out]
                 for out in (str(blocker), str(blocker / "sub"))]
    else:
        assert main(["decompose", str(tmp_path / "src0"), str(tmp_path / "src1"), "--out", str(tmp_path / "dec"),
                     "--contrastive-steps", "0"]) == 0
        model = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM",
                                                                      decomposition_path=str(tmp_path / "dec")))
        model.save_pretrained(str(tmp_path / "pct"))
        argvs = [["export", str(tmp_path / "pct"), out] for out in (str(blocker), str(blocker / "sub"))]
    for argv in argvs:
        capsys.readouterr()
        # Before: FileExistsError / NotADirectoryError tracebacks (exit status 1).
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "is a file" in err and str(blocker) in err, err
    assert blocker.read_text() == "x"
