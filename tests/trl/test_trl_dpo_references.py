"""DPO's reference with each of our adapter types (docs/trl.md, "DPO details").

With ``peft_config=`` TRL computes the reference inside ``model.disable_adapter()``: that must give the base model's
logits for steering, PCT and QOFT as for OFTv2 (``test_trl_dpo.py``), also after the adapter trained. With a
``PeftModel`` whose adapter already trained and ``ref_model=None``, TRL copies it into a frozen ``ref`` adapter by
renaming ``.default.`` to ``.ref.`` in parameter names: a steering vector is named
``<block>.steer_vector.default.weight`` for this (``peftplug.adapter_params``), so the reference is the SFT'd steered
model (until it was ``<block>.steer_vector.default`` and the reference silently was the unsteered base). With a
trained QOFT adapter TRL copies ``ref`` in fp32 and casts only the policy to bf16.
"""

from __future__ import annotations

import math

import peft
import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl_helpers import preference_rows, prompt_completion_rows

import prompt_transfer as pt
from peftplug.tiny import char_tokenizer, tiny_model
from steering import SteeringConfig

IDS = torch.tensor([[5, 9, 14, 20, 33, 41]])


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        # Prompt learning (PCT) returns the virtual tokens' positions first: compare the real tokens' positions.
        return model(IDS, attention_mask=torch.ones_like(IDS)).logits[:, -IDS.shape[1]:]


def _config(kind: str, decomposition: str):
    if kind == "steering":
        return SteeringConfig(layers=[1], task_type="CAUSAL_LM")
    return pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, decomposition_path=decomposition)


@pytest.mark.parametrize("kind", ["steering", "pct"])
def test_the_disabled_adapter_is_the_base_model_after_dpo(trl_args, decomposition, kind):
    trainer = trl.DPOTrainer(
        model=tiny_model("llama"), args=trl_args(trl.DPOConfig), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(), peft_config=_config(kind, decomposition),
    )
    trainer.train()
    base = _logits(tiny_model("llama"))
    assert not torch.allclose(_logits(trainer.model), base, atol=1e-4)  # the adapter trained and acts
    with trainer.model.disable_adapter():
        torch.testing.assert_close(_logits(trainer.model), base, atol=1e-6, rtol=0)


def test_the_disabled_qoft_adapter_is_the_nf4_base_after_dpo(trl_args):
    pytest.importorskip("bitsandbytes")
    from oftv2 import OFTv2Config
    from peftplug.loading import load_model

    def nf4():
        return load_model("tiny:llama", "causal_lm", quantization="nf4")

    base = _logits(nf4())
    trainer = trl.DPOTrainer(
        model=nf4(), args=trl_args(trl.DPOConfig), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(),
        peft_config=OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8, task_type="CAUSAL_LM"),
    )
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # identity init = reference
    assert not torch.allclose(_logits(trainer.model), base, atol=1e-5)
    with trainer.model.disable_adapter():
        torch.testing.assert_close(_logits(trainer.model), base, atol=1e-6, rtol=0)


def test_a_trained_qoft_adapter_is_copied_then_only_the_policy_is_cast_to_bf16(trl_args):
    pytest.importorskip("bitsandbytes")
    from oftv2 import OFTv2Config
    from peftplug.loading import load_model

    model = peft.get_peft_model(load_model("tiny:llama", "causal_lm", quantization="nf4"),
                                OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "pretrained" adapter: far from the identity
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    trainer = trl.DPOTrainer(
        model=model, args=trl_args(trl.DPOConfig, max_steps=1), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(),
    )
    dtypes = {(n.split("oftv2_Q.")[1].split(".")[0], p.dtype) for n, p in trainer.model.named_parameters()
              if "oftv2_Q" in n}
    assert dtypes == {("default", torch.bfloat16), ("ref", torch.float32)}  # docs/trl.md, QOFT section
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)


def test_a_trained_steering_vector_is_copied_into_the_dpo_reference(trl_args):
    # The usual pipeline: SFT a steering vector, then DPO on top of it with ref_model=None.
    sft = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig, learning_rate=0.1, max_steps=4),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=SteeringConfig(layers=[1], task_type="CAUSAL_LM"),
    )
    sft.train()
    vector = sft.model.base_model.get_vectors()[1]
    assert vector.abs().max() > 0.05  # it trained: a reference left at zero (the unsteered base) would differ
    trainer = trl.DPOTrainer(
        model=sft.model, args=trl_args(trl.DPOConfig), train_dataset=Dataset.from_list(preference_rows()),
        processing_class=char_tokenizer(),
    )
    # TRL's `.default.` -> `.ref.` copy reached the vector (named `steer_vector.default.weight`).
    assert sorted(trainer.model.peft_config) == ["default", "ref"]
    assert torch.equal(trainer.model.base_model.get_vectors("ref")[1], vector)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference (the SFT'd model)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert not torch.equal(trainer.model.base_model.get_vectors()[1], vector)  # the policy trained
    assert torch.equal(trainer.model.base_model.get_vectors("ref")[1], vector)  # the reference stayed
