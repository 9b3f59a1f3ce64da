"""``peftplug generate`` / ``chat`` with a prompt longer than the model's learned position table (GPT-2's ``wpe``):
refused in one line naming the lengths, instead of an ``IndexError`` from the embedding; a chat session says so and
goes on without that message."""

from __future__ import annotations

import io

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest

from peftplug.cli import main
from peftplug.errors import ConfigError
from peftplug.generate_cli import Generator, chat_loop


def test_generate_refuses_a_prompt_past_the_position_table(capsys):
    # tiny:gpt2 has n_positions 256 and a character-level tokenizer: 300 characters are 300 tokens.
    assert main(["generate", "--model", "tiny:gpt2", "--raw", "--prompt", "a" * 300, "--max_new_tokens", "3"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert lines == [("peftplug: error: the prompt is 300 tokens and --max_new_tokens 3, but the model has 256 "
                      "positions: shorten the prompt or lower --max_new_tokens")], err
    assert "Traceback" not in err
    assert main(["generate", "--model", "tiny:gpt2", "--raw", "--prompt", "a" * 200, "--max_new_tokens", "3"]) == 0


def test_chat_reports_a_too_long_message_and_goes_on():
    generator = Generator(model="tiny:gpt2")
    generator.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = io.StringIO()
    chat_loop(generator, 3, 0.0, io.StringIO("a" * 300 + "\nhi\nexit\n"), out)
    text = out.getvalue()
    assert "peftplug: the prompt is 300 tokens and --max_new_tokens 3, but the model has 256 positions" in text
    assert text.count("model> ") == 1


def test_the_position_check_counts_a_prompt_learning_adapters_virtual_tokens():
    # Prompt tuning puts its 20 virtual tokens before the prompt: 220 + 30 fits 256 positions, 20 + 220 + 30 not.
    from peft import PromptTuningConfig, get_peft_model

    generator = Generator(model="tiny:gpt2")
    generator.module.model = get_peft_model(generator.module.model,
                                            PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=20))
    generator.check_positions(200, 30)
    with pytest.raises(ConfigError, match="the prompt is 220 tokens after the adapter's 20 virtual tokens and "
                                          "--max_new_tokens 30, but the model has 256 positions"):
        generator.check_positions(220, 30)
