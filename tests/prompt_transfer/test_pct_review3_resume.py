"""Third review of PCT: resuming training from a saved adapter whose decomposition folder was decomposed again."""

import pytest
import torch
from pct_testing import pct_model_on_saved_decomposition

import prompt_transfer as pt


@pytest.mark.parametrize("saved", ["adapter", "export"])
def test_resume_ignores_a_decomposition_folder_reused_with_another_shape(tiny_model, tmp_path, monkeypatch, saved):
    # The saved adapter (and an export's pct_state/) holds its own P_0 and S_k; its decomposition_path now holds a
    # decomposition of 4 sources of 5 tokens. load_pct_for_training refused it ("decomposition at ... has K=4, l=5")
    # although the folder is not needed, which PeftModel.from_pretrained of the same adapter already accepted.
    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(1)
    model = pct_model_on_saved_decomposition(tiny_model, "decomposition", g)
    fusion = model.prompt_encoder["default"].embedding
    with torch.no_grad():
        fusion.residual.normal_(generator=g)
        fusion.query.normal_(generator=g)
    x = torch.randint(4, 90, (2, 8), generator=g)
    model.eval()
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained("adapter")
    pt.export_prompt_tuning(model, "export")
    pt.save_decomposition(pt.decompose({f"t{i}": torch.randn(5, 64, generator=g) for i in range(4)},
                                       contrastive_steps=5), "decomposition")

    resumed = pt.load_pct_for_training(tiny_model("llama"), saved)

    resumed.eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(x).logits, expected, rtol=0, atol=1e-6)
    config = resumed.peft_config["default"]
    assert (config.num_sources, config.num_virtual_tokens, config.source_names) == (3, 3, ["s0", "s1", "s2"])
    assert config.decomposition_path == "decomposition"  # still recorded for the adapter saved next
    trainable = sorted(n.rsplit(".", 1)[-1] for n, p in resumed.named_parameters() if p.requires_grad)
    assert trainable == ["key_offsets", "query", "residual"]
    # It trains on from there: the query moves.
    before = resumed.prompt_encoder["default"].embedding.query.detach().clone()
    pt.train_prompt(resumed, [{"input_ids": x, "labels": x}], steps=1, lr=1e-2)
    assert not torch.equal(resumed.prompt_encoder["default"].embedding.query, before)
