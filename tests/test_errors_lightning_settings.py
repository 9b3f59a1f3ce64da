"""A Trainer setting that Lightning checks against the data only once fit runs (``val_check_interval`` above the
number of training batches) is one line naming the setting, instead of Lightning's ``ValueError`` traceback; a
``ValueError`` from anywhere else keeps its traceback (it is a bug)."""

from __future__ import annotations

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from tiny_recipes import causal_recipe

from peftplug.cli import main
from peftplug.errors import run_command

ROWS = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]


def test_val_check_interval_beyond_the_epoch_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = causal_recipe(tmp_path, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 2}, data={"val_fraction": 0.25})
    assert main(["fit", "--config", str(recipe), "--trainer.val_check_interval", "100"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1 and lines[0].startswith("peftplug: error: trainer.val_check_interval: `val_check_interval` "
                                                   "(100) must be less than or equal to the number of the training")


def test_a_value_error_of_our_own_code_keeps_its_traceback():
    def command(argv):
        raise ValueError("`r` looks like a Lightning message but comes from elsewhere")

    with pytest.raises(ValueError, match="comes from elsewhere"):
        run_command("peftplug", command, [])
