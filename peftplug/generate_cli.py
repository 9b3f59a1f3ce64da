"""``peftplug generate`` and ``peftplug chat``: answer prompts with a finetuned adapter (or a bare model).

Examples::

    peftplug generate --ckpt_path runs/quickstart/.../last.ckpt --prompt "Topic of this article ...?"
    peftplug generate --model smollm2-135m-instruct --prompt "What is the capital of France?"
    peftplug chat --ckpt_path runs/quickstart/.../last.ckpt

Prompts go through the tokenizer's chat template (``--raw`` sends them as plain text), except for a checkpoint
trained on plain prompt/response rows (``CausalLMData``, recorded in the checkpoint), whose prompts are plain text
as in training. The system prompt defaults
to the one the checkpoint was trained with (recorded by :class:`peftplug.chat_data.ChatData`), so a finetuned
model sees its prompts exactly as in training. Decoding is greedy unless ``--temperature`` is above 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from peftplug.errors import ConfigError
from peftplug.flags import underscore_flags

_EXIT_WORDS = {"exit", "quit", "/exit", "/quit"}


def _parser(prog: str, chat: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Chat interactively" if chat else "Answer prompts") + " with a peftplug checkpoint or a model.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt_path", help="checkpoint written by `peftplug fit` (adapter on its base model)")
    source.add_argument("--model", help="a model name (e.g. smollm2-135m-instruct), no adapter")
    if not chat:
        parser.add_argument("--prompt", action="append", required=True,
                            help="a user message; repeat for several (answered as one batch)")
        parser.add_argument("--raw", action="store_true", help="send prompts as plain text, without chat template")
    parser.add_argument("--system", default=None,
                        help="system prompt (default: the checkpoint's training one, else the template's)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling")
    return underscore_flags(parser)


class Generator:
    """A model (with its adapter, if any) and tokenizer that answer chat messages.

    Args:
        ckpt_path: A ``peftplug fit`` checkpoint; its base model is reloaded by name and its adapter applied.
        model: A model name, used without an adapter when ``ckpt_path`` is ``None``.
        system: System prompt; ``None`` takes the checkpoint's training system prompt, if it recorded one.
    """

    def __init__(self, ckpt_path: str | None = None, model: str | None = None, system: str | None = None) -> None:
        from peftplug.lightning import CHECKPOINT_KEY, PeftModule
        from peftplug.parameter_report import for_generation

        self.plain = False
        if (ckpt_path is None) == (model is None):
            raise ConfigError("give exactly one of ckpt_path and model")
        if ckpt_path is not None:
            from peftplug.checkpoints import load_checkpoint_module, read_checkpoint

            checkpoint = read_checkpoint(ckpt_path, mmap=True)
            data_hparams = checkpoint.get("datamodule_hyper_parameters") or {}
            # Trained on plain prompt/response rows (CausalLMData): prompt it with plain text too, not the template.
            self.plain = (checkpoint.get(CHECKPOINT_KEY) or {}).get("prompts") == "plain"
            task = (checkpoint.get("hyper_parameters") or {}).get("task", "causal_lm")
            if task == "seq2seq":  # an encoder-decoder answers through its own generate, which predict runs
                raise ConfigError(
                    f"checkpoint {str(ckpt_path)!r} is a seq2seq (encoder-decoder) model; generate and chat need a "
                    f"causal_lm checkpoint; generate its answers with `peftplug predict --config <its recipe> "
                    f"--ckpt_path {ckpt_path}` (the prompts of its data's test, else validation, split)")
            if task != "causal_lm":  # said before the base model loads, and with what classifies instead
                raise ConfigError(
                    f"checkpoint {str(ckpt_path)!r} is a {task} model: it gives class ids, not text, and generate "
                    f"and chat need a causal_lm checkpoint; classify with `peftplug predict --config <its recipe> "
                    f"--ckpt_path {ckpt_path}` (or `peftplug test`, for accuracy on the held-out split)")
            with for_generation():  # its parameter line says what answers, not what would train
                self.module = load_checkpoint_module(ckpt_path)
            if system is None:
                system = data_hparams.get("system_prompt")
        else:
            with for_generation():
                self.module = PeftModule(model, task="causal_lm")
        if self.module.task != "causal_lm" or self.module.tokenizer is None:
            raise ConfigError(f"generate needs a causal language model with a tokenizer; got task {self.module.task!r}")
        self.module.eval()
        self.tokenizer = self.module.tokenizer
        self.system = system

    def encode(self, messages: list[dict[str, str]], raw: bool = False) -> list[int]:
        """Token ids of a conversation ending in the assistant's turn (or of raw text).

        The chat template is applied by the encoder training uses (:func:`peftplug.data.conversations.
        encode_conversation`), so a prompt is the very token sequence a trained prompt was: context contents
        tokenized with the template's text before them and trimmed where the template trims. A template that encoder
        cannot split, or that rewrites a content (training refuses both), is rendered and tokenized whole.

        Args:
            messages: ``[{"role": "user" | "assistant", "content": ...}, ...]`` without the system message.
            raw: Treat the last message's content as plain text (no template, no history); always so for a
                checkpoint trained on plain prompts.

        Raises:
            ConfigError: If the tokenizer has no chat template, or the template refuses the conversation.
        """
        from peftplug.data.conversations import Turn, encode_conversation, with_system
        from peftplug.errors import DataError

        if raw or self.plain:
            from peftplug.data.causal_lm import prompt_ids

            # As CausalLMData reads a prompt: no EOS that a BOS+EOS tokenizer would append before the answer.
            return prompt_ids(self.tokenizer, messages[-1]["content"])
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; use --raw")
        # The answer's turn is a stand-in: generation_only encodes up to its start (the assistant header).
        turns = with_system([Turn(m["role"], m["content"]) for m in messages] + [Turn("assistant", "", True)],
                            self.system)
        try:
            return encode_conversation(self.tokenizer, turns, sys.maxsize, generation_only=True).input_ids
        except DataError as err:  # the template's own refusal, e.g. a system turn Gemma's template does not take
            raise ConfigError(str(err)) from None
        except ConfigError:
            pass
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        text = self.tokenizer.apply_chat_template(system + messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> list[str]:
        """Answers a batch of encoded prompts (left-padded together), each up to its end-of-turn token.

        Args:
            prompts: Token id lists from :meth:`encode`.
            max_new_tokens: Tokens to generate at most.
            temperature: 0 for greedy decoding; above 0, sampling at this temperature.
            seed: Seed of the sampling.
        """
        import torch

        from peftplug.data.base import pad_batch

        check_sampling(max_new_tokens, temperature)
        empty = [i for i, p in enumerate(prompts, 1) if not p]
        if empty:  # generate cannot start from nothing (a tokenizer without BOS turns "" into no tokens)
            raise ConfigError(f"prompt {empty[0]} gives no tokens: an empty prompt sent as plain text; write some text")
        self.check_positions(max(len(p) for p in prompts), max_new_tokens)
        batch = pad_batch([{"input_ids": p, "attention_mask": [1] * len(p)} for p in prompts],
                          self.tokenizer.pad_token_id, left=True)
        torch.manual_seed(seed)  # only sampling draws from it
        with torch.inference_mode():
            return self.module.generate_texts(batch["input_ids"], batch["attention_mask"], max_new_tokens,
                                              temperature=temperature)

    def check_positions(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuses a prompt that, with the tokens to generate, runs past the model's position table (an
        ``IndexError`` deep in the embedding otherwise).

        Args:
            prompt_tokens: Tokens of the longest prompt of the batch.
            max_new_tokens: Tokens to generate at most.

        Raises:
            PositionError: (:mod:`peftplug.model_checks`) Naming both lengths and the limit.
        """
        from peftplug.model_checks import check_generation_positions

        check_generation_positions(self.module.model, prompt_tokens, max_new_tokens, "--max_new_tokens")


# The smallest sampling temperature: below it, logits / temperature overflow fp32 to inf and torch's multinomial
# raised "probability tensor contains either inf, nan" mid-generation (vLLM treats < 1e-5 as greedy likewise).
MIN_TEMPERATURE = 1e-5


def check_sampling(max_new_tokens: int, temperature: float) -> None:
    """Raises ``ConfigError`` unless ``max_new_tokens >= 1`` and ``temperature`` is 0 or finite and at least
    :data:`MIN_TEMPERATURE`.

    Args:
        max_new_tokens: ``--max_new_tokens``.
        temperature: ``--temperature``.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1; got {max_new_tokens}")
    # nan passed "< 0" and decoded greedily; inf sampled uniformly from the whole vocabulary (logits / inf = 0).
    if temperature != 0 and not MIN_TEMPERATURE <= temperature < math.inf:
        raise ConfigError(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (sampling); "
                          f"got {temperature}")


def generate_main(argv: Sequence[str]) -> int:
    """``peftplug generate``: prints one answer per ``--prompt`` (one line each, newlines escaped).

    Args:
        argv: Arguments after ``generate``.
    """
    args = _parser("peftplug generate", chat=False).parse_args(list(argv))
    check_sampling(args.max_new_tokens, args.temperature)
    generator = Generator(args.ckpt_path, args.model, args.system)
    prompts = [generator.encode([{"role": "user", "content": p}], raw=args.raw) for p in args.prompt]
    for text in generator.answer(prompts, args.max_new_tokens, args.temperature, args.seed):
        print(text.strip().replace("\n", "\\n"), flush=True)
    return 0


def chat_loop(generator: Generator, max_new_tokens: int, temperature: float, stdin: TextIO,
              stdout: TextIO, seed: int = 0) -> None:
    """Reads user messages line by line and prints the assistant's answers, keeping the conversation.

    When the conversation outgrows the model's position table, its oldest exchanges are dropped (and the session
    says how many) until the new message fits; a message too long by itself is refused, and the session goes on.
    Ctrl-C while an answer is generated drops that message (the session goes on); Ctrl-C at the prompt ends the
    session, as Ctrl-D does.

    Args:
        generator: The model to chat with.
        max_new_tokens: Tokens per answer at most.
        temperature: 0 for greedy decoding.
        stdin: Where messages come from (one per line; ``exit``/``quit`` or end of input stops).
        stdout: Where prompts and answers go.
        seed: Seed of the sampling (``--seed``), set before every answer.
    """
    # Imported here: model_checks imports torch, which `peftplug chat --help` should not wait for.
    from peftplug.model_checks import PositionError

    history: list[dict[str, Any]] = []
    while True:
        stdout.write("you> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the usual way out of a terminal program; was a traceback
            line = ""
        if not line or line.strip().lower() in _EXIT_WORDS:
            stdout.write("\n")
            return
        if not line.strip():
            continue
        earlier = list(history)
        history.append({"role": "user", "content": line.strip()})
        dropped = 0
        while True:
            try:
                text = generator.answer([generator.encode(history)], max_new_tokens, temperature, seed)[0].strip()
                break
            except PositionError as err:
                if len(history) > 1:  # forget the oldest exchange (a user turn and its answer), not the new message
                    del history[:2]
                    dropped += 1
                    continue
                failure = str(err)
            except ConfigError as err:
                failure = str(err)
            except KeyboardInterrupt:  # Ctrl-C on a long answer: stop it, not the session (was a traceback)
                stdout.write("\n")
                failure = "answer interrupted (Ctrl-C); the conversation goes on without that message"
            history = earlier  # keep the session as it was, without the message that could not be answered
            stdout.write(f"peftplug: {failure}\n")
            stdout.flush()
            text = None
            break
        if text is None:
            continue
        if dropped:
            stdout.write(f"peftplug: the conversation outgrew the model's positions; forgot its oldest {dropped} "
                         f"exchange{'s' if dropped > 1 else ''}\n")
        history.append({"role": "assistant", "content": text})
        stdout.write(f"model> {text}\n")
        stdout.flush()


def chat_main(argv: Sequence[str]) -> int:
    """``peftplug chat``: an interactive conversation on standard input/output.

    Args:
        argv: Arguments after ``chat``.
    """
    args = _parser("peftplug chat", chat=True).parse_args(list(argv))
    check_sampling(args.max_new_tokens, args.temperature)  # before the model loads, not at the first message
    generator = Generator(args.ckpt_path, args.model, args.system)
    print("peftplug chat: type a message; 'exit', Ctrl-D or Ctrl-C ends.", flush=True)
    if generator.plain:  # encode() sends the last message alone: say so, rather than seem to keep the conversation
        print("peftplug chat: this checkpoint was trained on plain prompt/response rows, without a chat template: "
              "each message is answered on its own, without the conversation before it.", flush=True)
    chat_loop(generator, args.max_new_tokens, args.temperature, sys.stdin, sys.stdout, args.seed)
    return 0
