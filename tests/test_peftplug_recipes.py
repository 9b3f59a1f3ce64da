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


def test_quickstart_pipeline_runs_on_a_tiny_model(tmp_path, capsys, tiny_recipe_args):
    """The quickstart recipe (chat finetuning of a causal LM) on the tiny Llama with a few articles: test, fit, test;
    the before and after accuracy lines come last, and the checkpoint answers through `peftplug generate`."""
    run = cli(tiny_recipe_args("quickstart.yaml", tmp_path, 2, "--data.init_args.n_words", "4",
                               "--data.init_args.max_length", "200", bbc_subset=True, model="tiny:llama"))
    assert run.trainer.global_step == 2
    before, after = capsys.readouterr().out.strip().splitlines()[-2:]
    assert before.startswith("held-out accuracy before: ") and after.startswith("held-out accuracy: ")
    assert all(0.0 <= float(line.split(": ")[1]) <= 1.0 for line in (before, after))
    assert list(tmp_path.rglob("*.ckpt"))
