"""Second review of PCT's shape handling: source prompts of another length or width, and saved PCT adapters loaded
onto a model of another width, are refused with one clear ``ValueError`` (never tiled or failing inside torch)."""

from __future__ import annotations

import peft
import pytest
import torch
from pct_testing import pct_model_on_saved_decomposition

import prompt_transfer as pt

L, D = 4, 64


@pytest.fixture
def pct_dir(tiny_model, tmp_path):
    gen = torch.Generator().manual_seed(0)
    dec = pt.decompose({f"s{i}": torch.randn(L, D, generator=gen) for i in range(3)}, contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    model = peft.get_peft_model(tiny_model("llama"),
                                pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec")))
    model.save_pretrained(tmp_path / "pct")
    return tmp_path / "pct"


@pytest.mark.parametrize(("family", "task", "task_type"), [("llama", "causal_lm", "CAUSAL_LM"),
                                                           ("t5", "seq2seq", "SEQ_2_SEQ_LM")])
@pytest.mark.parametrize("length", [4, 16])
def test_set_prompt_refuses_a_source_prompt_of_another_length(family, task, task_type, length, tiny_model):
    # An 8-token adapter's weight is [8 * submodules, d]: 4 (and, for T5's two submodules, 16) rows divide it, and
    # were silently tiled into a different prompt.
    model = peft.get_peft_model(tiny_model(family, task), pt.prompt_tuning_config(task_type, 8))
    before = model.prompt_encoder["default"].embedding.weight.detach().clone()
    with pytest.raises(ValueError, match=r"does not fit adapter 'default'.*\[8, 64\]"):
        pt.set_prompt(model, torch.randn(length, D))
    assert torch.equal(model.prompt_encoder["default"].embedding.weight, before)
    prompt = torch.randn(8, D)
    pt.set_prompt(model, prompt)
    weight = model.prompt_encoder["default"].embedding.weight.detach()
    assert torch.equal(weight, prompt.repeat(weight.shape[0] // 8, 1))


def test_spot_flat_mode_refuses_prompts_of_another_length():
    with pytest.raises(ValueError, match=r"mode='flat'.*\(8, 64\).*\(4, 64\)"):
        pt.spot_select(torch.randn(4, D), {"a": torch.randn(8, D)}, mode="flat")
    best, sims = pt.spot_select(torch.ones(4, D), {"a": torch.ones(8, D)})  # token means compare across lengths
    assert best == "a" and sims["a"] == pytest.approx(1.0)


def test_saved_pct_adapter_on_a_model_of_another_width_fails_when_loaded(pct_dir, tiny_model):
    narrow = {"hidden_size": 32, "intermediate_size": 64}
    with pytest.raises(ValueError, match=r"token_dim=64 .*input embeddings \(width 32\)"):
        peft.PeftModel.from_pretrained(tiny_model("llama", **narrow), pct_dir)
    with pytest.raises(ValueError, match=r"token_dim=64 .*input embeddings \(width 32\)"):
        pt.load_pct_for_training(tiny_model("llama", **narrow), str(pct_dir))
    # The same adapter on its own width still loads.
    assert pt.load_pct_for_training(tiny_model("llama"), str(pct_dir)) is not None


def test_a_saved_adapter_loads_after_its_decomposition_folder_was_reused(tiny_model, tmp_path, monkeypatch):
    # The docs' relative decomposition_path, decomposed again for another experiment (K=4, 5 tokens): the saved
    # adapter holds its own P_0 and S_k, so it loads and computes what it did.
    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(1)
    model = pct_model_on_saved_decomposition(tiny_model, "decomposition", g)
    x = torch.randint(4, 90, (2, 8), generator=g)
    model.eval()
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained("adapter")
    pt.save_decomposition(pt.decompose({f"t{i}": torch.randn(5, 64, generator=g) for i in range(4)},
                                       contrastive_steps=5), "decomposition")
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-6)
