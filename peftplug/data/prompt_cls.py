""":class:`PromptClassificationData`: the k-shot tasks of :mod:`peftplug.data.prompt_tasks` posed as prompts for a
causal LM; its batches carry ``label_word_ids`` next to ``input_ids``/``attention_mask``/``labels``, so that
:class:`peftplug.lightning.PeftModule` with ``task="prompt_cls"`` needs nothing else.
"""

from __future__ import annotations

import torch

from peftplug.data.base import TokenizedDataModule, pad_batch
from peftplug.data.kshot import kshot_files, split_rows
from peftplug.data.lmbff import hub_source, hub_split_rows
from peftplug.data.prompt_tasks import get_task
from peftplug.data.prompt_templates import (
    ANSWER,
    FORMATS,
    MULTI_TOKEN_POLICIES,
    answer_context,
    label_word_ids,
    render_prompt,
    split_template,
    template_fields,
)
from peftplug.datadir import default_data_dir
from peftplug.errors import ConfigError
from peftplug.validation import check_int

#: Where the k-shot splits come from: LM-BFF's files in a local folder, or the hub copy sampled the same way.
SOURCES = ("folder", "hub")


class PromptClassificationData(TokenizedDataModule):
    """LM-BFF/MeZO k-shot classification posed as prompts for a causal LM (use with ``task: prompt_cls``).

    Train and validation are the split's ``train`` and ``dev`` files (k per class each); test is the task's test
    file (≤ 1000 examples), optionally subsampled to ``max_test`` examples with a fixed seed, the same subset for
    every split seed. Batches are left-padded and carry ``label_word_ids``.

    Args:
        task: A key of :data:`peftplug.data.prompt_tasks.PROMPT_TASKS` (``sst2``, ``rte``, ``cr``, ``subj``, ``trec``,
            ``mnli``, ``qnli``, ``qqp``, ``mrpc``, ``cola``, ``boolq``; BoolQ draws its splits from SuperGLUE val per
            ``split_seed``).
        data_dir: Directory holding ``k-shot/``; ``None``: :func:`peftplug.datadir.default_data_dir` (the shared data,
            ``$PEFTPLUG_DATA_DIR`` if set). Read with ``source="folder"`` only.
        source: ``folder``: LM-BFF's k-shot files under ``data_dir`` (offline); ``hub``: the task's Hugging Face hub
            copy (:data:`peftplug.data.lmbff.HUB_SOURCES`, read through ``datasets`` and its cache), sampled at
            ``setup`` with LM-BFF's procedure for any ``k`` and ``split_seed``.
        k: Shots per class.
        split_seed: Seed of the k-shot split (13, 21, 42, ...).
        format: ``plain`` (template as text) or ``chat`` (template as the user turn of the chat template).
        template: Override of the task's template (must end with ``{answer}``).
        label_words: Override of the label words, in class order.
        multi_token: ``error`` or ``first``, see :func:`peftplug.data.prompt_templates.label_word_ids`.
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
        data_dir: str | None = None,
        source: str = "folder",
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
        try:
            check_int("data.k", k, 1, hint="shots per class")
            check_int("data.split_seed", split_seed, 0, 2 ** 32 - 1, hint="numpy's seed range")
        except ValueError as err:
            raise ConfigError(str(err)) from None
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
        if source not in SOURCES:
            raise ConfigError(f"data.source must be one of {', '.join(SOURCES)}; got {source!r}")
        if source == "hub":  # fail now for a task without a hub copy; the rows are read at setup
            hub_source(self.task.name)
            self.files = None
        else:
            data_dir = default_data_dir() if data_dir is None else data_dir
            self.files = kshot_files(data_dir, self.task.name, k, split_seed)
        self.source = source
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
        self.check_model_task("prompt_cls", "for a classification head (seq_cls) use "
                              "peftplug.data.TextClassificationData")
        # Rows first: a missing file or an unreachable hub is reported before any tokenizer is loaded.
        rows_by_split = (hub_split_rows(self.task.name, self.k, self.split_seed, self.max_test)
                         if self.source == "hub"
                         else split_rows(self.task.name, self.files, self.k, self.split_seed, self.max_test))
        tokenizer = self.resolve_tokenizer()
        _, space = split_template(self.template)
        plain = self.format == "plain"
        self.label_word_ids = label_word_ids(tokenizer, self.words, space and plain, self.multi_token,
                                             context=answer_context(self.template) if plain else "")
        for split, rows in rows_by_split.items():
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

    def collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Left-pads the prompts (the answer position is then the last one) and adds ``label_word_ids``.

        Args:
            features: Example dicts from :attr:`splits`.
        """
        batch = pad_batch(features, self.tokenizer.pad_token_id, left=True)
        batch["label_word_ids"] = torch.tensor(self.label_word_ids, dtype=torch.long)
        return batch
