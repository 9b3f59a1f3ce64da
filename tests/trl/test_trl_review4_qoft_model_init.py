"""QOFT when TRL loads the nf4 base itself (``model=<path>`` with ``model_init_kwargs={"quantization_config": ...}``,
fourth review): nothing of peftplug protects the 4-bit layers before OFTv2 is attached, and OFTv2 used to keep only
the layers it wraps in the exact layout. An evaluation between steps then repacked every other 4-bit layer on
AVX512-BF16 CPUs (docs/qoft.md), whose matmul has no autograd: with ``target_modules=["q_proj", "v_proj"]`` the
first layer's ``q_proj`` rotation (reached only through ``o_proj``) got a zero gradient from then on, silently.
Attaching OFTv2 now keeps every 4-bit layer of the model exact (``oftv2.model.OFTv2Model.inject_adapter``).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
bnb = pytest.importorskip("bitsandbytes")

from datasets import Dataset
from transformers import BitsAndBytesConfig
from trl_helpers import prompt_completion_rows

import oftv2
from peftplug.quantized_layout import REPACK_SWITCH, four_bit_layers, repacked_layers
from peftplug.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

Q0 = "base_model.model.model.layers.0.self_attn.q_proj.oftv2_Q.default.weight"


def _grads(trainer) -> dict[str, torch.Tensor]:
    """Adapter gradients of the loss on the first training rows."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model = trainer.model.train()  # the tiny Llama has no dropout
    model.zero_grad()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_an_evaluation_leaves_the_adapter_gradients_of_a_trl_loaded_nf4_model_unchanged(trl_args, tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(path)
    rows = prompt_completion_rows()
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    trainer = trl.SFTTrainer(
        model=str(path), processing_class=char_tokenizer(),
        args=trl_args(trl.SFTConfig, gradient_checkpointing=False, per_device_eval_batch_size=4,
                      model_init_kwargs={"quantization_config": quantization, "dtype": torch.float32}),
        train_dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]),
        peft_config=oftv2.OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8),
    )
    layers = dict(four_bit_layers(trainer.model))
    assert len(layers) == 14  # 4 adapted (q, v of two blocks) and 10 others
    # Every 4-bit layer, adapted or not, has bitsandbytes' in-place repacking switched off.
    assert [n for n, layer in layers.items() if getattr(layer, REPACK_SWITCH, False)] == []
    before = _grads(trainer)
    assert before[Q0].abs().max() > 0
    trainer.evaluate()  # the eval forward that repacks unprotected 4-bit layers on AVX512-BF16 CPUs
    assert repacked_layers(trainer.model) == []
    after = _grads(trainer)
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, atol=0, rtol=0, msg=name)
