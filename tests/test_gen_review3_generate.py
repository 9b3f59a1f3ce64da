"""Third review of ``peftplug generate`` / ``chat``: the parameter line says what answers (a bare model printed
"trainable parameters 86,976 of 86,976 (100.000%)", claiming a full finetuning), and a temperature that is nan, inf
or so small that logits / temperature overflow is one line instead of silent greedy decoding, uniform sampling or
torch's "probability tensor contains either inf, nan" traceback."""

from __future__ import annotations

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest

from peftplug.cli import main
from peftplug.generate_cli import Generator


def _parameter_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "parameters" in line and line.startswith("peftplug: ")]


def test_a_bare_model_generates_as_it_is_not_as_a_full_finetuning(info_lines):
    from peftplug.lightning import PeftModule

    generator = Generator(model="tiny:llama")
    total = sum(p.numel() for p in generator.module.model.parameters())
    assert _parameter_lines(info_lines) == [
        f"peftplug: generating with the model as it is ({total:,} parameters, no adapter)"]
    info_lines.clear()
    PeftModule("tiny:llama")  # built for training (fit), full finetuning: the count of what trains, as before
    assert _parameter_lines(info_lines) == [f"peftplug: trainable parameters {total:,} of {total:,} (100.000%)"]


def test_a_checkpoint_generates_with_its_adapter_on_its_base(tmp_path, info_lines, capsys):
    from tests.tiny_recipes import one_step_lora_checkpoint

    ckpt = one_step_lora_checkpoint(tmp_path)
    info_lines.clear()
    generator = Generator(ckpt_path=str(ckpt))
    model = generator.module.model
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    # LoRA r=2 on q_proj: A (2 x hidden) and B (hidden x 2) in each layer.
    config = model.get_base_model().config
    assert adapter == config.num_hidden_layers * 2 * (2 * config.hidden_size)
    assert _parameter_lines(info_lines) == [
        f"peftplug: generating with the adapter ({adapter:,} parameters) on its base model ({base:,} parameters)"]
    assert not any("trainable" in line for line in info_lines)


@pytest.mark.parametrize("temperature", ["nan", "inf", "-inf", "1e-40", "1e-6", "-0.5"])
def test_a_temperature_sampling_cannot_use_is_one_line(temperature, capsys):
    for command in (["generate", "--prompt", "hi"], ["chat"]):
        assert main([command[0], "--model", "tiny:llama", *command[1:], "--max_new_tokens", "2",
                     f"--temperature={temperature}"]) == 2  # "=": argparse reads "-inf" as a flag
        err = capsys.readouterr().err
        assert (f"peftplug: error: --temperature must be 0 (greedy) or a finite number >= 1e-05 (sampling); "
                f"got {float(temperature)}") in err
        assert "Traceback" not in err


def test_the_smallest_accepted_temperature_samples_the_greedy_tokens():
    generator = Generator(model="tiny:llama")
    prompts = [generator.encode([{"role": "user", "content": p}]) for p in ("hi", "Name a colour.")]
    greedy = generator.answer(prompts, 6)
    # So cold that sampling is the argmax (random logits of a tiny model are far apart next to 1e-5).
    assert generator.answer(prompts, 6, 1e-5, seed=1) == greedy
    assert generator.answer(prompts, 6, 0.0) == greedy


def test_chat_with_a_plain_trained_checkpoint_says_it_answers_each_message_alone(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from tests.tiny_recipes import one_step_lora_checkpoint

    ckpt = one_step_lora_checkpoint(tmp_path)  # CausalLMData: plain prompts, recorded in the checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO("Q1\nQ2\nexit\n"))
    capsys.readouterr()
    assert main(["chat", "--ckpt_path", str(ckpt), "--max_new_tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "each message is answered on its own, without the conversation before it" in out
    generator = Generator(ckpt_path=str(ckpt))
    alone = generator.answer([generator.tokenizer("Q2")["input_ids"]], 4)[0].strip()
    assert f"model> {alone}\n" in out  # the second message, answered as if it were the first
