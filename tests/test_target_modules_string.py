"""One ``target_modules`` string that names a module (``--model.peft.init_args.target_modules q_proj``): PEFT reads it
as a regular expression over full module names, so it matches nothing; the one-line refusal says so and gives the
list form, which works."""

from __future__ import annotations

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
from tiny_recipes import causal_recipe

from peftplug.cli import main


def _recipe(tmp_path):
    rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
    return str(causal_recipe(
        tmp_path, rows, peft={"class_path": "peft.LoraConfig", "init_args": {"r": 2, "target_modules": ["v_proj"]}},
        optimizer=None, trainer={"max_steps": 1, "limit_val_batches": 0}, data={"batch_size": 4}))


def test_a_single_string_is_explained_and_the_list_form_works(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path)
    assert main(["fit", "--config", recipe, "--model.peft.init_args.target_modules", "q_proj"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert lines == [("peftplug: error: peft.target_modules 'q_proj' is one string, which PEFT reads as a regular "
                      "expression matching a module's full name, and it matches none (full names are like "
                      "'model.layers.0.self_attn.q_proj'); to name modules give a list: "
                      "--model.peft.init_args.target_modules '[q_proj]' (YAML: target_modules: [q_proj])")], err
    assert main(["fit", "--config", recipe, "--model.peft.init_args.target_modules", "[q_proj]"]) == 0
