"""Causal-LM and seq2seq data from local files: plain text, or prompt/response (instruction) pairs."""

from __future__ import annotations

import functools
from typing import Any

from torch.utils.data import DataLoader

from peftplug.data.base import TokenizedDataModule, pad_batch
from peftplug.data.files import RowErrors, check_val_fraction, no_room, read_splits, row_text
from peftplug.data.prompt_templates import special_prefix
from peftplug.errors import ConfigError, DataError


def prompt_ids(tokenizer: Any, text: str, prefix: list[int] | None = None) -> list[int]:
    """Token ids of a prompt (or plain text) as a causal LM reads it: the special tokens the tokenizer puts before a
    text (Llama's ``<s>``), then the text's own tokens, without an EOS the tokenizer appends.

    A tokenizer that appends EOS (a Llama/Mistral tokenizer with ``add_eos_token=True``, a BOS+EOS SentencePiece
    one) put that EOS between an instruction row's prompt and its response (``<s> prompt </s> response </s>``, and
    the generation prompt then ended in it), and a plain text ended in two EOS tokens.

    Args:
        tokenizer: The tokenizer.
        text: The prompt.
        prefix: :func:`peftplug.data.prompt_templates.special_prefix` of ``tokenizer`` when already known.
    """
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    return prefix + tokenizer(text, add_special_tokens=False)["input_ids"]


class CausalLMData(TokenizedDataModule):
    """Language-modelling data from local files: plain text, or prompt/response (instruction) pairs.

    For ``causal_lm`` the prompt and response are concatenated and only response tokens (plus EOS) carry loss;
    for ``seq2seq`` the prompt is the encoder input and the response the target. Plain text (``text_column``)
    trains on every token (causal LM only: a seq2seq model refuses it, as it would learn to copy its input).

    Args:
        train_file: Training file (JSON, JSONL, CSV, TSV or Parquet).
        validation_file: Validation file; if ``None``, ``val_fraction`` of the training file is held out.
        test_file: Optional held-out test file.
        text_column: Column of plain text; used when ``prompt_column`` is ``None``.
        prompt_column: Column of prompts (instruction data).
        response_column: Column of responses (instruction data).
        task: ``causal_lm`` or ``seq2seq``; default: the model's task, which a set value must equal.
        val_fraction: Fraction of the training file used for validation when there is no validation file.
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example (prompt + response for causal LMs).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the validation split and of the shuffling.
    """

    prompt_format = "plain"

    def __init__(
        self,
        train_file: str | None = None,
        validation_file: str | None = None,
        test_file: str | None = None,
        text_column: str = "text",
        prompt_column: str | None = None,
        response_column: str | None = None,
        task: str | None = None,
        val_fraction: float = 0.1,
        tokenizer: str | None = None,
        max_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer, max_length, batch_size, eval_batch_size, num_workers, seed)
        if (prompt_column is None) != (response_column is None):
            raise ConfigError("data.prompt_column and data.response_column must be set together")
        if task is not None and task not in ("causal_lm", "seq2seq"):
            raise ConfigError(f"data.task must be causal_lm or seq2seq; got {task!r}")
        check_val_fraction(val_fraction)
        self.files = {"train": train_file, "validation": validation_file, "test": test_file}
        self.text_column, self.prompt_column, self.response_column = text_column, prompt_column, response_column
        self.task = task
        self.val_fraction = val_fraction
        self.prompts: dict[str, list[str]] = {}
        self._prefix: list[int] | None = None  # the tokenizer's special_prefix, found once in setup

    def _encode(self, tokenizer: Any, task: str, prompt: str, response: str | None) -> dict[str, list[int]]:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if task == "seq2seq":
            source = tokenizer(prompt, truncation=True, max_length=self.max_length)["input_ids"]
            if not source:
                # An empty encoder input crashed T5's attention mid-run (a reshape of 0 elements), and beside other
                # rows it was all padding, so its loss depended on its batch. T5's own tokenizer gives "" its EOS.
                raise DataError("the prompt gives no tokens: a seq2seq model's encoder needs at least one input "
                                "token (this tokenizer adds none to an empty prompt); write a prompt")
            target = tokenizer(response, truncation=True, max_length=self.max_length)["input_ids"]
            if eos and (not target or target[-1] != eos[0]):
                # Generation stops at EOS, so targets must end in it (T5's tokenizer adds it, others may not).
                target = (target + eos)[-self.max_length:] if len(target) < self.max_length else target[:-1] + eos
            return {"input_ids": source, "attention_mask": [1] * len(source), "labels": target}
        if response is None:
            ids = (prompt_ids(tokenizer, prompt, self._prefix) + eos)[: self.max_length]
            return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}
        head = prompt_ids(tokenizer, prompt, self._prefix)
        tail = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
        if len(head) >= self.max_length:
            # Every loss token would be cut away: the row's loss is NaN (0/0) and every such step is skipped.
            # setup() skips such a training row with a warning and refuses a held-out one (RowErrors).
            raise no_room("the prompt", len(head), "the response", self.max_length)
        ids = (head + tail)[: self.max_length]
        labels = ([-100] * len(head) + tail)[: self.max_length]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes all configured splits (once).

        Args:
            stage: Lightning stage (unused: every split is prepared).
        """
        if self.splits:
            return
        tokenizer = self.resolve_tokenizer()
        self._prefix = special_prefix(tokenizer)
        model_task = getattr(self._module(), "task", None)
        if self.task is not None and model_task is not None and self.task != model_task:
            # Causal-LM rows (prompt + answer in input_ids) trained a seq2seq model to copy the answer its encoder
            # sees, silently; seq2seq rows crashed a causal LM with a traceback.
            raise ConfigError(f"data.task is {self.task!r} but model.task is {model_task!r}: set data.task to "
                              f"{model_task!r}, or leave it null to follow the model")
        task = self.task or model_task or "causal_lm"
        if task not in ("causal_lm", "seq2seq"):
            raise ConfigError(f"CausalLMData serves causal_lm or seq2seq models, not {task!r}")
        instruction = self.prompt_column is not None
        if task == "seq2seq" and not instruction:
            # The text was both the source and the target: a seq2seq model learnt to copy its input, silently.
            raise ConfigError("data.text_column (plain text) serves causal_lm models only; a seq2seq model needs "
                              "data.prompt_column (its encoder input) and data.response_column (its target)")
        columns = [self.prompt_column, self.response_column] if instruction else [self.text_column]
        raw = read_splits(self.files, columns, self.val_fraction, self.seed, text_columns=columns)
        for split, cols in raw.items():
            prompts, encoded = [], []
            errors = RowErrors(split, cols, skip_too_long=split == "train")
            for index, row in enumerate(zip(*(cols[c] for c in columns))):
                with errors.row(index):
                    # The rule ChatData applies to its rows: no missing text, no empty answer, an answer that fits.
                    if instruction:
                        prompt, response = row_text(row[0], "prompt", blank_ok=True), row_text(row[1], "response")
                    else:
                        prompt, response = row_text(row[0], "text"), None
                    encoded.append(self._encode(tokenizer, task, prompt, response))
                    prompts.append(prompt)
            errors.raise_if_any(kept=len(encoded), max_length=self.max_length)
            self.splits[split] = encoded
            self.prompts[split] = prompts
            if not self.splits[split]:
                raise DataError(f"the {split} split is empty")

    def predict_dataloader(self) -> DataLoader:
        """Prompts of the test (else validation) split, left-padded for generation."""
        split = "test" if "test" in self.splits else "validation"
        tokenizer = self.tokenizer
        left = (self.task or getattr(self._module(), "task", "causal_lm")) == "causal_lm"
        if left:  # the prompt as training read it (prompt_ids), cut as training cuts a plain text
            prefix = special_prefix(tokenizer)
            rows = [prompt_ids(tokenizer, p, prefix)[: self.max_length] for p in self.prompts[split]]
        else:  # the encoder input, as _encode reads it
            rows = [tokenizer(p, truncation=True, max_length=self.max_length)["input_ids"] for p in self.prompts[split]]
        encoded = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in rows]
        return DataLoader(encoded, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=functools.partial(pad_batch, pad_id=tokenizer.pad_token_id, left=left))
