"""``fit --ckpt_path`` follows Lightning's convention, the checkpoint's model settings replace the config's (so the recipe
alone resumes a run that had ``--model.*`` flags), and says which settings it replaced: before, an OFTv2 recipe
resumed from a LoRA checkpoint trained LoRA without a word; for one commit the config won instead, which made the
recipe alone drop a run's command-line settings on resume."""

from __future__ import annotations

import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import yaml

from peftplug.cli import cli, main


def _recipe(tmp_path, name, targets, max_new_tokens=32):
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 1, "logger": False,
                    "default_root_dir": str(tmp_path / name), "enable_progress_bar": False,
                    "num_sanity_val_steps": 0, "limit_val_batches": 0, "enable_model_summary": False},
        "model": {"model": "tiny:llama", "max_new_tokens": max_new_tokens,
                  "peft": {"peft_type": "LORA", "r": 4, "target_modules": targets}},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(tmp_path / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 4}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_the_recipe_alone_resumes_a_run_that_had_command_line_model_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, "first", ["q_proj", "v_proj"])
    assert main(["fit", "--config", str(recipe), "--model.max_new_tokens", "7"]) == 0
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    capsys.readouterr()
    resumed = cli(["fit", "--config", str(recipe), "--ckpt_path", str(ckpt), "--trainer.max_steps", "2"])
    assert resumed.model.hparams.max_new_tokens == 7 and resumed.trainer.global_step == 2
    err = capsys.readouterr().err
    assert "the checkpoint's model settings replace the config's: model.max_new_tokens: 32 -> 7" in err, err


def test_a_checkpoint_of_another_adapter_says_what_it_replaces(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, "first", ["q_proj", "v_proj"]))]) == 0
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    capsys.readouterr()
    other = _recipe(tmp_path, "other", ["k_proj"])
    resumed = cli(["fit", "--config", str(other), "--ckpt_path", str(ckpt), "--trainer.max_steps", "2"])
    err = capsys.readouterr().err
    assert "model.peft.target_modules: ['k_proj'] -> ['q_proj', 'v_proj']" in err, err
    assert sorted(resumed.model.model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    assert resumed.trainer.global_step == 2


def test_a_checkpoint_replacing_a_class_path_adapter_says_so(tmp_path, capsys, monkeypatch):
    # Recipes write model.peft as class_path/init_args, the checkpoint holds a plain dict: the two never matched
    # key for key, so an OFTv2 recipe resumed from a LoRA checkpoint trained LoRA without a word.
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, "first", ["q_proj", "v_proj"]))]) == 0
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    capsys.readouterr()
    other = _recipe(tmp_path, "other", ["k_proj"])
    recipe = yaml.safe_load(other.read_text())
    recipe["model"]["peft"] = {"class_path": "oftv2.OFTv2Config",
                               "init_args": {"block_size": 8, "target_modules": ["q_proj"]}}
    other.write_text(yaml.safe_dump(recipe))
    resumed = cli(["fit", "--config", str(other), "--ckpt_path", str(ckpt), "--trainer.max_steps", "2"])
    err = capsys.readouterr().err
    assert "model.peft.peft_type: 'OFTV2' -> 'LORA'" in err, err
    assert "model.peft.target_modules: ['q_proj'] -> ['q_proj', 'v_proj']" in err, err
    assert resumed.model.model.peft_config["default"].peft_type == "LORA"
