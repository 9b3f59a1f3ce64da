"""After training, use it: `peftplug generate`/`chat` answer with the adapter, and both export forms give the same
greedy answers — the adapter through PeftModel.from_pretrained, the merged model through plain transformers."""

from __future__ import annotations

import io
import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml

from peftplug.cli import main

SYSTEM = "Reply briefly."
PROMPTS = ["What is two plus two?", "Name a colour."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama with OFTv2 trained for a few steps on chat data by `peftplug fit`: (checkpoint, workdir)."""
    tmp = tmp_path_factory.mktemp("generate")
    rows = [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}"} for i in range(16)]
    (tmp / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 4, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
                    "enable_model_summary": False, "logger": False},
        "model": {"model": "tiny:llama", "max_new_tokens": 8,
                  "peft": {"class_path": "oftv2.OFTv2Config",
                           "init_args": {"block_size": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}},
        "data": {"class_path": "peftplug.chat_data.ChatData",
                 "init_args": {"train_file": str(tmp / "train.jsonl"), "system_prompt": SYSTEM, "batch_size": 4}},
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp / "recipe.yaml")]) == 0
    return next((tmp / "runs").rglob("*.ckpt")), tmp


def _greedy(model, tokenizer, max_new_tokens=8):
    """Greedy answers to PROMPTS, one at a time, with the training system prompt in the chat template."""
    answers = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return answers


def test_generate_answers_with_the_adapter_and_the_training_system_prompt(trained, capsys):
    from peftplug.checkpoints import load_checkpoint_module

    ckpt, _ = trained
    capsys.readouterr()
    args = ["generate", "--ckpt_path", str(ckpt), "--max_new_tokens", "8"]
    assert main(args + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-len(PROMPTS):]
    module = load_checkpoint_module(ckpt).eval()
    expected = _greedy(module.model, module.tokenizer)
    assert printed == [a.replace("\n", "\\n") for a in expected]
    with module.model.disable_adapter():
        base = _greedy(module.model, module.tokenizer)
    assert base != expected, "training did not change the answers; the test would not see a lost adapter"


def test_exported_adapter_and_merged_model_answer_the_same(trained, run_fresh):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import oftv2  # noqa: F401  (registers OFTV2 with PEFT, as the docs tell users to)
    from peftplug.checkpoints import load_checkpoint_module
    from peftplug.loading import resolve_model_path

    ckpt, tmp = trained
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp / "adapter")]) == 0
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp / "merged"), "--merge"]) == 0
    module = load_checkpoint_module(ckpt).eval()
    expected = _greedy(module.model, module.tokenizer)

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llama"))
    adapter = PeftModel.from_pretrained(base, str(tmp / "adapter")).eval()
    assert _greedy(adapter, AutoTokenizer.from_pretrained(str(tmp / "adapter"))) == expected

    # The merged folder needs neither peftplug nor PEFT: load it in a fresh interpreter that imports neither.
    proc = run_fresh(f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = {str(tmp / "merged")!r}
        model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        answers = []
        for prompt in {PROMPTS!r}:
            text = tok.apply_chat_template([{{"role": "system", "content": {SYSTEM!r}}},
                                            {{"role": "user", "content": prompt}}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            answers.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("peftplug", "oftv2", "peft"))
        print(json.dumps({{"answers": answers, "loaded": loaded}}))
    """, bare=True)  # a bare interpreter: the fork server has peft loaded, and this checks it is never imported
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert result["answers"] == expected


def test_chat_keeps_the_conversation(trained):
    from peftplug.generate_cli import Generator, chat_loop

    ckpt, _ = trained
    generator = Generator(ckpt_path=str(ckpt))
    assert generator.system == SYSTEM  # recorded by ChatData in the checkpoint
    out = io.StringIO()
    chat_loop(generator, 8, 0.0, io.StringIO(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\nexit\n"), out)
    replies = [line for line in out.getvalue().splitlines() if "model> " in line]
    assert len(replies) == 2
    first = generator.answer([generator.encode([{"role": "user", "content": PROMPTS[0]}])], 8)[0].strip()
    assert replies[0].endswith("model> " + first)
    history = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first},
               {"role": "user", "content": PROMPTS[1]}]
    second = generator.answer([generator.encode(history)], 8)[0].strip()
    assert replies[1].endswith("model> " + second)  # the second answer saw the first exchange


def test_generate_without_an_adapter_and_bad_settings(capsys):
    assert main(["generate", "--model", "tiny:llama", "--prompt", "hi", "--max_new_tokens", "3"]) == 0
    assert main(["generate", "--model", "tiny:llama", "--prompt", "hi", "--max_new_tokens", "0"]) == 2
    assert "peftplug: error: --max_new_tokens must be >= 1" in capsys.readouterr().err
