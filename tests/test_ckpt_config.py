"""``fit --ckpt_path`` trains what the recipe and command line configure: the checkpoint's saved hyperparameters do not
replace them (LightningCLI's default), and a checkpoint that does not fit the configured adapter is refused in
one line."""

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


def test_config_settings_win_over_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli(["fit", "--config", str(_recipe(tmp_path, "first", ["q_proj", "v_proj"]))])
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    later = _recipe(tmp_path, "later", ["q_proj", "v_proj"], max_new_tokens=7)
    resumed = cli(["fit", "--config", str(later), "--ckpt_path", str(ckpt), "--trainer.max_steps", "2"])
    assert resumed.model.hparams.max_new_tokens == 7 and resumed.trainer.global_step == 2


def test_a_checkpoint_of_another_adapter_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, "first", ["q_proj", "v_proj"]))]) == 0
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    capsys.readouterr()
    other = _recipe(tmp_path, "other", ["k_proj"])
    assert main(["fit", "--config", str(other), "--ckpt_path", str(ckpt), "--trainer.max_steps", "2"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("peftplug: error: checkpoint does not fit this model/adapter: unknown keys"), lines
