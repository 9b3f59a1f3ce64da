"""Chat finetuning data for causal LMs: prompt/response pairs rendered with the tokenizer's chat template.

Each example is ``[system] + user prompt + assistant response`` rendered by the tokenizer's own chat template.
Loss is on the assistant's tokens only (the response and the end-of-turn token); everything before it is
masked with -100. When an example is longer than ``max_length`` the **user prompt** is cut (its end is dropped,
token-exactly), never the template or the answer; if even an empty prompt leaves no room for the answer, the row
is refused with an error that names it.

Validation and test batches also carry the left-padded prompts (``gen_input_ids``, ``gen_attention_mask``) and
the reference answers (``gen_answers``), so that :class:`peftplug.lightning.PeftModule` can generate greedily and
log answer accuracy (:mod:`peftplug.answers`) next to the loss.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import DataLoader

from peftplug.data.base import TokenizedDataModule, pad_batch
from peftplug.data.classification import BBCNewsData
from peftplug.data.files import ROW_SOURCE, check_val_fraction, read_splits, row_name
from peftplug.errors import ConfigError, DataError

# Placeholders rendered through the chat template and then split on: the text between them is the template's.
_USER, _ASSISTANT = "\x00PEFTPLUG_USER\x00", "\x00PEFTPLUG_ASSISTANT\x00"

GENERATION_KEYS = ("gen_input_ids", "gen_attention_mask", "gen_answers")


@functools.lru_cache(maxsize=32)
def _template_pieces(tokenizer: Any, system_prompt: str | None) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the template around the user text and after the assistant text: (head, middle, tail).

    ``head + user + middle`` is the generation prompt (it ends with the assistant header) and
    ``response + tail`` the assistant turn (``tail`` starts with the end-of-turn token).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data: the tokenizer has no chat template; use CausalLMData for plain prompt/response text"
        )
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + [
        {"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    head, _, rest = full.partition(_USER)
    middle, _, tail = rest.partition(_ASSISTANT)
    if not prompt.startswith(head) or prompt[len(head):] != _USER + middle:
        # Templates that render the prompt differently with and without the answer cannot be split exactly.
        raise ConfigError("data: the chat template renders the prompt differently with and without the answer")

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return ids(head), ids(middle), ids(tail)


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
    head, middle, tail = _template_pieces(tokenizer, system_prompt)
    answer: list[int] = []
    if response is not None:
        answer = tokenizer(str(response), add_special_tokens=False)["input_ids"] + tail
        eos = tokenizer.eos_token_id
        if eos in tail:
            # Keep the turn up to its end token: what follows (a newline) is never generated.
            answer = answer[: len(answer) - len(tail) + tail.index(eos) + 1]
    user = tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
    room = max_length - len(head) - len(middle) - len(answer)
    if room < 1:
        raise DataError(
            f"the chat template and the answer take {max_length - room} tokens, leaving no room for the prompt "
            f"within max_length={max_length}"
        )
    return head + user[:room] + middle, answer


class ChatData(TokenizedDataModule):
    """Prompt/response pairs from local files, rendered through the tokenizer's chat template.

    Args:
        train_file: Training file (JSON, JSONL, CSV, TSV or Parquet).
        validation_file: Validation file; if ``None``, ``val_fraction`` of the training file is held out.
        test_file: Optional held-out test file.
        prompt_column: Column of user messages.
        response_column: Column of assistant answers (every row needs one).
        system_prompt: System message for every example; ``None`` keeps the template's default (SmolLM2's
            adds a ~30-token one, so a short system message shortens every example).
        val_fraction: Fraction of the training file used for validation when there is no validation file.
        tokenizer: Tokenizer name/path; defaults to the model's.
        max_length: Maximum tokens per example; longer user prompts are cut at the end.
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default: ``batch_size``).
        num_workers: DataLoader workers.
        seed: Seed of the validation split and of the shuffling.
    """

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
        self.save_hyperparameters()  # the checkpoint keeps the chat format, so `peftplug generate` can reuse it

    def load_pairs(self) -> dict[str, tuple[list, list]]:
        """The raw ``{split: (prompts, responses)}``; where each row came from is kept for error messages."""
        columns = [self.prompt_column, self.response_column]
        raw = read_splits(self.files, columns, self.val_fraction, self.seed)
        self._row_sources = {split: {ROW_SOURCE: cols[ROW_SOURCE]} for split, cols in raw.items()}
        return {split: (cols[columns[0]], cols[columns[1]]) for split, cols in raw.items()}

    def setup(self, stage: str | None = None) -> None:
        """Reads and tokenizes all configured splits (once).

        Args:
            stage: Lightning stage (unused: every split is prepared).

        Raises:
            DataError: For a row without a prompt or response, or one that cannot fit ``max_length``.
        """
        if self.splits:
            return
        tokenizer = self.resolve_tokenizer()
        self._row_sources = {}
        for split, (prompts, responses) in self.load_pairs().items():
            examples = []
            sources = self._row_sources.get(split, {})
            for row, (prompt, response) in enumerate(zip(prompts, responses)):
                if prompt is None or response is None or not str(response).strip():
                    side = "prompt" if prompt is None else "response"
                    raise DataError(f"{row_name(split, sources, row)}: the {side} is empty")
                try:
                    head, answer = encode_chat(tokenizer, prompt, response, self.system_prompt, self.max_length)
                except DataError as err:
                    raise DataError(f"{row_name(split, sources, row)}: {err}") from None
                examples.append({"input_ids": head + answer, "attention_mask": [1] * (len(head) + len(answer)),
                                 "labels": [-100] * len(head) + answer, "prompt_ids": head,
                                 "answer_text": str(response).strip()})
            if not examples:
                raise DataError(f"the {split} split is empty")
            self.splits[split] = examples

    @property
    def answers(self) -> dict[str, list[str]]:
        """The reference answers of every prepared split (after ``setup``)."""
        return {split: [e["answer_text"] for e in examples] for split, examples in self.splits.items()}

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
