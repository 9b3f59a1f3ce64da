"""Review fixes of prompt classification: prompt-learning adapters score each row as its unpadded self (the batch
it sits in changes nothing), label words and prompts of a Llama-2-style SentencePiece tokenizer (a ``▁`` on every
text's start, ``<s>`` added), and bad ``k``/``split_seed`` values refused in one line."""

from __future__ import annotations

import string
import warnings

import pytest
import torch

from peftplug.data.kshot import sample_pool_splits
from peftplug.data.lmbff import sample_kshot
from peftplug.data.prompt_templates import answer_context
from peftplug.errors import ConfigError
from peftplug.prompt_cls import (
    PROMPT_TASKS,
    PromptClassificationData,
    label_word_ids,
    label_word_logits,
    predict_labels,
    render_prompt,
)

WORDS = torch.tensor([10, 20, 33])
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34]]


def _batch(prompts, labels=None):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = {"input_ids": ids, "attention_mask": mask, "label_word_ids": WORDS}
    if labels is not None:
        batch["labels"] = torch.tensor(labels)
    return batch


def _peft(tiny_model, family, adapter):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model

    torch.manual_seed(0)
    config = {
        "prompt_tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
        "prefix_tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }[adapter]
    return get_peft_model(tiny_model(family, "causal_lm", seed=0), config).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary and absolute position embeddings
@pytest.mark.parametrize("adapter", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_scores_do_not_depend_on_the_batch(tiny_model, family, adapter):
    model = _peft(tiny_model, family, adapter)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = _batch(PROMPTS)
        batched = label_word_logits(model, batch["input_ids"], batch["attention_mask"], WORDS)
        # Reference: each prompt alone through PEFT's own forward (virtual tokens directly before the text).
        alone = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1, WORDS] for p in PROMPTS])
        # Evaluation with batch size 1 and 3 gives the same predictions and the same logits.
        one = predict_labels(model, [_batch([p], [0]) for p in PROMPTS])[0]
        three = predict_labels(model, [_batch(PROMPTS, [0, 0, 0])])[0]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(one, three)
    # The batch really is padded (the shortest row has 6 pads before it).
    assert batch["attention_mask"].sum(-1).tolist() == [9, 3, 5]


def test_prompt_learning_gradients_reach_the_virtual_tokens_and_disable_adapter_is_the_base(tiny_model):
    from peftplug.prompt_scoring import prompt_cls_forward

    model = _peft(tiny_model, "llama", "prompt_tuning").train()
    batch = _batch(PROMPTS, [0, 1, 2])
    prompt_cls_forward(model, batch).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            disabled = label_word_logits(model, batch["input_ids"], batch["attention_mask"], WORDS)
        base = model.get_base_model()
        plain = torch.stack([base(input_ids=torch.tensor([p])).logits[0, -1, WORDS] for p in PROMPTS])
    torch.testing.assert_close(disabled, plain, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- SentencePiece tokenizer
def _llama_style_tokenizer():
    """A Llama-2-style SentencePiece tokenizer, built offline: a ``▁`` prepended to every text and replacing its
    spaces (so ``" great"`` alone is ``["▁", "▁great"]`` and ``"Yes"`` alone is ``["▁Yes"]``), ``<s>`` added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [c for c in string.printable if c not in " \x0b\x0c\r"]
    words = ["great", "terrible", "It", "was", "Yes", "No", "this", "mean", "that", "is", "true", "or"]
    pieces = specials + ["▁"] + chars + ["▁" + c for c in chars] + words + ["▁" + w for w in words]
    tok = Tokenizer(models.Unigram([(p, -20.0 if len(p) == 1 else -1.0) for p in pieces], unk_id=0))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out.pad_token = out.eos_token
    return out


@pytest.mark.parametrize("task", ["sst2", "rte"])  # a space before {answer}, and a newline
def test_label_words_are_the_tokens_that_follow_the_prompt(task):
    tok = _llama_style_tokenizer()
    template = PROMPT_TASKS[task].plain
    example = {"sentence": "this is great", "premise": "It was", "hypothesis": "this is true"}
    fields = {f: example[f] for f in PROMPT_TASKS[task].fields}
    prompt = render_prompt(tok, template.text, fields)
    for word in template.label_words:
        # Reference: the whole text, answer included, as the model reads it; the label word is the token after
        # the prompt's tokens.
        full = tok(template.text.format(**fields, answer=word))["input_ids"]
        assert full[: len(prompt)] == prompt
        ids = label_word_ids(tok, template.label_words, template.text.endswith(" {answer}"),
                             context=answer_context(template.text))
        assert full[len(prompt)] == ids[template.label_words.index(word)]


def test_data_module_with_a_sentencepiece_tokenizer(data_dir):
    tok = _llama_style_tokenizer()
    dm = PromptClassificationData(task="sst2", data_dir=str(data_dir), k=16, split_seed=42, max_test=4)
    dm.tokenizer = tok
    dm.setup()
    # Before: ' terrible' alone is ['▁', '▁terrible'], refused as two tokens.
    assert tok.convert_ids_to_tokens(dm.label_word_ids) == ["▁terrible", "▁great"]
    # Every prompt starts with the <s> the model was trained with, and is the text's own tokens after it.
    row = dm.splits["train"][0]
    assert row["input_ids"][0] == tok.bos_token_id
    assert dm.collate([row])["input_ids"][0].tolist() == row["input_ids"]


def test_plain_prompts_start_with_bos_and_still_fit_max_length():
    tok = _llama_style_tokenizer()
    text = "It was great " * 20
    prompt = render_prompt(tok, "{sentence} It was {answer}", {"sentence": text})
    assert prompt == tok(text.strip() + " It was")["input_ids"]
    cut = render_prompt(tok, "{sentence} It was {answer}", {"sentence": text}, max_length=10)
    assert len(cut) <= 10 and cut[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(cut[-2:]) == ["▁It", "▁was"]


def test_tokenizers_without_bos_are_unchanged(tokenizer):
    # The char tokenizer (like SmolLM2's) adds no special token: the prompt is the text's tokens only.
    assert render_prompt(tokenizer, "{sentence} It was {answer}", {"sentence": "ok"}) == \
        tokenizer("ok It was", add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------- bad k / split_seed
@pytest.mark.parametrize("kw, needle", [
    ({"task": "boolq", "k": -3}, "data.k must be an int >= 1"),
    ({"task": "boolq", "k": 0}, "data.k must be an int >= 1"),
    ({"task": "sst2", "k": 0}, "data.k must be an int >= 1"),
    ({"task": "rte", "source": "hub", "split_seed": -1}, r"data.split_seed must be an int in \[0, 4294967295\]"),
    ({"task": "boolq", "split_seed": 2 ** 32}, r"data.split_seed must be an int in \[0, 4294967295\]"),
])
def test_bad_k_and_split_seed_are_one_line_errors(kw, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle) as err:
        PromptClassificationData(data_dir=str(tmp_path), **kw)
    assert "\n" not in str(err.value)


def test_samplers_refuse_bad_k_and_seeds():
    rows = [{"label": lab, "text": str(i)} for i, lab in enumerate(["0", "1"] * 20)]
    with pytest.raises(ConfigError, match="k must be >= 1"):
        sample_pool_splits(rows, ("0", "1"), -3, 0)  # before: 17 train rows per class and no dev row
    with pytest.raises(ConfigError, match=r"split seed -1 is outside \[0, 2\*\*32 - 1\]"):
        sample_kshot([r["label"] for r in rows], 4, (-1,))


def test_kshot_command_refuses_a_negative_seed_in_one_line(tmp_path, capsys):
    from peftplug.data.lmbff_cli import main

    # The seeds are checked before the hub is read: no network needed.
    assert main(["RTE", "--data-dir", str(tmp_path), "--seeds", "-1"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "split seed -1 is outside" in err
