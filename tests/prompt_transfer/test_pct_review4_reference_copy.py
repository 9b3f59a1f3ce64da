"""Fourth review: a copy of a PCT adapter made from its config keeps the adapter's ``P_0`` and ``S_k``.

TRL's ``DPOTrainer(model=peft_model, ref_model=None)`` (and KTO's) builds its reference as
``model.add_adapter("ref", model.peft_config["default"])`` and copies the ``.default.`` *parameters* into it. ``P_0``
and ``S_k`` are buffers, so the reference read them from the decomposition folder again: a decomposition saved there
since (same shapes) made the reference silently differ from the policy (max |ΔP| 2.98 on the tiny prompts, first DPO
loss not log 2), and a folder gone (a resumed adapter, another machine) failed at the reference's first forward with
``MissingFileError``.
"""

from __future__ import annotations

import copy
import math
import shutil

import peft
import pytest
import torch

import prompt_transfer as pt
from peftplug.tiny import char_tokenizer, tiny_model


def _decomposition(seed: int) -> pt.Decomposition:
    g = torch.Generator().manual_seed(seed)
    return pt.decompose({f"src{i}": torch.randn(4, 64, generator=g) * 0.5 for i in range(3)}, contrastive_steps=5)


def _trained(folder: str) -> peft.PeftModel:
    """A PCT model on ``folder`` whose query and residual moved (as after training)."""
    pt.save_decomposition(_decomposition(0), folder)
    model = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=folder))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.prompt_encoder["default"].parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _prompt(model, name: str) -> torch.Tensor:
    return model.prompt_encoder[name].embedding.weight.detach()


def _change_folder(folder: str, how: str) -> None:
    if how == "decomposed again":
        pt.save_decomposition(_decomposition(7), folder)  # same K, l and d: nothing refuses it
    else:
        shutil.rmtree(folder)


@pytest.mark.parametrize("how", ["decomposed again", "removed"])
def test_dpo_reference_copy_of_a_trained_pct_adapter_equals_the_policy(tmp_path, how):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    folder = str(tmp_path / "dec")
    model = _trained(folder)
    policy = _prompt(model, "default").clone()
    _change_folder(folder, how)
    rows = [{"prompt": f"add {i} {j} =", "chosen": f" {i + j}", "rejected": f" {i * j + 7}"}
            for i, j in [(1, 2), (3, 4), (2, 5), (6, 1)]]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=4,
                         learning_rate=1e-2, bf16=False, use_cpu=True, report_to=[], logging_steps=1,
                         save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = trl.DPOTrainer(model=model, ref_model=None, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=char_tokenizer())
    assert "ref" in trainer.model.peft_config
    torch.testing.assert_close(_prompt(trainer.model, "ref"), policy, atol=0, rtol=0)
    trainer.train()
    # Policy = reference at the first step: DPO's loss is exactly -log sigmoid(0).
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_an_adapter_added_with_the_config_of_a_resumed_or_copied_one_keeps_its_sources(tmp_path):
    folder, saved = str(tmp_path / "dec"), str(tmp_path / "adapter")
    trained = _trained(folder)
    trained.save_pretrained(saved)
    sources = trained.prompt_encoder["default"].embedding
    shutil.rmtree(folder)  # resumed elsewhere: the adapter carries P_0 and S_k, the folder is not there
    for model in (pt.load_pct_for_training(tiny_model("llama"), saved), copy.deepcopy(trained)):
        model.add_adapter("copy", model.peft_config["default"])
        copied = model.prompt_encoder["copy"].embedding
        torch.testing.assert_close(copied.p0, sources.p0, atol=0, rtol=0)
        torch.testing.assert_close(copied.specific, sources.specific, atol=0, rtol=0)
        # A fresh adapter otherwise: its own query and residual start at zero (PEFT's convention for add_adapter).
        assert not copied.query.any() and not copied.residual.any()
        model.set_adapter("copy")
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))  # reads the prompt (was MissingFileError)


def test_an_adapter_with_its_own_config_still_reads_the_folder(tmp_path):
    folder = str(tmp_path / "dec")
    model = _trained(folder)
    pt.save_decomposition(_decomposition(7), folder)
    model.add_adapter("other", pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=folder))
    torch.testing.assert_close(model.prompt_encoder["other"].embedding.p0, _decomposition(7).p0, atol=0, rtol=0)
