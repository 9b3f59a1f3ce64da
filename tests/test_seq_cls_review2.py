"""Second review of sequence classification end to end: TextClassificationData batches, the decoder-only classifiers
PeftModule builds (their last-token pooling by ``config.pad_token_id``), and heads saved and loaded with adapters.

References are single-row, unpadded forwards of the same model: a batched row must be classified as it is alone."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from peftplug.adapter_loading import load_adapter
from peftplug.data import TextClassificationData
from peftplug.errors import ConfigError, DataError
from peftplug.lightning import PeftModule
from peftplug.tiny import char_tokenizer
from peftplug.tiny import tiny_model as build_tiny

# Rows of different lengths (right padding in every batch); one ends with the EOS token, which is the pad token of
# the bases below that have none of their own.
ROWS = [{"text": "hi", "label": "neg"}, {"text": "a much longer text here", "label": "pos"},
        {"text": "mid text", "label": "neu"}, {"text": "ab</s>", "label": "pos"}]
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def _write(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)


def _base_without_pad(tmp_path, family: str) -> str:
    """A saved base whose config and tokenizer have no pad token (as GPT-2's, Llama 3's): PeftModule's tokenizer
    then pads with EOS."""
    folder = tmp_path / f"{family}-nopad"
    build_tiny(family, "causal_lm", pad_token_id=None).save_pretrained(folder)
    tokenizer = char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    return str(folder)


def _data(tmp_path, **kwargs) -> TextClassificationData:
    path = _write(tmp_path / "cls.jsonl", ROWS)
    return TextClassificationData(train_file=path, validation_file=path, batch_size=len(ROWS), **kwargs)


def _batched_and_single(module, data) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data.splits["validation"]
    module.eval()
    with torch.no_grad():
        batched = module(**data.collate(rows)).logits
        single = torch.cat([module(**data.collate([row])).logits for row in rows])
    return batched, single


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batched_rows_are_classified_as_alone_and_val_metrics_follow(tmp_path, family):
    # A base without a pad token: the tokenizer pads with EOS, which PeftModule must write into the config, and a
    # text that ends with EOS is pooled the same way batched or alone.
    torch.manual_seed(0)
    module = PeftModule(_base_without_pad(tmp_path, family), task="seq_cls", num_labels=3,
                        peft={"peft_type": "LORA", "r": 4, "target_modules": TARGETS[family]})
    data = _data(tmp_path)
    metrics = _trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
    assert module.model.config.pad_token_id == module.tokenizer.pad_token_id == module.tokenizer.eos_token_id
    batched, single = _batched_and_single(module, data)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)
    labels = torch.tensor([row["labels"] for row in data.splits["validation"]])
    assert data.label_names == ["neg", "neu", "pos"] and labels.tolist() == [0, 2, 1, 2]
    assert metrics["val_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(single, labels)), rel=1e-5)
    assert metrics["val_acc"] == pytest.approx(float((single.argmax(-1) == labels).float().mean()))


def test_a_data_tokenizer_that_pads_with_another_id_than_the_model_is_refused(tmp_path):
    # tiny:llama pads with id 0; this tokenizer pads with EOS (2): the model pooled a padding position of every
    # padded row (logits 0.18-0.26 off the row's own), silently.
    module = PeftModule("tiny:llama", task="seq_cls", num_labels=3)
    data = _data(tmp_path, tokenizer=_base_without_pad(tmp_path, "llama"))
    with pytest.raises(ConfigError, match=r"config.pad_token_id \(0\).*padded with token id 2"):
        _trainer(tmp_path).validate(module, datamodule=data, verbose=False)


def test_a_built_decoder_classifier_without_pad_id_is_refused_before_the_run(tmp_path):
    # transformers raised "Cannot handle batch sizes > 1" from inside the validation loop.
    model = build_tiny("llama", "seq_cls", num_labels=3, pad_token_id=None)
    module = PeftModule(model, task="seq_cls", tokenizer="tiny:llama")
    with pytest.raises(ConfigError, match=r"config.pad_token_id \(None\).*pad_token_id = 0"):
        _trainer(tmp_path).validate(module, datamodule=_data(tmp_path), verbose=False)


def test_the_encoder_classifier_is_not_checked_for_pad_ids(tmp_path):
    # BERT pools [CLS] (position 0): its config pad id does not decide the classified position.
    model = build_tiny("bert", "seq_cls", num_labels=3, pad_token_id=5)
    module = PeftModule(model, task="seq_cls", tokenizer="tiny:bert")
    data = _data(tmp_path)
    _trainer(tmp_path).validate(module, datamodule=data, verbose=False)
    batched, single = _batched_and_single(module, data)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)


def test_a_validation_label_beyond_the_models_classes_is_one_line(tmp_path):
    train = _write(tmp_path / "t.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1}])
    val = _write(tmp_path / "v.jsonl", [{"text": "a", "label": 0}, {"text": "c", "label": 2}])
    module = PeftModule("tiny:llama", task="seq_cls", num_labels=2)
    data = TextClassificationData(train_file=train, validation_file=val)
    with pytest.raises(DataError, match="3 classes but model.num_labels is 2"):
        _trainer(tmp_path).validate(module, datamodule=data, verbose=False)


def test_text_pairs_follow_the_tokenizers_pair_convention_and_truncation(tmp_path):
    from tokenizers.processors import TemplateProcessing

    tokenizer = char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    rows = [{"a": "first one", "b": "second", "label": 0}, {"a": "x" * 30, "b": "y" * 30, "label": 1}]
    path = _write(tmp_path / "pairs.jsonl", rows)
    data = TextClassificationData(train_file=path, validation_file=path, text_column="a", text_pair_column="b",
                                  max_length=20)
    data.tokenizer = tokenizer
    data.setup()
    for row, example in zip(rows, data.splits["validation"]):
        assert example["input_ids"] == tokenizer(row["a"], row["b"], truncation=True, max_length=20)["input_ids"]
    assert len(data.splits["validation"][1]["input_ids"]) == 20
    first = tokenizer("first one")["input_ids"]  # <s> first one </s>, then the pair's second part
    assert data.splits["validation"][0]["input_ids"][:len(first)] == first


@pytest.mark.parametrize("peft_type", ["LORA", "OFTV2"])
def test_the_trained_head_is_saved_and_restored_with_the_adapter(tmp_path, peft_type):
    config = ({"peft_type": "LORA", "r": 4, "target_modules": TARGETS["llama"]} if peft_type == "LORA" else
              {"class_path": "oftv2.OFTv2Config", "init_args": {"block_size": 8, "target_modules": TARGETS["llama"]}})
    torch.manual_seed(0)
    module = PeftModule("tiny:llama", task="seq_cls", num_labels=3, peft=config)
    trained = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert any(".score.modules_to_save." in n for n in trained)
    with torch.no_grad():  # stands for training: the head and the adapter move away from their initialisation
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    data = _data(tmp_path)
    data.tokenizer = module.tokenizer
    data.setup()
    batched, _ = _batched_and_single(module, data)
    module.export(tmp_path / "adapter")
    torch.manual_seed(1)  # another fresh head, were the trained one not restored
    with pytest.raises(ConfigError, match="is a SEQ_CLS adapter: pass num_labels="):  # (was "num_labels ... None")
        load_adapter("tiny:llama", tmp_path / "adapter")
    loaded = load_adapter("tiny:llama", tmp_path / "adapter", num_labels=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**data.collate(data.splits["validation"])).logits, batched)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("peft_type", ["PROMPT_TUNING", "P_TUNING"])
def test_prompt_learning_decoder_classifier_classifies_padded_rows_as_alone(tmp_path, family, peft_type):
    # PEFT feeds the model inputs_embeds (virtual tokens first): transformers can no longer find the pad tokens and
    # pools the last position, padding for every right-padded row (0.2-0.5 off the row's own logits).
    config = {"peft_type": peft_type, "num_virtual_tokens": 4}
    if peft_type == "P_TUNING":
        config["encoder_hidden_size"] = 16
    torch.manual_seed(0)
    module = PeftModule(f"tiny:{family}", task="seq_cls", num_labels=3, peft=config)
    data = _data(tmp_path)
    data.tokenizer = module.tokenizer
    data.setup()
    batched, single = _batched_and_single(module, data)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)


def test_an_adapter_of_a_base_without_pad_reloads_with_the_pad_id_it_was_trained_with(tmp_path):
    # load_adapter loaded the base with config.pad_token_id None: batches raised "Cannot handle batch sizes > 1",
    # and a single row ending with EOS was pooled at EOS, not at the token before it as in training.
    base = _base_without_pad(tmp_path, "llama")
    torch.manual_seed(0)
    module = PeftModule(base, task="seq_cls", num_labels=3,
                        peft={"peft_type": "LORA", "r": 4, "target_modules": TARGETS["llama"]})
    data = _data(tmp_path)
    data.tokenizer = module.tokenizer
    data.setup()
    batched, _ = _batched_and_single(module, data)
    module.export(tmp_path / "adapter")
    loaded = load_adapter(base, tmp_path / "adapter", num_labels=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**data.collate(data.splits["validation"])).logits, batched)
