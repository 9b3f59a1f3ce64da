"""Every YAML under recipes/ parses with the CLI; the quickstart recipe's pipeline runs on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from peftplug.cli import _cli_classes, cli, import_method_packages

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
ALL_RECIPES = sorted(RECIPE_DIR.rglob("*.yaml"))


def _is_multi_source(path: Path) -> bool:
    """Multi-source recipes (top-level ``sources:``) drive several fits; tests/prompt_transfer parses each one."""
    import yaml

    return isinstance(doc := yaml.safe_load(path.read_text()), dict) and "sources" in doc


RECIPES = [p for p in ALL_RECIPES if not _is_multi_source(p)]


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(RECIPE_DIR).as_posix())
def test_recipe_parses(recipe):
    """Parsing checks every key and type (class paths resolve, init_args match signatures) without loading
    weights, so recipes for hub models (GPU targets) are checked offline too."""
    import_method_packages()

    class ParseOnly(_cli_classes()):
        def instantiate_classes(self):
            pass

    parsed = ParseOnly(args=["--config", str(recipe)], run=False).config
    root = parsed.get("trainer.default_root_dir")
    assert root, f"{recipe.name} must set trainer.default_root_dir"
    assert recipe.read_text().lstrip().startswith("#"), f"{recipe.name} needs a comment header"


def test_quickstart_pipeline_runs_on_a_tiny_model(tmp_path, capsys):
    """The quickstart recipe with a tiny BERT and a few articles: fit, then the held-out line comes last."""
    recipe = RECIPE_DIR / "quickstart.yaml"
    args = ["fit", "--config", str(recipe), "--model.model", "tiny:bert", "--trainer.max_steps", "2",
            "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--data.init_args.n_train", "32", "--data.init_args.n_val", "8", "--data.init_args.n_test", "8",
            "--data.init_args.max_length", "32"]
    run = cli(args)
    assert run.trainer.global_step == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("held-out accuracy: ")
    assert 0.0 <= float(last.split(": ")[1]) <= 1.0
