"""``zero_shot: true`` on ``seq_cls`` sources is refused before anything trains: the fresh classification head scores
chance whatever the prompt, and PEFT's ``disable_adapter()`` on a prompt-learning sequence classifier stopped the run
with an ``UnboundLocalError`` traceback after the model had loaded."""

import pytest
import yaml

from prompt_transfer import cli as pct_cli
from prompt_transfer.source import validate_sources_recipe


def _recipe(tmp_path, task, zero_shot):
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"good film {i}\t{i % 2}\n" for i in range(4)))
    data = {"class_path": "peftplug.data.TextClassificationData",
            "init_args": {"train_file": str(path), "validation_file": str(path), "test_file": str(path),
                          "text_column": "sentence", "label_column": "label", "max_length": 16, "batch_size": 2}}
    return {
        "out_dir": str(tmp_path / "sources"), "zero_shot": zero_shot,
        "trainer": {"default_root_dir": str(tmp_path / "logs"), "max_steps": 1, "accelerator": "cpu",
                    "logger": False, "enable_checkpointing": False},
        "model": {"model": "tiny:bert", "task": task, "num_labels": 2,
                  "peft": {"class_path": "peft.PromptTuningConfig", "init_args": {"num_virtual_tokens": 2}}},
        "sources": [{"name": "alpha", "data": data}],
    }


def test_zero_shot_on_a_classification_head_is_one_line_before_training(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, "seq_cls", True)))
    try:
        code = pct_cli.main(["train-sources", "--config", str(path)])
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "zero_shot: true needs sources that answer without training" in err and "sources[0]" in err
    assert not (tmp_path / "logs").exists()  # nothing trained


@pytest.mark.parametrize("task, zero_shot", [("seq_cls", False), ("prompt_cls", True)])
def test_other_recipes_still_validate(tmp_path, task, zero_shot):
    recipe = validate_sources_recipe(_recipe(tmp_path, task, zero_shot))
    assert recipe["sources"][0]["name"] == "alpha"
