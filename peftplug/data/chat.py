"""Chat finetuning data for causal LMs: conversations or prompt/response pairs rendered with the tokenizer's chat
template.

Two row formats, told apart by the training file's columns (no setting): a ``messages`` column of
``{role, content}`` turns, single- or multi-turn (or ShareGPT's ``conversations``; see
:mod:`peftplug.data.conversations` for what is accepted and refused), else ``prompt``/``response`` columns (a
one-exchange conversation). A recipe's ``system_prompt`` is the system turn of every conversation that has none of
its own: a file's system turn wins.

Loss is on the assistant's tokens only (every assistant turn with loss, each with its end-of-turn token); everything
else is masked with -100. When an example is longer than ``max_length`` whole earlier exchanges are dropped, oldest
first (the system turn kept), then the last **user turn** is cut (its end is dropped, token-exactly), never the
template or an answer; if even one token of it leaves no room for the answer, a training row is skipped (all such
rows counted in one warning, as TRL/Axolotl never stop a run for one long example) and a validation/test row is
refused with an error that names its file and row (a held-out metric must count every row of the file).

Validation and test batches also carry the left-padded prompts (``gen_input_ids``, ``gen_attention_mask``: the
conversation up to its last answer, ending with the assistant header) and the reference answers (``gen_answers``:
the last assistant turn), so that :class:`peftplug.lightning.PeftModule` can generate greedily and log answer
accuracy (:mod:`peftplug.answers`) next to the loss. A row that only pads the split to a multiple of the ranks
(DDP/FSDP2, :meth:`peftplug.data.base.TokenizedDataModule.padding_row`) has no loss and the answer ``None``, which
the accuracy skips.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from peftplug.data.base import TokenizedDataModule, mask_labels, pad_batch
from peftplug.data.chat_files import PAIRS, chat_format, read_chat_splits
from peftplug.data.classification import BBCNewsData
from peftplug.data.conversations import (
    Turn,
    encode_conversation,
    parse_conversation,
    template_pieces,
    with_system,
)
from peftplug.data.files import ROW_SOURCE, RowErrors, check_val_fraction, row_text
from peftplug.errors import ConfigError, DataError
from peftplug.model_checks import position_table, virtual_tokens

# Placeholders of the former single-exchange splitter, kept for scripts that imported them.
_USER, _ASSISTANT = "\x00PEFTPLUG_USER\x00", "\x00PEFTPLUG_ASSISTANT\x00"

GENERATION_KEYS = ("gen_input_ids", "gen_attention_mask", "gen_answers")


def _template_pieces(tokenizer: Any, system_prompt: str | None) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the template around the user text and after the assistant text: (head, middle, tail).

    ``head + user + middle`` is the generation prompt (it ends with the assistant header) and
    ``response + tail`` the assistant turn (``tail`` starts with the end-of-turn token).
    """
    roles = ("user", "assistant") if system_prompt is None else ("system", "user", "assistant")
    pieces = template_pieces(tokenizer, roles)
    head = pieces[0] if system_prompt is None else (
        pieces[0] + tokenizer(system_prompt, add_special_tokens=False)["input_ids"] + pieces[1])
    return head, pieces[-2], pieces[-1]


def encode_chat(tokenizer: Any, prompt: str, response: str | None, system_prompt: str | None,
                max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of one chat example: (prompt ids ending in the assistant header, answer ids).

    The answer ids are the response plus the template's tokens up to and including the end-of-turn token
    (``tokenizer.eos_token``; for ChatML ``<|im_end|>``). The user prompt is cut from its end so that
    ``len(prompt) + len(answer) <= max_length``.

    Args:
        tokenizer: A tokenizer with a chat template.
        prompt: The user message.
        response: The assistant's answer; ``None`` for a generation prompt (no answer, no cut for it).
        system_prompt: Optional system message (``None`` lets the template use its default, if any).
        max_length: Maximum tokens of prompt + answer.

    Raises:
        DataError: If the template and the answer alone exceed ``max_length``.
    """
    turns = with_system([Turn("user", str(prompt)), Turn("assistant", "" if response is None else str(response),
                                                         trained=True)], system_prompt)
    encoded = encode_conversation(tokenizer, turns, max_length, generation_only=response is None)
    return encoded.input_ids[: encoded.prompt_length], encoded.input_ids[encoded.prompt_length:]


def _pair_turns(prompt: Any, response: Any) -> list[Turn]:
    """A prompt/response row as a one-exchange conversation."""
    prompt, response = row_text(prompt, "prompt", blank_ok=True), row_text(response, "response")
    return [Turn("user", prompt), Turn("assistant", response, trained=True)]


class ChatData(TokenizedDataModule):
    """Conversations (a ``messages`` column) or prompt/response pairs from local files, rendered through the
    tokenizer's chat template.

    Args:
        train_file: Training data: a JSON, JSONL, CSV, TSV or Parquet file, or a folder written by
            ``datasets.Dataset.save_to_disk``. A ``messages`` column (else ShareGPT ``conversations``) makes every
            file a conversation file; otherwise the prompt and response columns are read.
        validation_file: Validation data, same format; if ``None``, ``val_fraction`` of the training data is held
            out.
        test_file: Optional held-out test data, same format.
        prompt_column: Column of user messages (prompt/response files).
        response_column: Column of assistant answers (prompt/response files; every row needs one).
        system_prompt: System message of every conversation without its own system turn (a file's system turn
            wins); ``None`` keeps the template's default (SmolLM2's adds a ~30-token one, so a short system message
            shortens every example).
        val_fraction: Fraction of the training data used for validation when there is no validation file.
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example; longer conversations lose earlier exchanges, then the end of the
            last user turn.
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the validation split and of the shuffling.
    """

    prompt_format = "chat"

    def __init__(
        self,
        train_file: str | None = None,
        validation_file: str | None = None,
        test_file: str | None = None,
        prompt_column: str = "prompt",
        response_column: str = "response",
        system_prompt: str | None = None,
        val_fraction: float = 0.1,
        tokenizer: str | None = None,
        max_length: int = 256,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer, max_length, batch_size, eval_batch_size, num_workers, seed)
        check_val_fraction(val_fraction)
        self.files = {"train": train_file, "validation": validation_file, "test": test_file}
        self.prompt_column, self.response_column = prompt_column, response_column
        self.system_prompt = system_prompt
        self.val_fraction = val_fraction
        self.dropped_turns: dict[str, int] = {}
        self.save_hyperparameters()  # the checkpoint keeps the chat format, so `peftplug generate` can reuse it

    @property
    def row_format(self) -> str:
        """``messages``, ``conversations`` (ShareGPT) or ``pairs`` (prompt/response), told by the training
        file's columns."""
        if not hasattr(self, "_row_format"):
            self._row_format = chat_format(self.files["train"])
        return self._row_format

    def load_pairs(self) -> dict[str, tuple[list, list]]:
        """The raw ``{split: (prompts, responses)}``; where each row came from is kept for error messages."""
        columns = [self.prompt_column, self.response_column]
        raw = read_chat_splits(self.files, columns, self.val_fraction, self.seed, text_columns=columns)
        self._row_sources = {split: {ROW_SOURCE: cols[ROW_SOURCE]} for split, cols in raw.items()}
        return {split: (cols[columns[0]], cols[columns[1]]) for split, cols in raw.items()}

    def load_rows(self) -> dict[str, list]:
        """The raw rows of every split: conversation values (``messages`` / ``conversations`` files) or
        ``(prompt, response)`` tuples; where each row came from is kept for error messages."""
        if self.row_format == PAIRS:
            return {split: list(zip(*pair)) for split, pair in self.load_pairs().items()}
        raw = read_chat_splits(self.files, [self.row_format], self.val_fraction, self.seed,
                               text_columns=[self.row_format])
        self._row_sources = {split: {ROW_SOURCE: cols[ROW_SOURCE]} for split, cols in raw.items()}
        return {split: cols[self.row_format] for split, cols in raw.items()}

    def row_turns(self, row: Any) -> list[Turn]:
        """One raw row as checked turns, the recipe's system prompt added where the row has no system turn.

        Args:
            row: From :meth:`load_rows`.

        Raises:
            DataError: For a malformed row (the message does not name the row; :meth:`setup` adds it).
        """
        turns = _pair_turns(*row) if self.row_format == PAIRS else parse_conversation(row, self.row_format)
        return with_system(turns, self.system_prompt)

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes all configured splits (once).

        Args:
            stage: Lightning stage (unused: every split is prepared).

        Raises:
            DataError: For a malformed row, a validation/test row that cannot fit ``max_length`` (naming its file
                and row), or a training split none of whose rows fits (a training row that does not fit is
                skipped with a warning).
        """
        if self.splits:
            return
        # Chat rows hold the answer in input_ids: a seq2seq model (T5) trained to copy it from its encoder input,
        # silently, until validation stopped in generate with a traceback.
        self.check_model_task("causal_lm", "for a seq2seq model peftplug.data.CausalLMData with prompt_column and "
                              "response_column, for a classification head peftplug.data.TextClassificationData")
        tokenizer = self.resolve_tokenizer()
        self._row_sources = {}
        for split, rows in self.load_rows().items():
            examples, dropped = [], 0
            sources = self._row_sources.get(split, {})
            errors = RowErrors(split, sources, skip_too_long=split == "train")
            for index, row in enumerate(rows):
                with errors.row(index):
                    encoded = encode_conversation(tokenizer, self.row_turns(row), self.max_length)
                    dropped += encoded.dropped_turns > 0
                    examples.append({"input_ids": encoded.input_ids,
                                     "attention_mask": [1] * len(encoded.input_ids), "labels": encoded.labels,
                                     "prompt_ids": encoded.input_ids[: encoded.prompt_length],
                                     "answer_text": encoded.answer_text})
            errors.raise_if_any(kept=len(examples), max_length=self.max_length)
            if not examples:
                raise DataError(f"the {split} split is empty")
            self.splits[split], self.dropped_turns[split] = examples, dropped
            if dropped:
                rank_zero_info(f"peftplug: {dropped} of {len(examples)} {split} conversations were longer than "
                               f"data.max_length={self.max_length}: their oldest exchanges were dropped")

    @property
    def answers(self) -> dict[str, list[str]]:
        """The reference answers of every prepared split (after ``setup``)."""
        return {split: [e["answer_text"] for e in examples] for split, examples in self.splits.items()}

    def padding_row(self, example: dict) -> dict:
        """A copy of ``example`` without loss (labels -100) and with the answer ``None``, which generation accuracy
        skips: it pads an evaluation split to a multiple of the ranks.

        Args:
            example: An example dict of the split.
        """
        return {**mask_labels(example), "answer_text": None}

    def collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        """Right-pads the examples' ``input_ids``, ``attention_mask`` and ``labels`` (the loss batch).

        Args:
            features: Example dicts from :attr:`splits`.
        """
        return pad_batch([{k: f[k] for k in ("input_ids", "attention_mask", "labels")} for f in features],
                         self.tokenizer.pad_token_id)

    def _eval_collate(self, features: list[dict]) -> dict[str, Any]:
        """Right-padded examples for the loss plus left-padded prompts and reference answers for generation."""
        batch: dict[str, Any] = self.collate(features)
        prompts = pad_batch([{"input_ids": f["prompt_ids"], "attention_mask": [1] * len(f["prompt_ids"])}
                             for f in features], self.tokenizer.pad_token_id, left=True)
        batch["gen_input_ids"], batch["gen_attention_mask"] = prompts["input_ids"], prompts["attention_mask"]
        batch["gen_answers"] = [f["answer_text"] for f in features]
        return batch

    def _check_positions(self, split: str) -> None:
        """Also refuses evaluation prompts that leave no room for ``model.max_new_tokens`` in a learned position
        table: validation generates every answer after its prompt, and past GPT-2's 1024 positions that stopped the
        first long batch with ``IndexError: index out of range in self`` in ``generate``. The training loader checks
        the validation split too, so that a run that will validate is refused before it trains.

        Args:
            split: The split about to be loaded.
        """
        super()._check_positions(split)
        trainer = getattr(self, "trainer", None)
        validates = trainer is not None and getattr(trainer, "limit_val_batches", 0) not in (0, 0.0)
        for evaluated in ([split] if split != "train" else ["validation"] if validates else []):
            self._check_generation_room(evaluated)

    def _check_generation_room(self, split: str) -> None:
        module = self._module()
        model = getattr(module, "model", None)
        max_new = getattr(getattr(module, "hparams", None), "max_new_tokens", None)
        if (not isinstance(model, torch.nn.Module) or not isinstance(max_new, int) or not self.splits.get(split)
                or getattr(module, "tokenizer", None) is None):  # no tokenizer: validation generates nothing
            return
        table = position_table(model)
        if table is None:  # rotary or relative positions
            return
        (name, limit), virtual = table, virtual_tokens(model)
        longest = max(len(example["prompt_ids"]) for example in self.splits[split])
        if virtual + longest + max_new <= limit:
            return
        fixes = [f"data.max_length to {limit - virtual - max_new}"] if limit - virtual - max_new > 0 else []
        if limit - virtual - longest > 0:
            fixes.append(f"model.max_new_tokens to {limit - virtual - longest}")
        raise DataError(
            f"the {split} split has prompts of {longest} tokens{f' + {virtual} virtual' if virtual else ''} and "
            f"evaluation generates model.max_new_tokens={max_new} after each, but the model's learned position "
            f"table ({name}) holds {limit} positions: lower {' or '.join(fixes) or 'data.max_length'}"
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches, with generation prompts and answers."""
        return self.loader("validation", shuffle=False, collate=self._eval_collate)

    def test_dataloader(self) -> DataLoader:
        """Held-out test batches (the validation split when no test data is configured)."""
        split = "test" if "test" in self.splits else "validation"
        return self.loader(split, shuffle=False, collate=self._eval_collate)


class BBCNewsChatData(ChatData):
    """BBC News topic answering as chat: the user gives the article's start, the assistant answers the topic.

    The articles and the test/validation/train split are exactly
    :class:`peftplug.data.classification.BBCNewsData`'s (same ``seed``, sizes and order), so accuracies are
    comparable with the classifier recipes. The user message is ``prompt_template`` filled with the first
    ``n_words`` words of the article (its title comes first); the answer is the topic name (``business``,
    ``entertainment``, ``politics``, ``sports``, ``tech``).

    Args:
        n_train: Training articles.
        n_val: Validation articles.
        n_test: Held-out test articles.
        seed: Seed of the split (and of the shuffling).
        n_words: Words of each article shown to the model.
        prompt_template: User message; ``{text}`` is replaced by the article's first words.
        system_prompt: System message (``None`` keeps the template's default).
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example (the article is cut first).
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        n_train: int = 400,
        n_val: int = 50,
        n_test: int = 100,
        seed: int = 0,
        n_words: int = 40,
        prompt_template: str = "Topic of this article (business, entertainment, politics, sports, tech)?\n\n{text}",
        system_prompt: str | None = "Answer with one word.",
        tokenizer: str | None = None,
        max_length: int = 128,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(system_prompt=system_prompt, tokenizer=tokenizer, max_length=max_length,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        if "{text}" not in prompt_template:
            raise ConfigError("data.prompt_template must contain the slot {text}")
        if n_words < 1:
            raise ConfigError(f"data.n_words must be >= 1; got {n_words}")
        self.split_source = BBCNewsData(n_train=n_train, n_val=n_val, n_test=n_test, seed=seed)
        self.n_words, self.prompt_template = n_words, prompt_template

    def article_prompt(self, text: str) -> str:
        """The user message for an article.

        Args:
            text: The article (title first).
        """
        return self.prompt_template.replace("{text}", " ".join(str(text).split()[: self.n_words]))

    def load_pairs(self) -> dict[str, tuple[list, list]]:
        """The fixed split as ``{split: (user messages, topic names)}``."""
        raw = self.split_source.load_raw()
        topics = self.split_source.label_names
        return {split: ([self.article_prompt(t) for t in cols["text"]], [topics[i] for i in cols["label"]])
                for split, cols in raw.items()}
