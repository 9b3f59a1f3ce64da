"""The seq2seq (encoder-decoder) task end to end, second review: ``CausalLMData(task="seq2seq")`` rows, the loss and
``val_loss``/``val_ppl`` against the model's own loss on unpadded rows, truncation, ``predict`` on right-padded
encoder inputs, LoRA / OFTv2 / prompt tuning on T5 (and a tiny BART), and ``peftplug fit``/``generate`` from the CLI.

References are computed here with plain transformers / PEFT calls on single, unpadded rows."""

from __future__ import annotations

import json
import math

import lightning as L
import peft
import pytest
import torch
import yaml
from peft import LoraConfig
from seq2seq_helpers import shaken, tiny_bart

import oftv2
from peftplug.data import CausalLMData
from peftplug.data.base import pad_batch
from peftplug.errors import ConfigError, DataError
from peftplug.lightning import PeftModule
from peftplug.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?" + "x" * i, "response": f" {2 * i} " * (i + 1)} for i in range(6)]


def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)


def _write(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _data(path, tokenizer, **kw) -> CausalLMData:
    data = CausalLMData(train_file=path, validation_file=path, prompt_column="prompt", response_column="response",
                        task="seq2seq", **{"batch_size": 4, **kw})
    data.tokenizer = tokenizer
    data.setup("fit")
    return data


def test_labels_loss_and_val_ppl_match_the_model_on_unpadded_rows(tmp_path):
    module = PeftModule("tiny:t5", task="seq2seq",
                        peft=LoraConfig(r=2, target_modules=["q", "v"], init_lora_weights=False)).eval()
    tokenizer = module.tokenizer
    data = _data(_write(tmp_path / "s2s.jsonl", ROWS), tokenizer)
    rows = data.splits["validation"]
    for row, raw in zip(rows, ROWS):
        # The char tokenizer adds no special tokens: the source as is, the target with EOS appended.
        assert row["input_ids"] == tokenizer(raw["prompt"])["input_ids"]
        assert row["labels"] == tokenizer(raw["response"])["input_ids"] + [tokenizer.eos_token_id]

    with torch.no_grad():
        single = [module.model(**pad_batch([row], tokenizer.pad_token_id)).loss.item() for row in rows]
        batch = pad_batch(rows, tokenizer.pad_token_id)  # labels padded with -100, encoder inputs on the right
        logits = module.model(**batch).logits
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    for i, loss in enumerate(single):  # padding in a batch changes no row's loss
        assert per_token[i][batch["labels"][i] != -100].mean().item() == pytest.approx(loss, rel=1e-5)

    counts = [len(row["labels"]) for row in rows]
    expected = sum(loss * n for loss, n in zip(single, counts)) / sum(counts)  # a mean over tokens, not rows
    metrics = _trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


@pytest.mark.parametrize("adds_eos", [False, True])
def test_truncation_cuts_source_and_target_at_max_length_and_keeps_eos(tmp_path, adds_eos):
    from tokenizers import processors

    tokenizer = char_tokenizer()
    if adds_eos:  # T5's tokenizer appends EOS itself, and keeps it when truncating
        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                                            special_tokens=[("</s>", 2)])
    rows = [{"prompt": "abcdefghij", "response": "klmnopqrst"}, {"prompt": "ab", "response": "cd"}]
    data = _data(_write(tmp_path / "long.jsonl", rows), tokenizer, max_length=6)
    short, long = sorted(data.splits["train"], key=lambda row: len(row["labels"]))
    eos = tokenizer.eos_token_id
    assert long["labels"] == tokenizer("klmno", add_special_tokens=False)["input_ids"] + [eos]
    assert len(long["input_ids"]) == 6 and long["input_ids"][:5] == tokenizer("abcde")["input_ids"][:5]
    assert short["labels"] == tokenizer("cd", add_special_tokens=False)["input_ids"] + [eos]


def test_an_empty_encoder_input_is_refused_in_one_line(tmp_path):
    # With a tokenizer that adds no special tokens, an empty prompt was an empty encoder input: T5 crashed mid-run
    # (a reshape of 0 elements), and beside other rows it was all padding, its loss set by its batch.
    rows = [{"prompt": "", "response": "hello"}, {"prompt": "abc", "response": "x"}]
    with pytest.raises(DataError, match=r"row 1 \(train split\): the prompt gives no tokens: a seq2seq model's encoder"):
        _data(_write(tmp_path / "empty.jsonl", rows), char_tokenizer())


def test_plain_text_is_refused_for_seq2seq(tmp_path):
    # The text was used as source and target alike: the model learnt to copy its input, silently.
    path = _write(tmp_path / "text.jsonl", [{"text": "the cat sat"}, {"text": "on the mat"}])
    data = CausalLMData(train_file=path, validation_file=path, task="seq2seq")
    data.tokenizer = char_tokenizer()
    with pytest.raises(ConfigError, match="data.text_column .* serves causal_lm models only; a seq2seq model needs "
                                          "data.prompt_column"):
        data.setup("fit")


@pytest.mark.parametrize(("model", "model_task", "data_task"),
                         [("tiny:t5", "seq2seq", "causal_lm"), ("tiny:llama", "causal_lm", "seq2seq")])
def test_data_task_must_match_the_model_task(tmp_path, model, model_task, data_task):
    # causal_lm rows on a seq2seq model put the answer in the encoder input (it trained to copy it, silently);
    # seq2seq rows on a causal LM crashed in its loss with a traceback.
    module = PeftModule(model, task=model_task)
    data = CausalLMData(train_file=_write(tmp_path / "d.jsonl", ROWS), prompt_column="prompt",
                        response_column="response", task=data_task)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigError, match=f"data.task is '{data_task}' but model.task is '{model_task}'"):
        trainer.validate(module, datamodule=data, verbose=False)


def test_predict_right_pads_encoder_inputs_and_answers_each_row_as_alone(tmp_path):
    # BART's positions are absolute: left padding would shift every real token's position and change the answers.
    module = PeftModule(tiny_bart(), task="seq2seq", max_new_tokens=8,
                        peft=LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    data = _data(_write(tmp_path / "p.jsonl", ROWS), char_tokenizer(), batch_size=3)
    batches = list(data.predict_dataloader())
    assert all(bool(b["attention_mask"][:, 0].all()) for b in batches)  # right padding
    predicted = [row for b in _trainer(tmp_path).predict(module, datamodule=data) for row in b.tolist()]
    eos = data.tokenizer.eos_token_id
    with torch.no_grad():
        for ids, prompt in zip(predicted, data.prompts["validation"]):
            alone = torch.tensor([data.tokenizer(prompt)["input_ids"]])
            reference = module.model.generate(input_ids=alone, attention_mask=torch.ones_like(alone),
                                              max_new_tokens=8, do_sample=False)[0].tolist()
            cut = ids[: len(reference)]
            assert cut == reference, prompt
            assert all(t == data.tokenizer.pad_token_id for t in ids[len(reference):]) or reference[-1] != eos
    assert len({tuple(row) for row in predicted}) > 1  # the check is not one of all-equal answers


def test_prompt_tuning_puts_virtual_tokens_on_the_encoder_and_predicts_as_greedy_decoding(tmp_path):
    module = PeftModule(shaken(tiny_model("t5", "seq2seq")), task="seq2seq", tokenizer="tiny:t5", max_new_tokens=6,
                        peft=peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3)).eval()
    with torch.no_grad():
        for param in module.model.prompt_encoder.parameters():
            param.normal_(0, 1, generator=torch.Generator().manual_seed(2))
    tokenizer = module.tokenizer
    data = _data(_write(tmp_path / "pt.jsonl", ROWS), tokenizer, batch_size=3)
    rows = data.splits["validation"]
    with torch.no_grad():
        batch = pad_batch(rows, tokenizer.pad_token_id)
        output = module(**batch)
        assert output.logits.shape[1] == batch["labels"].shape[1]  # no virtual tokens on the decoder side
        per_token = torch.nn.functional.cross_entropy(output.logits.transpose(1, 2), batch["labels"],
                                                      reduction="none")
        for i, row in enumerate(rows):
            alone = module(**pad_batch([row], tokenizer.pad_token_id)).loss.item()
            assert per_token[i][batch["labels"][i] != -100].mean().item() == pytest.approx(alone, rel=1e-5)

        predicted = [text for b in data.predict_dataloader() for text in module.predict_step(b, 0)]
        for text, prompt in zip(predicted, data.prompts["validation"]):  # greedy decoding through the forward
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            decoded = torch.tensor([[module.model.config.decoder_start_token_id]])
            for _ in range(6):
                logits = module.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      decoder_input_ids=decoded).logits
                decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], 1)
                if decoded[0, -1].item() == tokenizer.eos_token_id:
                    break
            assert text == tokenizer.decode(decoded[0], skip_special_tokens=True)


def test_oftv2_on_t5_merges_unmerges_and_reloads_to_the_same_logits(tmp_path):
    model = peft.get_peft_model(tiny_model("t5", "seq2seq"),
                                oftv2.OFTv2Config(task_type="SEQ_2_SEQ_LM", target_modules=["q", "v", "wi", "wo"],
                                                  block_size=16))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in (p for p in model.parameters() if p.requires_grad):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([[20, 21, 2], [23, 2, -100]])}
    with torch.no_grad():
        adapted = model(**batch).logits
        base = tiny_model("t5", "seq2seq")(**batch).logits
        model.merge_adapter()
        merged = model(**batch).logits
        model.unmerge_adapter()
        unmerged = model(**batch).logits
        model.save_pretrained(tmp_path / "adapter")
        loaded = peft.PeftModel.from_pretrained(tiny_model("t5", "seq2seq"), tmp_path / "adapter").eval()
        reloaded = loaded(**batch).logits
    assert (adapted - base).abs().max() > 0.1  # the adapter acts
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unmerged, adapted, atol=1e-5, rtol=1e-5)
    assert isinstance(loaded, peft.PeftModelForSeq2SeqLM)
    torch.testing.assert_close(reloaded, adapted, atol=0, rtol=0)


def test_cli_fits_a_seq2seq_recipe_and_generate_refuses_its_checkpoint_in_one_line(tmp_path, capsys):
    from peftplug.checkpoints import load_checkpoint_module
    from peftplug.cli import main

    recipe = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "max_steps": 2, "limit_val_batches": 1},
        "model": {"model": "tiny:t5", "task": "seq2seq",
                  "peft": {"peft_type": "OFTV2", "target_modules": ["q", "v"], "block_size": 16},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": _write(tmp_path / "train.jsonl", ROWS), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 2}},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp_path / "recipe.yaml")]) == 0
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    module = load_checkpoint_module(str(ckpt))
    assert module.task == "seq2seq"
    assert isinstance(module.model, peft.PeftModelForSeq2SeqLM)
    assert any(p.abs().max() > 0 for n, p in module.model.named_parameters() if "oftv2" in n)  # trained

    capsys.readouterr()
    assert main(["generate", "--ckpt_path", str(ckpt), "--prompt", "Q1"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("peftplug: error: ") and "seq2seq" in err and "\n" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("positions", ["generated", "from_last_prompt"])
def test_steering_generated_tokens_of_an_encoder_decoder_is_refused(positions):
    # The layers index the encoder's blocks, which never see a generated token: such a vector steered nothing
    # (T5's outputs equal the base model's at multiplier 50), silently.
    import peft

    from peftplug.tiny import tiny_model
    from steering import SteeringConfig

    with pytest.raises(ValueError, match="encoder-decoder model the layers index the encoder's blocks"):
        peft.get_peft_model(tiny_model("t5", "seq2seq"),
                            SteeringConfig(layers=[0], positions=positions, task_type="SEQ_2_SEQ_LM"))
    peft.get_peft_model(tiny_model("t5", "seq2seq"),
                        SteeringConfig(layers=[0], positions="all", task_type="SEQ_2_SEQ_LM"))
