"""Fourth review: a PCT (or PEFT prompt-tuning) prompt on an nf4 base loaded outside peftplug after an eval forward.

bitsandbytes 0.50 repacks a ``Linear4bit`` in place at its first eval forward without gradients on CPUs with
AVX512-BF16, and the repacked matmul has no autograd: after one ``evaluate()`` every 4-bit layer stops passing
gradients back, so a prompt (which sits before all of them) trains on a wrong gradient, silently (tiny nf4 Llama:
|grad of the PCT query| 1.66e-2 before, 0.95e-2 after one eval forward). peftplug's loader and ``PeftModule`` switch
the repacking off for the models they load; a base loaded by transformers and wrapped by ``peft.get_peft_model`` (or
TRL's ``model_init_kwargs``) was not protected.

The fix sits where PEFT builds a prompt encoder, ``peftplug/registry.py``'s ``_setup_prompt_encoder`` wrapper (the
PCT encoder never sees the model), which calls ``peftplug.quantized_layout.keep_exact_4bit_layout`` there.
"""

from __future__ import annotations

import peft
import pytest
import torch

import prompt_transfer as pt

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _grads(model) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["pct", "prompt_tuning"])
def test_prompt_gradient_is_unchanged_by_an_eval_forward(nf4_base, tmp_path, kind):
    if kind == "pct":
        g = torch.Generator().manual_seed(0)
        sources = {f"s{i}": torch.randn(3, 64, generator=g) for i in range(3)}
        pt.save_decomposition(pt.decompose(sources, contrastive_steps=5), str(tmp_path / "dec"))
        config = pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec"))
    else:
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    model = peft.get_peft_model(nf4_base(), config)
    before = _grads(model)
    assert any(g.abs().sum() > 0 for g in before.values())
    model.eval()
    with torch.no_grad():
        model(input_ids=IDS)  # what Trainer.evaluate / generate run
    after = _grads(model)
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, atol=0, rtol=0, msg=name)
