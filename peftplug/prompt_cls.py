"""Prompt-based classification for causal LMs: split into the task catalogue (:mod:`peftplug.data.prompt_tasks`),
templates and label words (:mod:`peftplug.data.prompt_templates`), k-shot loading (:mod:`peftplug.data.kshot`),
the data module (:mod:`peftplug.data.prompt_cls`) and the scoring (:mod:`peftplug.prompt_scoring`).

This module keeps the old import path (``peftplug.prompt_cls.PromptClassificationData`` in recipes and saved
configs, the helpers benchmarks import) resolving to the same objects.
"""

from peftplug.data.base import TokenizedDataModule as _TokenizedDataModule  # noqa: F401
from peftplug.data.base import pad_batch  # noqa: F401
from peftplug.data.kshot import _read_jsonl, _read_rows, kshot_files, sample_pool_splits, split_rows  # noqa: F401
from peftplug.data.prompt_cls import PromptClassificationData
from peftplug.data.prompt_tasks import PROMPT_TASKS, PromptTask, PromptTemplate, get_task
from peftplug.data.prompt_templates import (
    ANSWER,
    FORMATS,
    MULTI_TOKEN_POLICIES,
    label_word_ids,
    render_prompt,
    split_template,
    template_fields,
)
from peftplug.prompt_scoring import (  # noqa: F401
    PromptClsOutput,
    _is_prompt_learning,
    label_word_logits,
    predict_labels,
    prompt_cls_forward,
)

__all__ = [
    "ANSWER", "FORMATS", "MULTI_TOKEN_POLICIES", "PROMPT_TASKS", "PromptClassificationData", "PromptClsOutput",
    "PromptTask", "PromptTemplate", "get_task", "kshot_files", "label_word_ids", "label_word_logits",
    "predict_labels", "prompt_cls_forward", "render_prompt", "sample_pool_splits", "split_rows", "split_template",
    "template_fields",
]
