"""Decoder-only classifiers under any prompt-learning adapter score each right-padded row as alone.

PEFT hands the base model ``inputs_embeds`` (the soft prompt first), so transformers cannot find the pad tokens and
pools every row at its last position: padding, for each right-padded row. Only PCT's setup pooled at the last
attended token for every caller; PEFT's own prompt tuning / P-tuning got it only through peftplug's Lightning module
(a per-call hook of its own, a second implementation). One backbone hook (``peftplug.seq_cls_pooling``) now serves
every prompt-learning classifier and every caller: a plain forward, transformers' or TRL's trainers, PeftModule.
"""

from __future__ import annotations

import peft
import pytest
import torch

import prompt_transfer  # noqa: F401 -- registers PCT, which hooks PEFT's prompt-encoder setup
from peftplug.lightning import PeftModule
from peftplug.seq_cls_pooling import PoolAtLastAttended, pool_at_last_attended_token
from peftplug.tiny import tiny_model

IDS = torch.tensor([[5, 9, 14, 20, 33, 41], [5, 9, 14, 20, 0, 0], [7, 8, 0, 0, 0, 0]])
MASK = (IDS != 0).long()


def _config(peft_type: str) -> peft.PeftConfig:
    if peft_type == "PROMPT_TUNING":
        return peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)
    return peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=4, encoder_hidden_size=16)


def _classifier(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model(family, task="seq_cls", num_labels=3)
    model.config.pad_token_id = 0
    return model


def _alone(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's logits computed on that row alone, without padding."""
    rows = [row[row_mask.bool()][None] for row, row_mask in zip(ids, mask, strict=True)]
    return torch.cat([model(input_ids=row, attention_mask=torch.ones_like(row)).logits for row in rows])


def _hooks(model) -> list:
    base = model.get_base_model()
    backbone = getattr(base, base.base_model_prefix)
    return [h for h in backbone._forward_hooks.values() if isinstance(h, PoolAtLastAttended)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("peft_type", ["PROMPT_TUNING", "P_TUNING"])
def test_peft_prompt_learning_classifiers_score_padded_rows_as_alone_in_a_plain_forward(family, peft_type):
    model = peft.get_peft_model(_classifier(family), _config(peft_type)).eval()
    with torch.no_grad():
        batched, alone = model(input_ids=IDS, attention_mask=MASK).logits, _alone(model, IDS, MASK)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert len(_hooks(model)) == 1


def test_the_unhooked_forward_is_what_the_hook_fixes():
    """Without the hook the right-padded rows are scored at padding (the test above is not vacuous)."""
    model = peft.get_peft_model(_classifier("llama"), _config("PROMPT_TUNING")).eval()
    backbone = model.get_base_model().model
    backbone._forward_hooks.clear()
    with torch.no_grad():
        batched, alone = model(input_ids=IDS, attention_mask=MASK).logits, _alone(model, IDS, MASK)
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=0)  # the unpadded row
    assert (batched[1:] - alone[1:]).abs().amax() > 1e-3


def test_peft_module_hooks_a_model_made_before_the_hook_once():
    """A PeftModel whose adapter was set up without the hook (made before peftplug's registry hooked PEFT) gets it
    from PeftModule, once however many modules wrap it; PeftModule's forward is the model's own."""
    model = peft.get_peft_model(_classifier("llama"), _config("PROMPT_TUNING"))
    model.get_base_model().model._forward_hooks.clear()
    module = PeftModule(model, task="seq_cls")
    PeftModule(model, task="seq_cls")
    assert len(_hooks(model)) == 1
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(module(input_ids=IDS, attention_mask=MASK).logits, _alone(model, IDS, MASK),
                                   atol=1e-5, rtol=0)


def test_only_decoder_only_prompt_learning_classifiers_are_hooked():
    lora = peft.get_peft_model(_classifier("llama"), peft.LoraConfig(task_type="SEQ_CLS", r=2,
                                                                    target_modules=["q_proj"]))
    assert not pool_at_last_attended_token(lora)  # it is given input_ids: transformers finds the padding
    torch.manual_seed(0)
    encoder = peft.get_peft_model(tiny_model("bert", task="seq_cls", num_labels=3), _config("PROMPT_TUNING"))
    assert not pool_at_last_attended_token(encoder)  # pools [CLS], a virtual token, by design
    assert not pool_at_last_attended_token(torch.nn.Linear(2, 2))
