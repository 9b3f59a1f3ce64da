"""A new user's first hour with ``peftplug``, second review: the mistakes that still ended in a traceback or in a line
that did not say what to write instead.

- a class-valued setting given a bare name (``optimizer: adamw``, ``peft: lora``, ``lr_scheduler: cosine``) named
  nothing to write; one that replaces a recipe's class (``--model.peft.class_path X`` over the recipe's, a second
  ``--config``) with one that cannot be imported was an ``AttributeError``/``ValueError`` traceback;
- ``-c FILE`` (what the usage line shows) and abbreviations (``--conf FILE``) skipped the check of the file: a binary
  file was a ``UnicodeDecodeError`` traceback;
- prompt transfer's multi-source recipe given to ``fit`` was refused for its first unknown key (``decompose.out``);
- a run folder that cannot be written was an ``OSError`` traceback from the logger, after the model had loaded;
- ``peftplug fit`` without a recipe listed ``fit.model.model, fit.data`` as required and no way to give them.

Everything runs the real command in-process (``peftplug.cli.main``) on the real quickstart recipe with a tiny model.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml

from peftplug.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
# The quickstart on the tiny Llama and 16 BBC articles: cheap enough to reach training where a case gets that far.
TINY = ["--model.model", "tiny:llama", "--data.init_args.n_train", "16", "--data.init_args.n_val", "8",
        "--data.init_args.n_test", "8", "--data.init_args.n_words", "4", "--data.init_args.max_length", "200",
        "--evaluate_before_fit", "false", "--evaluate_after_fit", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.max_steps", "1"]


def _error_line(capsys, args: list) -> str:
    """Runs ``peftplug ARGS``: exit status 2, exactly one error line on stderr, no traceback."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _fit(tmp_path: Path, *args) -> list:
    return ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir", tmp_path / "runs", *args]


def _yaml(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BARE_NAMES = [
    (["--model.optimizer", "adamw"], ("model.optimizer: 'adamw' is not a class path (a full module.Class name is "
                                     "expected); did you mean torch.optim.AdamW?")),
    (["--model.peft", "lora"], ("model.peft: 'lora' is not a class path (a full module.Class name is expected); did "
                               "you mean peft.LoraConfig?")),
    (["--model.lr_scheduler", "cosine"], ("did you mean peftplug.schedules.CosineAnnealingLR or "
                                         "torch.optim.lr_scheduler.CosineAnnealingLR")),
    (["--model.optimizer", "mezo"], "did you mean helene.ZOSGD?"),
    (["--trainer.callbacks+=modelcheckpoint"], ("trainer.callbacks: 'modelcheckpoint' is not a class path (a full "
                                               "module.Class name is expected); did you mean "
                                               "lightning.pytorch.callbacks.ModelCheckpoint?")),
]


@pytest.mark.parametrize("args, expected", BARE_NAMES, ids=[a[-1] for a, _ in BARE_NAMES])
def test_a_bare_class_name_is_answered_with_the_class_meant(tmp_path, capsys, args, expected):
    line = _error_line(capsys, _fit(tmp_path, *args))
    assert expected in line, line
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_bare_class_name_in_yaml_is_answered_too(tmp_path, capsys):
    recipe = _yaml(tmp_path, "mine.yaml", "model:\n  optimizer: sgd\n")
    line = _error_line(capsys, _fit(tmp_path, "--config", recipe))
    assert line.endswith("model.optimizer: 'sgd' is not a class path (a full module.Class name is expected); did "
                         "you mean torch.optim.SGD?"), line
    recipe = _yaml(tmp_path, "data.yaml", "data:\n  class_path: chatdata\n")
    assert "did you mean peftplug.data.ChatData?" in _error_line(capsys, _fit(tmp_path, "--config", recipe))


REPLACED = [
    ("flag_bare", lambda tmp: ["--model.peft.class_path", "LORA"],
     ("model.peft.class_path: 'LORA' is not a class path (a full module.Class name is expected); did you mean "
     "peft.LoraConfig?")),
    ("flag_typo", lambda tmp: ["--model.peft.class_path", "peft.LoraConfg"],
     ("model.peft.class_path: 'peft.LoraConfg' cannot be imported: peft has no 'LoraConfg'; did you mean "
     "peft.LoraConfig?")),
    ("second_config_bare", lambda tmp: ["--config", _yaml(tmp, "p.yaml", "model:\n  peft:\n    class_path: LORA\n")],
     "model.peft.class_path: 'LORA' is not a class path"),
    ("second_config_typo", lambda tmp: ["--config", _yaml(tmp, "p.yaml", "model:\n  peft:\n    class_path: "
                                                          "peft.LoraConfg\n")],
     ("model.peft.class_path: 'peft.LoraConfg' cannot be imported: peft has no 'LoraConfg'; did you mean "
     "peft.LoraConfig?")),
]


@pytest.mark.parametrize("make_args, expected", [c[1:] for c in REPLACED], ids=[c[0] for c in REPLACED])
def test_replacing_the_recipes_class_with_one_that_cannot_be_imported_is_one_line(tmp_path, capsys, make_args,
                                                                                 expected):
    """The recipe sets ``model.peft.class_path: oftv2.OFTv2Config``; jsonargparse's merge imports the new class to
    drop the old class's init_args and failed there with a bare exception (a traceback)."""
    line = _error_line(capsys, _fit(tmp_path, *make_args(tmp_path)))
    assert expected in line, line


def test_every_spelling_of_the_config_flag_is_checked(tmp_path, capsys):
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe")
    for args in (["-c", binary], [f"-c{binary}"], ["--conf", binary], [f"--con={binary}"]):
        line = _error_line(capsys, ["fit", *args])
        assert line == (f"peftplug: error: --config '{binary}' is not a text file (byte 0xd0 at offset 8); expected "
                        "a YAML recipe"), line
    from peftplug.config_errors import config_paths

    assert config_paths(["fit", "-c", "a.yaml", "--config=b.yaml", "--conf", "c.yaml", "-cd.yaml", "--ckpt_path",
                         "x.ckpt", "--co=e.yaml"]) == ["a.yaml", "b.yaml", "c.yaml", "d.yaml", "e.yaml"]


def test_a_multi_source_recipe_given_to_fit_names_its_command(capsys):
    recipe = REPO / "recipes" / "prompt_transfer" / "minilm_sources.yaml"
    line = _error_line(capsys, ["fit", "--config", recipe])
    assert line.endswith(f"--config '{recipe}' is a multi-source prompt-transfer recipe (it lists `sources:`), not a "
                         f"`peftplug fit` recipe; run it with `peftplug pct train-sources --config {recipe}`"), line


def test_a_run_folder_under_a_file_is_refused_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "notes").write_text("mine")
    root = tmp_path / "notes" / "runs"
    line = _error_line(capsys, ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir", root])
    assert line.endswith(f"trainer.default_root_dir: '{root}' cannot be created: '{tmp_path / 'notes'}' is a file; "
                         "set --trainer.default_root_dir to a folder"), line
    assert (tmp_path / "notes").read_text() == "mine"


@pytest.mark.skipif(not os.path.isdir("/proc/sys") or os.access("/proc/sys", os.W_OK),
                    reason="needs a read-only folder: /proc/sys is writable here")
def test_a_run_folder_on_a_read_only_file_system_is_one_line(capsys):
    """/proc/sys is mounted read-only in containers, for root too: as a user's ``runs/`` on a read-only mount."""
    line = _error_line(capsys, ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir",
                                "/proc/sys/peftplug_runs"])
    assert line.endswith("trainer.default_root_dir: cannot write in '/proc/sys' (permissions or a read-only file "
                         "system), where this run's config, logs and checkpoints go ('/proc/sys/peftplug_runs'); set "
                         "--trainer.default_root_dir to a writable folder"), line


def test_a_writable_run_folder_that_does_not_exist_yet_trains(tmp_path, capsys):
    """The check refuses only what cannot be written: a new nested folder is created by the run, as before."""
    root = tmp_path / "new" / "nested"
    assert main([str(a) for a in ["fit", "--config", QUICKSTART, *TINY, "--trainer.default_root_dir", root]]) == 0
    assert len(list(root.rglob("*.ckpt"))) == 1


def test_fit_without_a_recipe_says_how_to_give_one(capsys):
    line = _error_line(capsys, ["fit"])
    assert line == ("peftplug: error: the following settings are required: model.model, data; give a recipe with "
                    "--config R.yaml (e.g. recipes/quickstart.yaml), or set them on the command line"), line
    line = _error_line(capsys, ["fit", "--config", QUICKSTART, "--data", "null"])
    assert line == "peftplug: error: the following settings are required: data", line


def test_class_hints_match_the_classes_by_name():
    """The suggestions come from the installed classes, so they are importable names of the field's kind."""
    from peftplug.config_errors import class_hint

    assert class_hint("model.peft", "oftv2") == "; did you mean oftv2.OFTv2Config?"
    assert class_hint("model.peft", "prompt_tuning") == "; did you mean peft.PromptTuningConfig?"
    assert class_hint("model.optimizer", "fzoo") == "; did you mean helene.FZOO?"
    assert class_hint("trainer.logger", "csv") == "; did you mean lightning.pytorch.loggers.CSVLogger?"
    assert class_hint("data", "bbc") == ("; did you mean peftplug.data.BBCNewsChatData or "
                                         "peftplug.data.BBCNewsData?")
    assert class_hint("model.model", "x") == ""


def test_a_yaml_1_1_learning_rate_string_is_the_number(tmp_path, capsys):
    """PyYAML reads ``lr: 1e-4`` as the string '1e-4' (YAML 1.1 wants ``1.0e-4``); the run reads it as the number
    (the OneCycleLR check names it as 0.0001). A guard: this worked before the review too."""
    assert yaml.safe_load("lr: 1e-4")["lr"] == "1e-4"
    recipe = _yaml(tmp_path, "lr.yaml", "model:\n  optimizer:\n    class_path: torch.optim.AdamW\n    init_args:\n"
                                        "      lr: 1e-4\n")
    line = _error_line(capsys, _fit(tmp_path, "--config", recipe))
    assert "differs from the optimizer's lr 0.0001" in line, line


def test_the_command_overview_imports_no_training_library(tmp_path):
    """``peftplug``, ``peftplug --help`` and a mistyped command answer without importing PEFT, Lightning or
    transformers (the first command a new user types took 5-9 s here, importing PEFT through the method registry)."""
    import subprocess
    import sys

    code = ("import sys; from peftplug.cli import main; main(sys.argv[1:]); "
            "print(sorted(m for m in ('peft', 'lightning', 'transformers', 'bitsandbytes') if m in sys.modules))")
    for args in ([], ["--help"], ["fti"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300, check=False)
        assert done.stdout.splitlines()[-1] == "[]", (args, done.stdout[-300:], done.stderr[-2000:])
    assert "commands:" in done.stderr or "unknown command 'fti'" in done.stderr
