"""A new user's first evaluation, third review: ``--predictions_file`` given to ``test`` (or ``validate``, ``fit``)
was accepted and ignored: the command printed its metrics, exited 0 and wrote no file. It is now one line naming the
command that writes predictions, before anything loads; ``predict`` still writes the file, and a recipe's
``predictions_file:`` entry (shared by ``predict`` and ``fit``) stays accepted everywhere.

Everything runs the real command in-process (``peftplug.cli.main``) on the real quickstart recipe with a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml

from peftplug.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
TINY = ["--model.model", "tiny:llama", "--data.init_args.n_train", "8", "--data.init_args.n_val", "4",
        "--data.init_args.n_test", "4", "--data.init_args.eval_batch_size", "4", "--trainer.max_steps", "1",
        "--trainer.enable_progress_bar", "false", "--model.max_new_tokens", "2",
        "--evaluate_before_fit", "false", "--evaluate_after_fit", "false"]


def _args(command, tmp_path, *extra):
    return [command, "--config", str(QUICKSTART), *TINY, "--trainer.default_root_dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("command", ["test", "validate", "fit"])
@pytest.mark.parametrize("flag", ["--predictions_file {}", "--predictions_file={}", "--predictions-file {}",
                                  "--pred {}"])
def test_predictions_file_outside_predict_is_one_line(tmp_path, capsys, command, flag):
    target = tmp_path / "predictions.jsonl"
    assert main(_args(command, tmp_path, *flag.format(target).split())) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"peftplug: error: --predictions_file: `peftplug {command}` writes no predictions (only "
                       "`peftplug predict` does); drop the flag, or run `peftplug predict` with it")
    assert not target.exists() and not (tmp_path / "run").exists()  # refused before the model loaded


def test_predict_still_writes_the_file_and_a_recipe_entry_is_not_refused(tmp_path, capsys):
    recipe = yaml.safe_load(QUICKSTART.read_text())
    target = tmp_path / "from_recipe.jsonl"
    recipe["predictions_file"] = str(target)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    common = [*TINY, "--trainer.default_root_dir", str(tmp_path / "run")]
    assert main(["fit", "--config", str(path), *common]) == 0  # the recipe's entry: predict's, fit ignores it
    assert not target.exists()
    checkpoint = next((tmp_path / "run").rglob("*.ckpt"))
    assert main(["predict", "--config", str(path), *common, "--ckpt_path", str(checkpoint)]) == 0
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    flag = tmp_path / "flag.jsonl"
    assert main(["predict", "--config", str(path), *common, "--ckpt_path", str(checkpoint),
                 "--predictions_file", str(flag)]) == 0
    assert flag.read_text() == target.read_text()


def test_kshot_errors_are_named_by_the_command_the_user_typed(tmp_path, capsys):
    # `peftplug kshot` printed its errors as `python -m peftplug.data.lmbff_cli: error: ...`, a name the user never
    # typed (its own usage line says `peftplug kshot`). The seeds are checked before the hub is read.
    assert main(["kshot", "RTE", "--data_dir", str(tmp_path), "--seeds", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peftplug kshot: error: ") and "split seed -1" in err[0]
