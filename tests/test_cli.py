"""The peftplug command: fit + export round trip, --print_config, config-file safety (bad input: test_cli_errors)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml

from peftplug.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_recipe(tmp_path):
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 1,
                    "enable_model_summary": False},
        "model": {"model": "tiny:llama", "peft": {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"],
                                                  "init_lora_weights": False}},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(tmp_path / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 4}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _one_error_line(capsys, code):
    """The exit code is 2 and stderr holds exactly one error line and no traceback (warnings may precede it)."""
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_fit_then_export_adapter_and_merged(tmp_path, tiny_recipe, capsys, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(tiny_recipe), "--evaluate_after_fit", "true"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("held-out perplexity: "), out[-3:]
    assert float(out[-1].split(": ")[1]) > 1.0
    # The resolved config went into the run directory, and the input config.yaml in the cwd is untouched.
    saved = list((tmp_path / "runs").rglob("config.yaml"))
    assert len(saved) == 1 and "init_lora_weights: false" in tiny_recipe.read_text()
    ckpt = next((tmp_path / "runs").rglob("*.ckpt"))

    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter")]) == 0
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert _one_error_line(capsys, main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter")]))

    from peftplug.loading import resolve_model_path

    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llama"))
    with torch.no_grad():
        base_logits = base(x).logits
        adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        adapter_logits = adapter(x).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(x).logits
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-4)
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-4, rtol=1e-4)


def test_print_config_resolves_the_quickstart(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(REPO / "recipes" / "quickstart.yaml"), "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["model"] == "smollm2-135m-instruct"
    assert printed["model"]["peft"]["class_path"] == "oftv2.OFTv2Config"
    assert printed["trainer"]["default_root_dir"] == "runs/quickstart"
    assert printed["data"]["class_path"] == "peftplug.chat_data.BBCNewsChatData"
    assert printed["evaluate_before_fit"] is True and printed["evaluate_after_fit"] is True


def test_steering_subcommand_is_delegated(capsys):
    """`peftplug steering ...` reaches steering.cli (its own tests cover the subcommands)."""
    with pytest.raises(SystemExit) as done:
        main(["steering", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert "extract" in usage and "generate" in usage


def test_resolved_config_never_overwrites_the_input(tmp_path, tiny_recipe):
    """DESIGN §11: with no logger the log dir is default_root_dir; an input named config.yaml there survives."""
    original = tiny_recipe.read_bytes()
    args = ["fit", "--config", str(tiny_recipe), "--trainer.logger", "false", "--trainer.max_steps", "1",
            "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tiny_recipe.parent)]
    assert main(args) == 0
    assert tiny_recipe.read_bytes() == original
