"""Second review of ``peftplug generate`` / ``chat``: prompt-learning adapters answer with the model's own greedy
tokens whatever the batch (PEFT's ``generate`` re-inserted the virtual tokens at every step, or dropped a prefix,
with this transformers), ``chat --seed`` samples with that seed, a conversation that outgrows the position table
forgets its oldest exchanges instead of refusing every later message, an empty plain prompt and a classifier
checkpoint are one-line errors."""

from __future__ import annotations

import io
import json
import sys
import warnings

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch

from peftplug.cli import main
from peftplug.generate_cli import Generator, chat_loop

PROMPTS = ["hi", "What is the capital of France and why is it there?", "Name a colour."]


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens by full, cache-free forwards of the unpadded prompt through the PEFT wrapper (training's path)."""
    out: list[int] = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("adapter", ["prompt_tuning", "prefix_tuning"])
def test_prompt_learning_answers_are_the_greedy_tokens_in_any_batch(adapter):
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model

    generator = Generator(model="tiny:llama")
    config = {"prompt_tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
              "prefix_tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)}[adapter]
    model = generator.module.model = get_peft_model(generator.module.model, config)
    with torch.no_grad():  # a trained-looking adapter: far from its initialisation
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    model.eval()
    tokenizer = generator.tokenizer
    prompts = [generator.encode([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3  # left padding of two rows out of three
    expected = [tokenizer.decode(_greedy(model, p, 8), skip_special_tokens=True) for p in prompts]
    assert generator.answer(prompts, 8) == expected
    assert [generator.answer([p], 8)[0] for p in prompts] == expected
    with model.disable_adapter():
        base = [tokenizer.decode(_greedy(model, p, 8), skip_special_tokens=True) for p in prompts]
    assert base != expected, "the adapter does not change the answers; the test would not see it dropped"
    # Sampling takes the same path: reproducible with a seed.
    assert generator.answer(prompts, 8, 1.0, seed=3) == generator.answer(prompts, 8, 1.0, seed=3)


def test_a_fit_prompt_tuning_checkpoint_generates_its_greedy_answers(tmp_path, capsys):
    from peftplug.checkpoints import load_checkpoint_module
    from tests.tiny_recipes import causal_recipe

    rows = [{"prompt": f"What is {i} plus {i}?", "response": f" {2 * i}"} for i in range(8)]
    recipe = causal_recipe(tmp_path, rows, peft={"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                                                 "num_virtual_tokens": 6},
                           optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1.0}},
                           trainer={"max_steps": 3, "limit_val_batches": 0})
    assert main(["fit", "--config", str(recipe)]) == 0
    ckpt = next((tmp_path / "runs").rglob("*.ckpt"))
    prompts = ["What is 3 plus 3?", "What is 12 plus 12? Say it in words."]
    capsys.readouterr()
    assert main(["generate", "--ckpt_path", str(ckpt), "--max_new_tokens", "6"]
                + [a for p in prompts for a in ("--prompt", p)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-2:]
    module = load_checkpoint_module(ckpt).eval()
    tokenizer = module.tokenizer
    # CausalLMData trains on plain prompts, so generate sends plain text (checked in test_chat_review.py).
    expected = [tokenizer.decode(_greedy(module.model, tokenizer(p)["input_ids"], 6), skip_special_tokens=True)
                for p in prompts]
    assert printed == [e.strip().replace("\n", "\\n") for e in expected]


def test_chat_samples_with_its_seed(monkeypatch, capsys):
    def chat(seed: str) -> str:
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nexit\n"))
        capsys.readouterr()
        assert main(["chat", "--model", "tiny:llama", "--temperature", "1.5", "--max_new_tokens", "8",
                     "--seed", seed]) == 0
        return capsys.readouterr().out

    generator = Generator(model="tiny:llama")
    prompt = [generator.encode([{"role": "user", "content": "hello there"}])]
    one, two = (generator.answer(prompt, 8, 1.5, seed=s)[0].strip() for s in (1, 2))
    assert one != two
    assert f"model> {one}\nyou> " in chat("1")
    assert f"model> {two}\nyou> " in chat("2")


def test_chat_forgets_its_oldest_exchanges_when_the_conversation_outgrows_the_positions():
    # tiny:gpt2: 256 positions, one token per character. Two 100-character exchanges fit; a third does not.
    generator = Generator(model="tiny:gpt2")
    generator.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = io.StringIO()
    messages = ["a" * 100, "b" * 100, "c" * 100, "d" * 300, "e" * 100]
    chat_loop(generator, 3, 0.0, io.StringIO("\n".join(messages) + "\nexit\n"), out)
    text = out.getvalue()
    assert text.count("model> ") == 4  # every message but the one longer than the model by itself
    assert "forgot its oldest 1 exchange\n" in text
    assert "peftplug: the prompt is 300 tokens and --max_new_tokens 3, but the model has 256 positions" in text
    # The last answer saw the conversation as it stood after the third message ("b" and "c" exchanges).
    replies = [line.split("model> ", 1)[1] for line in text.splitlines() if "model> " in line]
    history = [{"role": "user", "content": "b" * 100}, {"role": "assistant", "content": replies[1]},
               {"role": "user", "content": "c" * 100}, {"role": "assistant", "content": replies[2]},
               {"role": "user", "content": "e" * 100}]
    while len(generator.encode(history)) + 3 > 256:
        del history[:2]
    assert replies[3] == generator.answer([generator.encode(history)], 3)[0].strip()


def test_an_empty_plain_prompt_is_one_line(capsys):
    assert main(["generate", "--model", "tiny:llama", "--raw", "--prompt", "hi", "--prompt", "",
                 "--max_new_tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "peftplug: error: prompt 2 gives no tokens" in err and "Traceback" not in err


def test_a_classifier_checkpoint_says_what_to_use_instead(tmp_path, capsys):
    import yaml

    rows = [{"text": f"sample {i} text", "label": i % 2} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {"seed_everything": 0,
              "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "max_steps": 1,
                          "default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False,
                          "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0},
              "model": {"model": "tiny:llama", "task": "seq_cls", "num_labels": 2,
                        "peft": {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}},
              "data": {"class_path": "peftplug.data.TextClassificationData",
                       "init_args": {"train_file": str(tmp_path / "train.jsonl"), "batch_size": 4}}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp_path / "recipe.yaml")]) == 0
    ckpt = next((tmp_path / "runs").rglob("*.ckpt"))
    capsys.readouterr()
    for command in (["generate", "--prompt", "hi"], ["chat"]):
        assert main([command[0], "--ckpt_path", str(ckpt), *command[1:]]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("peftplug: error: ")]
        assert len(lines) == 1 and "is a seq_cls model" in lines[0] and "peftplug predict" in lines[0], lines


def test_predict_and_chat_validation_generate_the_greedy_tokens_under_prompt_tuning():
    # PeftModule.generate_texts (chat val_acc/test_acc) and predict_step take the same path as `peftplug generate`.
    from peft import PromptTuningConfig

    from peftplug.data.base import pad_batch
    from peftplug.lightning import PeftModule

    module = PeftModule("tiny:llama", peft=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
                        max_new_tokens=6).eval()
    with torch.no_grad():
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    tokenizer = module.tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = [tokenizer.decode(_greedy(module.model, p, 6), skip_special_tokens=True) for p in prompts]
    batch = pad_batch([{"input_ids": p, "attention_mask": [1] * len(p)} for p in prompts], tokenizer.pad_token_id,
                      left=True)
    with torch.no_grad():
        assert module.predict_step(batch, 0) == expected
        chat = {"input_ids": batch["input_ids"], "gen_input_ids": batch["input_ids"],
                "gen_attention_mask": batch["attention_mask"]}
        assert module.predict_step(chat, 0) == expected
