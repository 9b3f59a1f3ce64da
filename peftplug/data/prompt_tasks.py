"""The catalogue of prompt-classification tasks: where each task's k-shot files are, how to read them, and its
templates and label words (plain text and chat). Rendering and scoring live in :mod:`peftplug.data.prompt_templates`
and :mod:`peftplug.prompt_scoring`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from peftplug.errors import ConfigError


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
                       # Chat: a yes/no question, as "subjective" (no leading space) is two SmolLM2 tokens.
                       PromptTemplate("{sentence}\nIs this text subjective (an opinion)? Yes or No?{answer}",
                                      ("Yes", "No"))),
    "trec": PromptTask(
        "trec", "trec", ".csv", {"sentence": 1}, 0, ("0", "1", "2", "3", "4", "5"),
        PromptTemplate("Question: {sentence}\nAnswer type: {answer}",
                       ("description", "entity", "abbreviation", "human", "location", "number")),
        # Chat: LM-BFF's own word for ABBR, "expression" ("abbreviation" with no leading space is three SmolLM2 tokens).
        PromptTemplate("Question: {sentence}\nIs the answer a description, entity, expression, human, location "
                       "or number?{answer}", ("description", "entity", "expression", "human", "location", "number")),
    ),
}

_YES_NO = ("Yes", "No")
_NO_YES = ("No", "Yes")

#: GLUE/SuperGLUE pair tasks and CoLA (added for prompt transfer: MNLI, QNLI, QQP as sources; MRPC, CoLA, BoolQ as
#: held-out targets). Label words are LM-BFF's (``Yes``/``No``/``Maybe``, ``correct``/``incorrect``); LM-BFF puts the
#: mask between the two sentences (``<s1> ? [MASK] , <s2>``), which a causal LM cannot score, so the pair tasks take
#: MeZO's OPT templates where MeZO has one (CB's for MNLI, RTE's question form for QNLI, BoolQ's
#: ``<passage> <question>?\n``) and the same "question + Yes or No?" form otherwise (QQP, MRPC). CoLA keeps LM-BFF's
#: ``<sentence> This is [MASK].`` without the final period. Every label word of every task, plain and chat, is one
#: SmolLM2 token (tested).
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



def get_task(name: str) -> PromptTask:
    """Looks up a built-in task.

    Args:
        name: A key of :data:`PROMPT_TASKS`.
    """
    key = re.sub(r"[^a-z0-9]", "", str(name).lower())
    if key not in PROMPT_TASKS:
        raise ConfigError(f"data.task must be one of {', '.join(PROMPT_TASKS)}; got {name!r}")
    return PROMPT_TASKS[key]
