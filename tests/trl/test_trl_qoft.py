"""QOFT under TRL: ``SFTTrainer`` with an ``OFTv2Config`` on an nf4 tiny Llama (bitsandbytes' 4-bit layers become
``oftv2.bnb`` layers), with evaluation between training steps — the eval forward that repacks 4-bit weights on
AVX512-BF16 CPUs (docs/qoft.md). The 4-bit weights must stay bit-identical in the exact layout, the adapter train,
and the saved adapter reload on a fresh nf4 base with the same logits."""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("bitsandbytes")

from datasets import Dataset
from peft import PeftModel
from trl_helpers import GENERATION_TEMPLATE, messages_rows

import oftv2
from peftplug.loading import load_model
from peftplug.quantized_layout import REPACK_SWITCH, four_bit_layers, is_repacked
from peftplug.tiny import char_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _nf4_llama():
    # peftplug's loader keeps every 4-bit layer in the exact layout from the moment it is loaded (issue 29).
    return load_model("tiny:llama", "causal_lm", quantization="nf4")


def test_qoft_sft_with_evaluation_keeps_the_exact_4bit_weights_and_reloads(trl_args, tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = GENERATION_TEMPLATE
    rows = messages_rows()
    model = _nf4_llama()
    packed = {name: layer.weight.data.clone() for name, layer in four_bit_layers(model)}
    assert packed, "the tiny Llama has no 4-bit layers"

    trainer = trl.SFTTrainer(
        model=model,
        args=trl_args(trl.SFTConfig, assistant_only_loss=True, max_steps=3, eval_strategy="steps", eval_steps=1,
                      per_device_eval_batch_size=4),
        train_dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]),
        processing_class=tokenizer,
        peft_config=oftv2.OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8),
    )
    q_proj = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__ == "oftv2.bnb"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("oftv2_Q" in n for n in before)
    trainer.train()

    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert len(losses) == 3 and len(evals) == 3 and all(math.isfinite(v) for v in losses + evals)
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    # Adapted and unadapted 4-bit layers alike: never repacked, the packed bytes untouched by training and eval.
    # (A PeftModel's names carry its wrapper's prefix and the adapted layer's base_layer.)
    layers = {name.removeprefix("base_model.model.").removesuffix(".base_layer"): layer
              for name, layer in four_bit_layers(trainer.model)}
    assert layers.keys() == packed.keys()
    for name, weight in packed.items():
        layer = layers[name]
        assert not is_repacked(layer) and getattr(layer, REPACK_SWITCH, False) is False
        assert torch.equal(layer.weight.data, weight), name

    trainer.model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_nf4_llama(), tmp_path / "adapter")
    ids = torch.tensor([[5, 9, 14, 20, 33, 41]])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids).logits, trainer.model(ids).logits, atol=1e-5, rtol=1e-5)
