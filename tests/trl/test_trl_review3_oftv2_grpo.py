"""TRL's GRPOTrainer with OFTv2 (full-precision tiny Llama) and QOFT (nf4 tiny Llama): the completions GRPO samples
are generated through the adapter (not the disabled or identity one), and the KL reference is the adapter's frozen
``ref`` copy."""

from __future__ import annotations

import math

import peft
import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from peft import PeftModel

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Prompts of one length: GRPO's left padding is then a no-op and the recorded ids can be replayed without a mask.
ROWS = [{"prompt": f"add {i} {j}="} for i in range(4) for j in range(2)]


def _base(kind: str):
    if kind == "nf4":
        pytest.importorskip("bitsandbytes")
        from peftplug.loading import load_model

        return load_model("tiny:llama", "causal_lm", quantization="nf4")
    return tiny_model("llama")


def _saved_adapter(kind: str, path: str) -> None:
    """A "pretrained" adapter far from the identity, so that generating through it differs from the base."""
    model = peft.get_peft_model(_base(kind), OFTv2Config(target_modules="all-linear", block_size=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "oftv2_Q" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(path)


def _greedy(model, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)


@pytest.mark.parametrize("kind", ["fp32", "nf4"])
def test_grpo_generates_through_the_adapter_and_keeps_a_frozen_reference(trl_args, tmp_path, kind):
    path = str(tmp_path / "adapter")
    _saved_adapter(kind, path)
    model = PeftModel.from_pretrained(_base(kind), path, is_trainable=True)
    new_tokens = 5
    args = trl_args(
        trl.GRPOConfig, max_steps=1, num_generations=4, max_completion_length=new_tokens, beta=0.1,
        generation_kwargs={"do_sample": False, "min_new_tokens": new_tokens},
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(set(c))) for c in completions], args=args,
        train_dataset=Dataset.from_list(ROWS), processing_class=char_tokenizer(),
    )
    assert sorted(trainer.model.peft_config) == ["default", "ref"]
    calls = []
    generate = trainer.model.generate

    def recording_generate(*a, **kw):
        out = generate(*a, **kw)
        calls.append((kw["input_ids"].clone(), out.clone()))
        return out

    trainer.model.generate = recording_generate
    trainer.train()
    assert calls, "GRPO did not generate through the PeftModel"
    prompt_ids, generated = calls[0]
    first = trainer.state.log_history[0]
    # Before the first update the policy is its frozen copy: no KL.
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and math.isfinite(first["loss"])

    # Replay the first (pre-update) generation on a fresh model holding the saved adapter.
    fresh = PeftModel.from_pretrained(_base(kind), path).eval()
    with_adapter = _greedy(fresh, prompt_ids, new_tokens)
    with fresh.disable_adapter():
        without = _greedy(fresh, prompt_ids, new_tokens)
    assert not torch.equal(with_adapter, without), "the adapter does not change the greedy completions"
    torch.testing.assert_close(generated, with_adapter, atol=0, rtol=0)
