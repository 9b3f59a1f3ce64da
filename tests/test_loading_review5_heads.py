"""Sequence-classification heads named other than ``classifier``/``score`` (T5's, BART's ``classification_head``).

They were quantized with the body (bitsandbytes layers in a freshly initialised head that is meant to be trained),
and PEFT, which adds only ``classifier`` and ``score`` to ``modules_to_save``, left them frozen at their random
initialisation and out of the saved adapter: a reloaded adapter got another random head.
"""

from __future__ import annotations

import pytest
import torch

from peftplug.loading import attach_adapter, build_peft_config, load_model
from peftplug.task_heads import add_heads_to_save
from peftplug.tiny import char_tokenizer, tiny_model

LORA = {"peft_type": "LORA", "r": 4, "target_modules": ["q", "v"]}


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A tiny T5 saved as a seq2seq model (no classification head), as Hub T5 checkpoints are."""
    folder = tmp_path_factory.mktemp("t5")
    tiny_model("t5", "seq2seq", seed=0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def _ids() -> torch.Tensor:
    ids = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = 2  # T5ForSequenceClassification pools at the EOS token
    return ids


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_classification_head_stays_full_precision_under_quantization(t5_folder, quantization):
    bnb = pytest.importorskip("bitsandbytes")
    model = load_model(t5_folder, "seq_cls", quantization, num_labels=3)
    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    assert any(isinstance(m, quantized) for m in model.transformer.modules())  # the body is quantized
    head = dict(model.classification_head.named_modules())
    assert type(head["dense"]) is torch.nn.Linear and type(head["out_proj"]) is torch.nn.Linear
    assert head["out_proj"].weight.dtype == torch.float32


def test_a_classification_head_is_trained_and_saved_with_the_adapter(t5_folder, tmp_path):
    from peft import PeftModel

    torch.manual_seed(0)
    model = attach_adapter(load_model(t5_folder, "seq_cls", num_labels=3), build_peft_config(dict(LORA), "seq_cls"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("classification_head.modules_to_save" in n and "out_proj" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = model(input_ids=_ids(), labels=torch.tensor([0, 2])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=_ids()).logits
    model.save_pretrained(tmp_path / "adapter")

    torch.manual_seed(123)  # another fresh head: only the saved one can give the trained logits back
    base = load_model(t5_folder, "seq_cls", num_labels=3)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=_ids()).logits, expected)


def test_heads_peft_knows_by_name_are_left_to_peft():
    for family in ("bert", "llama", "gpt2"):
        config = build_peft_config({"peft_type": "LORA", "r": 4, "target_modules": "all-linear"}, "seq_cls")
        assert add_heads_to_save(tiny_model(family, "seq_cls", num_labels=3), config) == []
        assert config.modules_to_save is None
