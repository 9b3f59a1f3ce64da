"""Every YAML under recipes/ parses with the CLI, and its LR schedule follows 10x its data; the quickstart recipe's
pipeline runs on a tiny model."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from peftplug.cli import _cli_classes, cli, import_method_packages
from peftplug.errors import ConfigError
from peftplug.schedules import LENGTH_ARGUMENTS, run_length

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
ALL_RECIPES = sorted(RECIPE_DIR.rglob("*.yaml"))


def _is_multi_source(path: Path) -> bool:
    """Multi-source recipes (top-level ``sources:``) drive several fits; tests/prompt_transfer parses each one."""
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


# ---------------------------------------------------------------- issue 42: schedules that follow the data
# Training rows each recipe is written for, where the recipe does not say it itself (n_train, k shots per class):
# the files' sizes (alpaca 52,002 rows, GSM8K's train split 7,473, the shared SST-2 subset 6,735, LM-BFF k-shot
# files k × classes).
FILE_ROWS = {"alpaca/train.jsonl": 52002, "gsm8k/train.jsonl": 7473, "train_subset_6735.tsv": 6735,
             "SST-2/16-42/train.tsv": 32, "SST-2/512-42/train.tsv": 1024, "RTE/16-13/train.tsv": 32}


def recipe_rows(recipe: Path) -> tuple[int, int]:
    """(training rows, batch size) of a recipe's data."""
    args = yaml.safe_load(recipe.read_text())["data"]["init_args"]
    if "n_train" in args:
        rows = args["n_train"]
    elif "k" in args:
        rows = args["k"] * 2  # SST-2 and RTE: two classes
    else:
        rows = next(n for name, n in FILE_ROWS.items() if args["train_file"].endswith(name))
    return rows, args["batch_size"]


class SizedData(L.LightningDataModule):
    """``rows`` training examples in batches of ``batch_size``: only the number of batches matters here, since the
    run stops before its first batch (see :class:`StepSchedulesThenStop`).

    Args:
        rows: Training rows.
        batch_size: Batch size.
    """

    def __init__(self, rows: int = 1, batch_size: int = 1) -> None:
        super().__init__()
        self.rows, self.batch_size = rows, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(self.rows), batch_size=self.batch_size)


class Stopped(Exception):
    """Raised by :class:`StepSchedulesThenStop` once the schedules have been stepped through the run."""


class StepSchedulesThenStop(Callback):
    """At the start of training, steps every LR scheduler through the whole run (as training would: it raises if a
    schedule runs out), records the run's length and each scheduler's length argument, then stops the run."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.run = run_length(trainer, pl_module.hparams.lr_scheduler_interval, not pl_module.automatic_optimization)
        self.schedules = []
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": no training here
                used = []  # the lr of each of the run's optimizer steps
                for _ in range(int(self.run.length)):
                    used += scheduler.get_last_lr()
                    scheduler.step()  # after each optimizer step; the last one's lr is never used
            assert all(math.isfinite(lr) and lr >= 0 for lr in used) and max(used) > 0, (min(used), max(used))
            name = next((arg for base, arg in LENGTH_ARGUMENTS.items() if isinstance(scheduler, base)), None)
            self.schedules.append((type(scheduler).__name__, getattr(scheduler, name) if name else None))
        raise Stopped


def _schedule_run(recipe: Path, root: Path, rows: int, batch_size: int, *extra: str) -> StepSchedulesThenStop:
    """Fits ``recipe`` (tiny Llama, full finetuning, one CPU process) on ``rows`` rows until training starts."""
    args = ["--config", str(recipe), "--model.model", "tiny:llama", "--model.task", "causal_lm", "--model.peft",
            "null", "--model.quantization", "none", "--model.num_labels", "null",
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.precision", "32-true", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(root),
            "--data", "test_peftplug_recipes.SizedData", "--data.init_args.rows", str(rows),
            "--data.init_args.batch_size", str(batch_size), *extra]
    run = cli(args, run=False)
    stop = StepSchedulesThenStop()
    run.trainer.callbacks.append(stop)
    with pytest.raises(Stopped):
        run.trainer.fit(run.model, datamodule=run.datamodule)
    return stop


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(RECIPE_DIR).as_posix())
def test_recipe_schedule_follows_ten_times_the_data(recipe, tmp_path):
    """Each recipe's optimizer and LR schedule, built through the CLI and ``configure_optimizers`` as in a run, on
    10x the rows the recipe is written for: nothing is refused, every schedule steps through the whole run, and a
    length the recipe leaves null is the run's (10x the recipe's steps unless ``max_steps`` caps the run)."""
    rows, batch_size = recipe_rows(recipe)
    stop = _schedule_run(recipe, tmp_path, 10 * rows, batch_size)
    trainer = yaml.safe_load(recipe.read_text())["trainer"]
    epochs, max_steps = trainer.get("max_epochs"), trainer.get("max_steps")
    per_epoch = math.ceil(10 * rows / batch_size)
    # Lightning: no max_epochs means no epoch limit when max_steps is set, else 1000 epochs.
    expected = max_steps if not epochs and max_steps else per_epoch * (epochs or 1000)
    expected = min(expected, max_steps) if max_steps else expected
    assert stop.run.length == expected
    for name, length in stop.schedules:
        assert length is None or length == expected, (name, length, expected)


def test_a_fixed_schedule_the_data_outgrows_is_refused_before_training(tmp_path):
    """The former quickstart (OneCycleLR total_steps 48) on 10x its 384 chats: one line naming both numbers, from
    configure_optimizers, before the first step."""
    with pytest.raises(ConfigError) as refused:
        _schedule_run(RECIPE_DIR / "quickstart.yaml", tmp_path, 3840, 8,
                      "--model.lr_scheduler.init_args.total_steps", "48")
    assert str(refused.value).startswith(
        "model.lr_scheduler.init_args.total_steps: OneCycleLR lasts 48 steps but this run takes 480 "
        "(trainer.max_epochs 1 × 480 steps per epoch: 480 batches of the data); it raises at the step after its last")
