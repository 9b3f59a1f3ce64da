"""The seq2seq (encoder-decoder) task end to end, fourth review: ``predict`` of a prefix-tuned T5, BART's decoder
position table (long targets, ``max_new_tokens``), and chat rows given to a seq2seq model.

References are computed here with plain transformers / PEFT forwards on single, unpadded rows."""

from __future__ import annotations

import json

import lightning as L
import peft
import pytest
import torch
from peft import LoraConfig
from seq2seq_helpers import shaken, tiny_bart

from peftplug.data import CausalLMData, ChatData
from peftplug.errors import ConfigError, DataError
from peftplug.lightning import PeftModule
from peftplug.model_checks import PositionError
from peftplug.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?" + "x" * i, "response": f" {2 * i} " * (i + 1)} for i in range(6)]


def _trainer(tmp_path, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0, **kw)


def _data(tmp_path, rows, tokenizer, **kw) -> CausalLMData:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = CausalLMData(train_file=str(path), validation_file=str(path), prompt_column="prompt",
                        response_column="response", **{"batch_size": 3, "task": "seq2seq", **kw})
    data.tokenizer = tokenizer
    return data


def _greedy(model, ids: list[int], steps: int, eos: int) -> list[int]:
    """Greedy decoding of one unpadded row through the model's forward (no cache, no generate)."""
    inputs = torch.tensor([ids])
    decoded = torch.tensor([[model.config.decoder_start_token_id]])
    for _ in range(steps):
        logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), decoder_input_ids=decoded).logits
        decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], 1)
        if decoded[0, -1].item() == eos:
            break
    return decoded[0].tolist()


def test_prefix_tuning_predicts_with_its_prefix_as_greedy_decoding_through_the_forward(tmp_path):
    # PEFT's generate handed the prefix over as past_key_values beside transformers' own `cache`, which won: the
    # predictions were the base model's, silently, while training and val_loss did use the prefix.
    module = PeftModule(shaken(tiny_model("t5", "seq2seq"), seed=3), task="seq2seq", tokenizer="tiny:t5",
                        max_new_tokens=6,
                        peft=peft.PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3)).eval()
    with torch.no_grad():
        for param in module.model.prompt_encoder.parameters():
            param.normal_(0, 1, generator=torch.Generator().manual_seed(2))
    tokenizer = module.tokenizer
    data = _data(tmp_path, ROWS, tokenizer)
    predicted = [text for batch in _trainer(tmp_path).predict(module, datamodule=data) for text in batch]

    model, eos = module.model, tokenizer.eos_token_id
    with torch.no_grad():
        expected = [tokenizer.decode(_greedy(model, tokenizer(row["prompt"])["input_ids"], 6, eos),
                                     skip_special_tokens=True) for row in ROWS]
        with model.disable_adapter():
            base = [tokenizer.decode(_greedy(model, tokenizer(row["prompt"])["input_ids"], 6, eos),
                                     skip_special_tokens=True) for row in ROWS]
    assert predicted == expected
    assert predicted != base  # the prefix changes the answers: the check above is not the base model's
    assert len(set(predicted)) > 1


def test_targets_longer_than_bart_s_decoder_table_are_refused_before_training(tmp_path):
    # Short prompts passed the (encoder) position check; a 65-token target stopped the first batch with
    # "IndexError: index out of range in self" from the decoder's embed_positions.
    rows = [{"prompt": "short", "response": "y" * 64}, {"prompt": "ab", "response": "z"}]  # 64 chars + EOS: 65
    module = PeftModule(tiny_bart(positions=64), task="seq2seq", peft=LoraConfig(r=2, target_modules=["q_proj"]))
    data = _data(tmp_path, rows, char_tokenizer(), batch_size=2)
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    with pytest.raises(DataError, match=r"^the train split has targets of 65 tokens, but the model's learned position "
                                        r"table \(base_model\.model\.model\.decoder\.embed_positions\) holds 64 "
                                        r"positions: set data\.max_length to 64 or less$"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0

    rows[0]["response"] = "y" * 63  # 64 tokens: the whole table, which trains
    module = PeftModule(tiny_bart(positions=64), task="seq2seq", peft=LoraConfig(r=2, target_modules=["q_proj"]))
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=_data(tmp_path, rows, char_tokenizer(), batch_size=2))
    assert trainer.global_step == 1


@pytest.mark.parametrize("family", ["bart", "gpt2"])
def test_predict_past_a_position_table_is_refused_in_one_line(tmp_path, family):
    # generate ran off the table mid-run: "IndexError: index out of range in self" after part of the batches.
    if family == "bart":
        model, limit = tiny_bart(positions=64), 64
        model.generation_config.min_new_tokens = limit  # the boundary run generates all of its tokens
        message = (r"^model\.max_new_tokens is 66, but the model's decoder has 64 positions "
                   r"\(model\.decoder\.embed_positions\): lower model\.max_new_tokens to 64 or less$")
    else:
        model = tiny_model("gpt2")  # 256 positions, read by the longest prompt (the last row) and the new tokens
        limit = 256 - len(char_tokenizer()(ROWS[-1]["prompt"])["input_ids"])
        model.generation_config.min_new_tokens = limit
        message = (rf"^the prompt is {256 - limit} tokens and model\.max_new_tokens {limit + 2}, but the model has "
                   r"256 positions: shorten the prompt or lower model\.max_new_tokens$")
    task = "seq2seq" if family == "bart" else "causal_lm"
    # Two past the table: GPT-2 never reads its last new token, so one past it ran (the check counts it all).
    module = PeftModule(model, task=task, max_new_tokens=limit + 2)
    module.tokenizer = char_tokenizer()
    data = _data(tmp_path, ROWS, char_tokenizer(), batch_size=6, task=task)
    with pytest.raises(PositionError, match=message) as err:
        _trainer(tmp_path).predict(module, datamodule=data)
    assert isinstance(err.value, ConfigError)  # `peftplug predict` prints it as one line

    module.hparams.max_new_tokens = limit  # the whole table: runs
    (texts,) = _trainer(tmp_path).predict(module, datamodule=data)
    assert len(texts) == len(ROWS)


def test_chat_data_refuses_a_seq2seq_model_before_training(tmp_path):
    # Chat rows hold the answer in input_ids: T5 trained to copy it from its encoder input, silently (with
    # validation off the run finished), and validation stopped in generate with a ValueError traceback.
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    module = PeftModule("tiny:t5", task="seq2seq", peft=LoraConfig(r=2, target_modules=["q"]))
    data = ChatData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=2)
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    with pytest.raises(ConfigError, match=r"^ChatData serves model\.task 'causal_lm', but model\.task is 'seq2seq': "
                                          r"set model\.task: causal_lm, or for a seq2seq model "
                                          r"peftplug\.data\.CausalLMData with prompt_column and response_column"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_a_prefix_takes_decoder_positions_only(tmp_path, family):
    # Prefix tuning's prefix is the cache of the decoder (of the only stack of a decoder-only model): it counts
    # before GPT-2's rows and before BART's targets, not before BART's encoder input.
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM" if family == "gpt2" else "SEQ_2_SEQ_LM",
                                     num_virtual_tokens=3)
    model = tiny_model("gpt2") if family == "gpt2" else tiny_bart(positions=64)
    limit = 256 if family == "gpt2" else 64
    task = "causal_lm" if family == "gpt2" else "seq2seq"
    module = PeftModule(model, task=task, peft=config)
    rows = [{"prompt": "p" * (limit - 4), "response": "r"}]  # prompt + response + EOS: the table, less 1
    if family == "bart":  # the encoder input fills the table; the target (+ EOS), with the prefix, runs past it
        rows = [{"prompt": "p" * limit, "response": "r" * (limit - 3)}]
    data = _data(tmp_path, rows, char_tokenizer(), task=task)
    kind, longest = ("rows", limit - 2) if family == "gpt2" else ("targets", limit - 2)
    with pytest.raises(DataError, match=rf"^the validation split has {kind} of {longest} tokens \+ 3 virtual, but "
                                        rf".* holds {limit} positions: set data\.max_length to {limit - 3} or less$"):
        _trainer(tmp_path).validate(module, datamodule=data, verbose=False)
