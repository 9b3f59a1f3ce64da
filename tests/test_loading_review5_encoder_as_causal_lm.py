"""An encoder (BERT) loaded for a causal-LM task attended in both directions: transformers builds BertLMHeadModel
with ``is_decoder`` off (it only logs "add is_decoder=True"), so every position saw the tokens it was trained to
predict. It must load as a decoder, exactly as the same weights do with ``is_decoder=True``."""

from __future__ import annotations

import pytest
import torch

from peftplug.loading import load_model
from peftplug.tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    tiny_model("bert", "seq_cls", seed=0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("task", ["causal_lm", "prompt_cls"])
def test_an_encoder_loaded_as_a_causal_lm_does_not_see_later_tokens(bert_folder, task):
    ids = torch.randint(4, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 5] = 7 if ids[0, 5] != 7 else 8
    torch.manual_seed(0)
    model = load_model(bert_folder, task).eval()
    assert model.config.is_decoder is True
    with torch.no_grad():
        before, after = model(input_ids=ids).logits, model(input_ids=changed).logits
    torch.testing.assert_close(after[0, :5], before[0, :5])  # a later token changes no earlier prediction
    assert not torch.allclose(after[0, 5], before[0, 5])


def test_the_same_weights_and_logits_as_transformers_with_is_decoder(bert_folder):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(4, 90, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)  # the LM head the seq_cls folder lacks is initialised alike in both
    ours = load_model(bert_folder, "causal_lm").eval()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(bert_folder, is_decoder=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_an_explicit_is_decoder_is_kept(bert_folder):
    assert load_model(bert_folder, "causal_lm", is_decoder=False).config.is_decoder is False
