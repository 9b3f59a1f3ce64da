"""``SFTTrainer`` checkpoints and ``train(resume_from_checkpoint=...)`` with each adapter type: a run resumed from
the step-2 checkpoint on a fresh model ends where the uninterrupted 4-step run ends (adapter weights, optimizer
state and data order restored). Bit for bit for fp32 adapters; for QOFT close only, since TRL trains a quantized
model's adapter in bf16 and PEFT's ``load_adapter`` (how ``Trainer`` resumes a PEFT model) reloads it in fp32, as
for LoRA (docs/trl.md)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl_helpers import prompt_completion_rows

import prompt_transfer as pt
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model
from steering import SteeringConfig


def _pct(tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = {f"src{i}": torch.randn(4, 64, generator=g) * 0.5 for i in range(3)}
    path = str(tmp_path / "dec")
    pt.save_decomposition(pt.decompose(prompts, contrastive_steps=30), path)
    return pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, decomposition_path=path)


def _nf4():
    pytest.importorskip("bitsandbytes")
    from peftplug.loading import load_model

    return load_model("tiny:llama", "causal_lm", quantization="nf4")


CASES = {
    "oftv2": (tiny_model, lambda _: OFTv2Config(target_modules="all-linear", block_size=8)),
    "steering": (tiny_model, lambda _: SteeringConfig(layers=[1], task_type="CAUSAL_LM")),
    "pct": (tiny_model, _pct),
    "qoft": (_nf4, lambda _: OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_resume_from_checkpoint_continues_the_run(trl_args, tmp_path, kind):
    make_model, make_config = CASES[kind]
    args = trl_args(trl.SFTConfig, max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)

    def trainer():
        return trl.SFTTrainer(model=make_model(), args=args, train_dataset=Dataset.from_list(prompt_completion_rows()),
                              processing_class=char_tokenizer(), peft_config=make_config(tmp_path))

    full = trainer()
    full.train()
    expected = {n: p.detach().clone() for n, p in full.model.named_parameters() if p.requires_grad}
    resumed = trainer()
    resumed.train(resume_from_checkpoint=f"{args.output_dir}/checkpoint-2")
    assert resumed.state.global_step == 4
    got = {n: p.detach() for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert got.keys() == expected.keys() and expected
    # Equal weights need Adam's restored moments too: a fresh optimizer would take other steps 3 and 4.
    for name, value in got.items():
        if kind == "qoft":
            assert value.dtype == torch.float32 and expected[name].dtype == torch.bfloat16
            torch.testing.assert_close(value, expected[name].float(), atol=1e-3, rtol=0)
        else:
            assert torch.equal(value, expected[name]), name
