"""Prompt-based classification for causal LMs (MeZO's "train as classification", LM-BFF's templates).

A task is posed as text the pretrained LM can already half-complete: a template with the example's fields and an
answer slot ``{answer}`` at its end, and one *label word* per class (``It was {answer}`` with ``terrible`` /
``great``). The model reads the prompt up to the slot; its logits at the last prompt position, restricted to the
label words, are the class scores:

    loss = cross_entropy(logits[answer position, label words], label)     accuracy = argmax over the label words

Only the label words' rows of the LM head are computed (:func:`label_word_logits`): the full 49k-row head of
SmolLM2 is ~17% of a forward pass. Prompts are left-padded, so the last position is the answer position of every
row (rotary attention depends on relative positions only; the test suite checks padded against unpadded logits).

Two renderings (``format``):

- ``"plain"`` (default): the template as plain text, no chat markup — LM-BFF's and MeZO's protocol. A space before
  ``{answer}`` moves into the label word (``" great"``), because byte-level BPE tokens carry their leading space.
- ``"chat"``: the template text before the slot is the *user* turn of the tokenizer's chat template and the answer
  is the first token of the assistant's reply (label words without a leading space). Each built-in task has its
  own chat template (a question rather than a cloze, which is what an instruction-tuned model answers).

:class:`PromptClassificationData` reads the LM-BFF/MeZO k-shot splits (``k-shot/<TASK>/<k>-<seed>/train|dev`` and
``k-shot/<TASK>/test``) of the tasks in :data:`PROMPT_TASKS`; its batches carry ``label_word_ids`` next to
``input_ids``/``attention_mask``/``labels``, so that :class:`peftplug.lightning.PeftModule` with
``task="prompt_cls"`` needs nothing else (and so that prompt transfer can reuse it with any data).
"""

from __future__ import annotations

import csv
import random
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from peftplug.data import _TokenizedDataModule, pad_batch
from peftplug.errors import ConfigError, DataError, MissingFileError

ANSWER = "answer"
FORMATS = ("plain", "chat")
MULTI_TOKEN_POLICIES = ("error", "first")


@dataclass(frozen=True)
class PromptTemplate:
    """A template and its label words.

    Args:
        text: Template with ``{field}`` slots for the example's fields and one ``{answer}`` slot at its very end.
        label_words: One word per class, in class order.
    """

    text: str
    label_words: tuple[str, ...]


@dataclass(frozen=True)
class PromptTask:
    """A k-shot classification task: where its files are, how to read them, and its templates.

    Args:
        name: Task name (key of :data:`PROMPT_TASKS`).
        folder: Folder under ``k-shot/``.
        suffix: ``.tsv`` (GLUE layout, header row) or ``.csv`` (LM-BFF layout: ``label,sentence``, no header).
        fields: Template fields and the header columns they come from (``.tsv``), or their column index (``.csv``).
        label_column: Label column name (``.tsv``) or index (``.csv``).
        labels: The raw label values in class order.
        plain: The plain-text template.
        chat: The chat template (user turn before the slot, assistant reply = label word).
        header: Whether a ``.tsv`` file starts with a header row (CoLA's has none: columns are then indices).
        dev_name: File stem of the validation split (MNLI: ``dev_matched``).
        test_name: File stem of the test split (MNLI: ``test_matched``).
        test_in_split: The test file sits in each ``<k>-<seed>`` folder (CoLA's test subsample differs per seed).

    A ``.jsonl`` task (BoolQ) has no k-shot folder: ``folder`` is the path of one labelled pool under the data
    directory, from which each split seed samples ``k`` train and ``k`` dev examples per class; the rest is test.
    """

    name: str
    folder: str
    suffix: str
    fields: dict[str, str | int]
    label_column: str | int
    labels: tuple[str, ...]
    plain: PromptTemplate
    chat: PromptTemplate
    header: bool = True
    dev_name: str = "dev"
    test_name: str = "test"
    test_in_split: bool = False


_SENTIMENT_PLAIN = PromptTemplate("{sentence} It was {answer}", ("terrible", "great"))
_SENTIMENT_CHAT = PromptTemplate("Review: {sentence}\nIs this review positive or negative?{answer}",
                                 ("negative", "positive"))

#: Built-in tasks. Plain templates follow LM-BFF (SST-2, CR, subj) and MeZO's OPT templates (RTE); TREC's LM-BFF
#: template puts the answer first, which a causal LM cannot score, so it is recast as ``... Answer type: {answer}``.
PROMPT_TASKS: dict[str, PromptTask] = {
    "sst2": PromptTask("sst2", "SST-2", ".tsv", {"sentence": "sentence"}, "label", ("0", "1"),
                       _SENTIMENT_PLAIN, _SENTIMENT_CHAT),
    "cr": PromptTask("cr", "cr", ".csv", {"sentence": 1}, 0, ("0", "1"), _SENTIMENT_PLAIN, _SENTIMENT_CHAT),
    "rte": PromptTask(
        "rte", "RTE", ".tsv", {"premise": "sentence1", "hypothesis": "sentence2"}, "label",
        ("entailment", "not_entailment"),
        PromptTemplate('{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?\n{answer}', ("Yes", "No")),
        PromptTemplate('{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?{answer}', ("Yes", "No")),
    ),
    "subj": PromptTask("subj", "subj", ".csv", {"sentence": 1}, 0, ("0", "1"),
                       PromptTemplate("{sentence} This is {answer}", ("subjective", "objective")),
                       PromptTemplate("{sentence}\nIs this text subjective or objective?{answer}",
                                      ("subjective", "objective"))),
    "trec": PromptTask(
        "trec", "trec", ".csv", {"sentence": 1}, 0, ("0", "1", "2", "3", "4", "5"),
        PromptTemplate("Question: {sentence}\nAnswer type: {answer}",
                       ("description", "entity", "abbreviation", "human", "location", "number")),
        PromptTemplate("Question: {sentence}\nIs the answer a description, entity, abbreviation, human, location "
                       "or number?{answer}", ("description", "entity", "abbreviation", "human", "location", "number")),
    ),
}

_YES_NO = ("Yes", "No")
_NO_YES = ("No", "Yes")

#: GLUE/SuperGLUE pair tasks and CoLA (added for prompt transfer: MNLI, QNLI, QQP as sources; MRPC, CoLA, BoolQ as
#: held-out targets). Label words are LM-BFF's (``Yes``/``No``/``Maybe``, ``correct``/``incorrect``); LM-BFF puts the
#: mask between the two sentences (``<s1> ? [MASK] , <s2>``), which a causal LM cannot score, so the pair tasks take
#: MeZO's OPT templates where MeZO has one (CB's for MNLI, RTE's question form for QNLI, BoolQ's
#: ``<passage> <question>?\n``) and the same "question + Yes or No?" form otherwise (QQP, MRPC). CoLA keeps LM-BFF's
#: ``<sentence> This is [MASK].`` without the final period. Every label word is one SmolLM2 token (tested).
PROMPT_TASKS.update({
    "mnli": PromptTask(
        "mnli", "MNLI", ".tsv", {"premise": "sentence1", "hypothesis": "sentence2"}, "gold_label",
        ("entailment", "neutral", "contradiction"),
        PromptTemplate('Suppose {premise} Can we infer that "{hypothesis}"? Yes, No, or Maybe?\n{answer}',
                       ("Yes", "Maybe", "No")),
        PromptTemplate('Suppose {premise} Can we infer that "{hypothesis}"? Yes, No, or Maybe?{answer}',
                       ("Yes", "Maybe", "No")),
        dev_name="dev_matched", test_name="test_matched",
    ),
    "qnli": PromptTask(
        "qnli", "QNLI", ".tsv", {"sentence": "sentence", "question": "question"}, "label",
        ("entailment", "not_entailment"),
        PromptTemplate('{sentence}\nDoes this sentence answer the question "{question}"? Yes or No?\n{answer}', _YES_NO),
        PromptTemplate('{sentence}\nDoes this sentence answer the question "{question}"? Yes or No?{answer}', _YES_NO),
    ),
    "qqp": PromptTask(
        "qqp", "QQP", ".tsv", {"question1": "question1", "question2": "question2"}, "is_duplicate", ("0", "1"),
        PromptTemplate("Question 1: {question1}\nQuestion 2: {question2}\nDo these two questions ask the same thing? "
                       "Yes or No?\n{answer}", _NO_YES),
        PromptTemplate("Question 1: {question1}\nQuestion 2: {question2}\nDo these two questions ask the same thing? "
                       "Yes or No?{answer}", _NO_YES),
    ),
    "mrpc": PromptTask(
        "mrpc", "MRPC", ".tsv", {"sentence1": "#1 String", "sentence2": "#2 String"}, "Quality", ("0", "1"),
        PromptTemplate("Sentence 1: {sentence1}\nSentence 2: {sentence2}\nDo these two sentences mean the same thing? "
                       "Yes or No?\n{answer}", _NO_YES),
        PromptTemplate("Sentence 1: {sentence1}\nSentence 2: {sentence2}\nDo these two sentences mean the same thing? "
                       "Yes or No?{answer}", _NO_YES),
    ),
    "cola": PromptTask(
        "cola", "CoLA", ".tsv", {"sentence": 3}, 1, ("0", "1"),
        PromptTemplate("{sentence} This is {answer}", ("incorrect", "correct")),
        PromptTemplate("{sentence}\nIs this sentence grammatically correct? Yes or No?{answer}", _NO_YES),
        header=False, test_in_split=True,
    ),
    "boolq": PromptTask(
        "boolq", "SuperGLUE/val/BoolQ/val.jsonl", ".jsonl", {"passage": "passage", "question": "question"}, "label",
        ("false", "true"),
        PromptTemplate("{passage} {question}?\n{answer}", _NO_YES),
        PromptTemplate("{passage}\nQuestion: {question}? Yes or No?{answer}", _NO_YES),
    ),
})


# ----------------------------------------------------------------------------------------------- templates
def template_fields(text: str) -> list[str]:
    """The slot names of a template, in order (``{answer}`` included).

    Args:
        text: The template.

    Raises:
        ConfigError: If the template is not valid ``str.format`` syntax, lacks the ``{answer}`` slot, has it more
            than once or not at its end.
    """
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise ConfigError(f"data.template {text!r} is not a valid template ({err}); write slots as {{field}}") from None
    if ANSWER not in names:
        raise ConfigError(f"data.template {text!r} has no answer slot {{{ANSWER}}}: add it where the label word goes")
    if names.count(ANSWER) > 1 or not text.endswith("{" + ANSWER + "}"):
        raise ConfigError(f"data.template {text!r}: the answer slot {{{ANSWER}}} must appear once, at the end "
                          "(a causal LM predicts the label word from the text before it)")
    return names


def split_template(text: str) -> tuple[str, bool]:
    """The template before the answer slot, and whether a space preceded the slot (it moves into the label word).

    Args:
        text: A template ending in ``{answer}``.
    """
    template_fields(text)
    before = text[: -len("{" + ANSWER + "}")]
    if before.endswith(" "):
        return before[:-1], True
    return before, False


def label_word_ids(tokenizer: Any, words: tuple[str, ...] | list[str], leading_space: bool,
                   multi_token: str = "error") -> list[int]:
    """One token id per label word (with a leading space when the template had one before the slot).

    Args:
        tokenizer: The model's tokenizer.
        words: The label words, in class order.
        leading_space: Prepend a space to each word before tokenizing.
        multi_token: What to do with a word that is several tokens: ``"error"`` (default: the loss scores one
            position, so a multi-token word would be scored by its first piece only) or ``"first"`` (use the first
            piece, which must still differ between classes).

    Raises:
        ConfigError: For a multi-token word under ``"error"``, an empty word, or two classes sharing a token.
    """
    if multi_token not in MULTI_TOKEN_POLICIES:
        raise ConfigError(f"data.multi_token must be one of {', '.join(MULTI_TOKEN_POLICIES)}; got {multi_token!r}")
    if len(words) < 2:
        raise ConfigError(f"data.label_words needs at least two words; got {list(words)!r}")
    ids = []
    for word in words:
        text = (" " + word) if leading_space else word
        pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not pieces:
            raise ConfigError(f"data.label_words: {word!r} tokenizes to nothing")
        if len(pieces) > 1 and multi_token == "error":
            shown = [tokenizer.decode([i]) for i in pieces]
            raise ConfigError(f"data.label_words: {text!r} is {len(pieces)} tokens {shown}; choose a one-token word "
                              "or set data.multi_token: first (scores its first token only)")
        ids.append(pieces[0])
    if len(set(ids)) < len(ids):
        dup = [w for w, i in zip(words, ids) if ids.count(i) > 1]
        raise ConfigError(f"data.label_words {dup} map to the same token; the classes would be indistinguishable")
    return ids


def render_prompt(tokenizer: Any, template: str, example: dict[str, str], fmt: str = "plain",
                  system_prompt: str | None = None, max_length: int = 256) -> list[int]:
    """Token ids of one prompt up to (not including) the answer.

    When the prompt is longer than ``max_length`` the template's *first* field is cut from its end (LM-BFF's
    ``first_sent_limit``), token by token, so the instruction and the answer position survive.

    Args:
        tokenizer: The model's tokenizer (with a chat template for ``fmt="chat"``).
        template: Template ending in ``{answer}``.
        example: Field values.
        fmt: ``"plain"`` or ``"chat"``.
        system_prompt: System message for ``"chat"`` (``None``: the chat template's default).
        max_length: Maximum prompt tokens.

    Raises:
        DataError: If the prompt cannot fit even with its first field emptied.
    """
    before, _ = split_template(template)
    names = [n for n in template_fields(template) if n != ANSWER]
    missing = [n for n in names if n not in example]
    if missing:
        raise ConfigError(f"data.template uses {missing} but the task's fields are {sorted(example)}")
    values = {n: str(example[n]).strip() for n in names}

    def encode(vals: dict[str, str]) -> list[int]:
        text = before.format(**vals)
        if fmt == "plain":
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
        messages.append({"role": "user", "content": text})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    ids = encode(values)
    if len(ids) <= max_length or not names:
        if len(ids) > max_length:
            raise DataError(f"the prompt takes {len(ids)} tokens > data.max_length={max_length}")
        return ids
    first = names[0]
    pieces = tokenizer(values[first], add_special_tokens=False)["input_ids"]
    keep = max(0, len(pieces) - (len(ids) - max_length))
    while True:  # decoding and re-encoding can merge tokens differently: shrink until it fits
        ids = encode({**values, first: tokenizer.decode(pieces[:keep])})
        if len(ids) <= max_length:
            return ids
        if keep == 0:
            raise DataError(f"the template alone takes {len(ids)} tokens > data.max_length={max_length}")
        keep = max(0, keep - max(1, len(ids) - max_length))


# -------------------------------------------------------------------------------------------- loss and logits
def _is_prompt_learning(model: torch.nn.Module) -> bool:
    configs = getattr(model, "peft_config", None)
    name = getattr(model, "active_adapter", None)
    if not isinstance(configs, dict) or not isinstance(name, str) or name not in configs:
        return False
    return bool(getattr(configs[name], "is_prompt_learning", False))


def label_word_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      word_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the label words at the last position of left-padded prompts: ``[batch, classes]``.

    For a plain causal LM (or one with a weight adapter such as LoRA/OFTv2 inside it) this runs the decoder and
    multiplies the last hidden state by the label words' rows of the LM head only. Where that shortcut would be
    wrong — prompt-learning adapters (their virtual tokens are prepended by the PEFT wrapper), an adapted LM head,
    logit soft-capping — it falls back to the full model with ``logits_to_keep=1`` (full head, last position).

    Args:
        model: A causal LM, optionally wrapped by PEFT.
        input_ids: Left-padded prompts ``[batch, length]``.
        attention_mask: Their attention mask.
        word_ids: Label-word token ids ``[classes]``.
    """
    word_ids = word_ids.to(input_ids.device)
    wrapped = hasattr(model, "get_base_model")
    lm = model.get_base_model() if wrapped and not _is_prompt_learning(model) else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    shortcut = (not (wrapped and lm is model) and isinstance(head, torch.nn.Linear) and decoder is not None
                and decoder is not lm and not hasattr(head, "base_layer")
                and getattr(lm.config, "final_logit_softcapping", None) is None)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    if not (wrapped and lm is model):
        # Positions counted over real tokens: a left-padded row then sees exactly the positions of its unpadded
        # self (RoPE would only need relative positions; absolute position embeddings need this). PEFT's
        # prompt-learning wrapper ignores position ids, so there the virtual tokens' distance to the text depends
        # on the padding (a limitation of prompt tuning with left padding, not of this function).
        inputs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    if not shortcut:
        return model(**inputs, logits_to_keep=1).logits[:, -1].index_select(-1, word_ids)
    hidden = decoder(**inputs).last_hidden_state[:, -1]
    bias = None if head.bias is None else head.bias.index_select(0, word_ids)
    return F.linear(hidden, head.weight.index_select(0, word_ids), bias)


@dataclass
class PromptClsOutput:
    """What :func:`prompt_cls_forward` returns: the mean loss (``None`` without labels) and the class logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


def prompt_cls_forward(model: torch.nn.Module, batch: dict) -> PromptClsOutput:
    """Label-word logits and cross-entropy of a prompt-classification batch.

    Args:
        model: A causal LM (optionally PEFT-wrapped).
        batch: ``input_ids`` and ``attention_mask`` (left-padded), ``label_word_ids`` ``[classes]`` (or
            ``[batch, classes]``, identical rows, as a DataLoader may stack it) and optionally ``labels`` (class
            indices).
    """
    if "label_word_ids" not in batch:
        raise DataError("task prompt_cls needs batches with 'label_word_ids' (use PromptClassificationData)")
    words = batch["label_word_ids"]
    if words.dim() == 2:
        words = words[0]
    logits = label_word_logits(model, batch["input_ids"], batch["attention_mask"], words)
    labels = batch.get("labels")
    loss = None if labels is None else F.cross_entropy(logits.float(), labels.to(logits.device))
    return PromptClsOutput(loss=loss, logits=logits)


def predict_labels(model: torch.nn.Module, batches: Iterable[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted class (argmax over the label words) and the gold class of every example, without gradients.

    Args:
        model: A causal LM (optionally PEFT-wrapped), in the mode the caller wants (eval for a zero-shot score).
        batches: Prompt-classification batches with ``labels`` (see :func:`prompt_cls_forward`).

    Returns:
        ``(predicted, labels)``, two 1-D tensors of class indices on the CPU, in the batches' order.
    """
    predicted, labels = [], []
    with torch.no_grad():
        for batch in batches:
            predicted.append(prompt_cls_forward(model, batch).logits.argmax(-1).cpu())
            labels.append(batch["labels"].cpu())
    return torch.cat(predicted), torch.cat(labels)


# ------------------------------------------------------------------------------------------------------ data
def _read_rows(path: Path, task: PromptTask) -> list[dict[str, str]]:
    """Rows of a k-shot file as ``{field: text, "label": raw label}``."""
    if not path.is_file():
        raise MissingFileError(f"task {task.name!r}: data file {str(path)!r} does not exist")
    if task.suffix == ".jsonl":
        return _read_jsonl(path, task)
    rows = []
    with path.open(encoding="utf-8-sig", newline="") as handle:
        if task.suffix == ".tsv" and task.header:
            reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header is None:
                raise DataError(f"data file {str(path)!r} is empty")
            want = list(task.fields.values()) + [task.label_column]
            absent = [c for c in want if c not in header]
            if absent:
                raise DataError(f"data file {str(path)!r} has no column {absent}; its columns are {header}")
            index = {c: header.index(c) for c in want}
        else:  # LM-BFF .csv, or a GLUE .tsv without header (CoLA): columns by index
            reader = (csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE) if task.suffix == ".tsv"
                      else csv.reader(handle))
            index = {c: c for c in list(task.fields.values()) + [task.label_column]}
        for line, row in enumerate(reader, start=2 if task.suffix == ".tsv" and task.header else 1):
            if not row:
                continue
            if max(index.values()) >= len(row):
                raise DataError(f"data file {str(path)!r}, line {line}: {len(row)} fields, expected more")
            label = row[index[task.label_column]].strip()
            if label not in task.labels:
                raise DataError(f"data file {str(path)!r}, line {line}: label {label!r} is not one of {task.labels}")
            rows.append({**{f: row[index[c]] for f, c in task.fields.items()}, "label": label})
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows")
    return rows


def _read_jsonl(path: Path, task: PromptTask) -> list[dict[str, str]]:
    """Rows of a SuperGLUE-style ``.jsonl`` file; labels as ``str(value).lower()`` (``true``/``false``)."""
    import json

    rows = []
    with path.open(encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"data file {str(path)!r}, line {line}: not JSON ({err.msg})") from None
            absent = [c for c in list(task.fields.values()) + [task.label_column] if c not in item]
            if absent:
                raise DataError(f"data file {str(path)!r}, line {line}: no key {absent}; keys are {sorted(item)}")
            label = str(item[task.label_column]).lower()  # "true" (OpenCompass copy) and true (FewGLUE) alike
            if label not in task.labels:
                raise DataError(f"data file {str(path)!r}, line {line}: label {label!r} is not one of {task.labels}")
            rows.append({**{f: str(item[c]) for f, c in task.fields.items()}, "label": label})
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows")
    return rows


def sample_pool_splits(rows: list[dict[str, str]], labels: tuple[str, ...], k: int,
                       split_seed: int) -> dict[str, list[dict[str, str]]]:
    """Train/dev/test from one labelled pool: ``k`` train and ``k`` dev rows per class drawn with ``split_seed``;
    every other row is test (so the three never overlap, and the test set differs slightly per seed).

    Args:
        rows: The pool (rows with a ``label`` key).
        labels: The class labels.
        k: Shots per class.
        split_seed: Seed of the draw.

    Raises:
        DataError: If a class has fewer than ``2 k`` rows.
    """
    rng = random.Random(split_seed)
    out: dict[str, list] = {"train": [], "validation": [], "test": []}
    for label in labels:
        members = [r for r in rows if r["label"] == label]
        if len(members) < 2 * k:
            raise DataError(f"label {label!r} has {len(members)} rows; k={k} needs {2 * k} (train + dev)")
        rng.shuffle(members)
        out["train"] += members[:k]
        out["validation"] += members[k:2 * k]
        out["test"] += members[2 * k:]
    rng.shuffle(out["train"])
    rng.shuffle(out["validation"])
    return out


def kshot_files(data_dir: str | Path, task: str, k: int, split_seed: int) -> dict[str, Path]:
    """The train/dev/test files of an LM-BFF k-shot split.

    Args:
        data_dir: The shared data directory (holding ``k-shot/``).
        task: A key of :data:`PROMPT_TASKS`.
        k: Shots per class (16; 512 for seed 42 where present).
        split_seed: The split's seed (13, 21, 42, 87, 100).

    Raises:
        ConfigError: For an unknown task.
        MissingFileError: If the task or split has no data under ``data_dir``.
    """
    spec = get_task(task)
    if spec.suffix == ".jsonl":  # one pooled file; the splits are drawn from it per seed (sample_pool_splits)
        pool = Path(data_dir).expanduser() / spec.folder
        if not pool.is_file():
            raise MissingFileError(f"task {task!r} has no data: {str(pool)!r} does not exist (data.data_dir?)")
        return {"train": pool, "validation": pool, "test": pool}
    root = Path(data_dir).expanduser() / "k-shot" / spec.folder
    if not root.is_dir():
        raise MissingFileError(f"task {task!r} has no data: {str(root)!r} does not exist (data.data_dir?)")
    split = root / f"{k}-{split_seed}"
    if not split.is_dir():
        have = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise MissingFileError(f"task {task!r} has no split {split.name!r}; available: {', '.join(have)}")
    return {"train": split / f"train{spec.suffix}", "validation": split / f"{spec.dev_name}{spec.suffix}",
            "test": (split if spec.test_in_split else root) / f"{spec.test_name}{spec.suffix}"}


def split_rows(task: str, files: dict[str, Path], k: int, split_seed: int,
               max_test: int | None = None) -> dict[str, list[dict[str, str]]]:
    """The untokenized rows of each split, exactly as :class:`PromptClassificationData` uses them.

    Args:
        task: A key of :data:`PROMPT_TASKS`.
        files: :func:`kshot_files`' result for the split.
        k: Shots per class (a pooled task draws its splits with it).
        split_seed: The split's seed.
        max_test: Keep at most this many test rows, a fixed random subset (the same for every split seed).
    """
    spec = get_task(task)
    pooled = (sample_pool_splits(_read_rows(files["train"], spec), spec.labels, k, split_seed)
              if spec.suffix == ".jsonl" else None)
    out = {}
    for split, path in files.items():
        rows = pooled[split] if pooled is not None else _read_rows(path, spec)
        if split == "test" and max_test is not None and len(rows) > max_test:
            rows = random.Random(0).sample(rows, max_test)
        out[split] = rows
    return out


def get_task(name: str) -> PromptTask:
    """Looks up a built-in task.

    Args:
        name: A key of :data:`PROMPT_TASKS`.
    """
    key = re.sub(r"[^a-z0-9]", "", str(name).lower())
    if key not in PROMPT_TASKS:
        raise ConfigError(f"data.task must be one of {', '.join(PROMPT_TASKS)}; got {name!r}")
    return PROMPT_TASKS[key]


class PromptClassificationData(_TokenizedDataModule):
    """LM-BFF/MeZO k-shot classification posed as prompts for a causal LM (use with ``task: prompt_cls``).

    Train and validation are the split's ``train`` and ``dev`` files (k per class each); test is the task's test
    file (≤ 1000 examples), optionally subsampled to ``max_test`` examples with a fixed seed, the same subset for
    every split seed. Batches are left-padded and carry ``label_word_ids``.

    Args:
        task: A key of :data:`PROMPT_TASKS` (``sst2``, ``rte``, ``cr``, ``subj``, ``trec``, ``mnli``, ``qnli``,
            ``qqp``, ``mrpc``, ``cola``, ``boolq``; BoolQ draws its splits from SuperGLUE val per ``split_seed``).
        data_dir: Directory holding ``k-shot/`` (the project's shared data).
        k: Shots per class.
        split_seed: Seed of the k-shot split (13, 21, 42, ...).
        format: ``plain`` (template as text) or ``chat`` (template as the user turn of the chat template).
        template: Override of the task's template (must end with ``{answer}``).
        label_words: Override of the label words, in class order.
        multi_token: ``error`` or ``first``, see :func:`label_word_ids`.
        system_prompt: System message in ``chat`` format (``None``: the chat template's default).
        max_test: Use at most this many test examples (``None``: all).
        max_length: Maximum prompt tokens (the first field is cut when longer).
        tokenizer: Tokenizer name/path; defaults to the model's.
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the training shuffle.
    """

    def __init__(
        self,
        task: str = "sst2",
        data_dir: str = "../shared/data",
        k: int = 16,
        split_seed: int = 42,
        format: str = "plain",
        template: str | None = None,
        label_words: list[str] | None = None,
        multi_token: str = "error",
        system_prompt: str | None = None,
        max_test: int | None = None,
        max_length: int = 256,
        tokenizer: str | None = None,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer, max_length, batch_size, eval_batch_size, num_workers, seed)
        self.task = get_task(task)
        if format not in FORMATS:
            raise ConfigError(f"data.format must be one of {', '.join(FORMATS)}; got {format!r}")
        if max_test is not None and max_test < 1:
            raise ConfigError(f"data.max_test must be >= 1; got {max_test}")
        if multi_token not in MULTI_TOKEN_POLICIES:
            raise ConfigError(f"data.multi_token must be one of {', '.join(MULTI_TOKEN_POLICIES)}; got {multi_token!r}")
        default = self.task.chat if format == "chat" else self.task.plain
        self.template = template if template is not None else default.text
        self.words = tuple(label_words) if label_words is not None else default.label_words
        fields = [n for n in template_fields(self.template) if n != ANSWER]
        unknown = [n for n in fields if n not in self.task.fields]
        if unknown:
            raise ConfigError(f"data.template uses {unknown}; task {self.task.name!r} has fields "
                              f"{', '.join(self.task.fields)}")
        if len(self.words) != len(self.task.labels):
            raise ConfigError(f"data.label_words has {len(self.words)} words; task {self.task.name!r} has "
                              f"{len(self.task.labels)} classes")
        self.files = kshot_files(data_dir, self.task.name, k, split_seed)
        self.k, self.split_seed = k, split_seed
        self.format, self.multi_token, self.system_prompt, self.max_test = format, multi_token, system_prompt, max_test
        self.label_word_ids: list[int] = []

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes every split (once).

        Args:
            stage: Lightning stage (unused).
        """
        if self.splits:
            return
        tokenizer = self._resolve_tokenizer()
        _, space = split_template(self.template)
        self.label_word_ids = label_word_ids(tokenizer, self.words, space and self.format == "plain",
                                             self.multi_token)
        for split, rows in split_rows(self.task.name, self.files, self.k, self.split_seed, self.max_test).items():
            self.splits[split] = [
                {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": self.task.labels.index(row["label"])}
                for row in rows
                for ids in [render_prompt(tokenizer, self.template, row, self.format, self.system_prompt,
                                          self.max_length)]
            ]

    def token_lengths(self) -> dict[str, tuple[float, int]]:
        """Mean and maximum prompt length in tokens per split (after ``setup``)."""
        return {s: (sum(len(f["input_ids"]) for f in rows) / len(rows), max(len(f["input_ids"]) for f in rows))
                for s, rows in self.splits.items()}

    def _collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = pad_batch(features, self.tokenizer.pad_token_id, left=True)
        batch["label_word_ids"] = torch.tensor(self.label_word_ids, dtype=torch.long)
        return batch
