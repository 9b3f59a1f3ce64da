"""What ``peftplug validate``/``test``/``predict`` check before they run, and what ``predict`` prints or writes.

``peftplug predict`` prints one JSON object per example of the predicted split (the test split, else the validation
split), in the split's order, one a line (JSON Lines): ``{"index": 0, "prediction": "generated text"}`` for language
models, ``{"index": 0, "prediction": 2, "label": "sport"}`` for classifiers (``label`` where the data module knows the
class names). ``--predictions_file PATH`` writes the same lines to ``PATH`` instead, atomically (a crash leaves the
previous file or none). Lightning's own ``trainer.predict`` returned them to nobody: the command printed nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from peftplug.errors import ConfigError
from peftplug.fileio import atomic_write

# The trainer's limit of each subcommand's loop, as Lightning names it.
LOOP_LIMITS = {"validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}


def check_runs_batches(trainer: Any, subcommand: str) -> None:
    """Refuses an evaluation that would run no batch: ``trainer.limit_<loop>_batches: 0``, which recipes set to skip
    validation during fit (``recipes/quickstart.yaml``), and which Lightning's loop obeys in silence with status 0.

    Args:
        trainer: The instantiated trainer.
        subcommand: ``validate``, ``test`` or ``predict``.

    Raises:
        ConfigError: If the limit is 0.
    """
    name = LOOP_LIMITS[subcommand]
    if getattr(trainer, name, None) == 0:
        raise ConfigError(f"trainer.{name} is 0, so `peftplug {subcommand}` would run no batch (recipes set it to skip "
                          f"that loop during fit); add --trainer.{name} 1.0")


def check_predictions_flag(argv: list[str] | tuple[str, ...]) -> None:
    """Refuses ``--predictions_file`` on the command line of ``fit``/``validate``/``test``, which write no
    predictions: LightningCLI accepted it for every subcommand and ignored it there, so ``peftplug test
    --predictions_file F`` printed its metrics, exited 0 and wrote no ``F``. A recipe's ``predictions_file:``
    (shared by ``predict`` and ``fit``) is left alone; only the flag the user typed for this command is refused.

    Args:
        argv: The arguments, starting with the subcommand.

    Raises:
        ConfigError: If a subcommand other than ``predict`` is given the flag (or an abbreviation of it).
    """
    if not argv or argv[0] not in ("fit", "validate", "test"):
        return
    for arg in argv[1:]:
        name = arg.split("=", 1)[0].replace("-", "_")
        # jsonargparse takes unambiguous abbreviations (--pred); "--pr" would also be --print_config's.
        if len(name) >= 6 and "__predictions_file".startswith(name):
            raise ConfigError(f"--predictions_file: `peftplug {argv[0]}` writes no predictions (only `peftplug "
                              "predict` does); drop the flag, or run `peftplug predict` with it")


def check_predict_output(trainer: Any, path: str | None) -> None:
    """Refuses, before the model runs, a ``predict`` whose predictions could not all be written.

    Args:
        trainer: The instantiated trainer.
        path: The ``--predictions_file`` setting (``None``: stdout).

    Raises:
        ConfigError: Under several processes (each would hold only its own share of the rows, repeats included), or
            if ``path`` is a folder or its folder does not exist.
    """
    if trainer.world_size > 1:
        raise ConfigError(f"`peftplug predict` runs in one process (trainer.devices 1); {trainer.world_size} would "
                          "each predict a share of the rows and none could write them all in order")
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"predictions_file: {path!r} is a folder; give a file path")
    if not target.parent.is_dir():
        raise ConfigError(f"predictions_file: the folder {str(target.parent)!r} does not exist")


def _label_names(datamodule: Any) -> list[str] | None:
    """Class names of a classification data module, by class id: ``label_names`` (TextClassificationData), else
    the prompt task's raw labels (PromptClassificationData); ``None`` if it has neither."""
    names = getattr(datamodule, "label_names", None)
    if names is None:
        names = getattr(getattr(datamodule, "task", None), "labels", None)
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def prediction_records(batches: list[Any] | None, datamodule: Any = None) -> list[dict[str, Any]]:
    """One record per example, in the order of the batches: ``index``, ``prediction`` and, for a class id whose name
    the data module knows, ``label``.

    Args:
        batches: What ``trainer.predict`` returned: per batch a tensor of class ids, a tensor of token ids (a model
            without tokenizer) or a list of texts.
        datamodule: The data module (for class names), or ``None``.
    """
    names = _label_names(datamodule)
    values: list[Any] = []
    for batch in batches or []:
        values += batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)
    records = []
    for index, value in enumerate(values):
        record: dict[str, Any] = {"index": index, "prediction": value}
        if isinstance(value, int) and names is not None and 0 <= value < len(names):
            record["label"] = names[value]
        records.append(record)
    return records


def emit_predictions(batches: list[Any] | None, datamodule: Any, path: str | os.PathLike | None) -> int:
    """Prints the predictions as JSON Lines to stdout, or writes them atomically to ``path``; returns their number.

    Args:
        batches: What ``trainer.predict`` returned.
        datamodule: The data module (for class names), or ``None``.
        path: The file to write (``None``: stdout).
    """
    records = prediction_records(batches, datamodule)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path is None:
        print(text, end="", flush=True)
    else:
        atomic_write(Path(path).expanduser(), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return len(records)


def predict_and_emit(trainer: Any, kwargs: dict[str, Any], datamodule: Any, path: str | os.PathLike | None) -> int:
    """Runs ``trainer.predict`` and prints (or writes) its predictions (:func:`emit_predictions`); returns their count.

    Standard output carries the JSON lines only: the progress bar (Lightning's Rich bar, a ``TQDMProgressBar``) is
    sent to standard error while predicting (``peftplug predict ... > preds.jsonl`` began with ``Predicting ━━━``).

    Args:
        trainer: The ``lightning.pytorch.Trainer``.
        kwargs: Passed to ``Trainer.predict`` (``return_predictions`` is set).
        datamodule: The data module (its label names, if any).
        path: Where to write them (``None``: standard output).
    """
    with contextlib.redirect_stdout(sys.stderr):
        batches = trainer.predict(**{**kwargs, "return_predictions": True})
    count = emit_predictions(batches, datamodule, path)
    if path is not None:
        print(f"peftplug: wrote {count} predictions to {path}", file=sys.stderr, flush=True)
    return count
