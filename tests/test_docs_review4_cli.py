"""What docs/cli.md says about misspelled flags on the command line holds (the "Errors" section, "Settings").

The page's example line for a misspelled trainer key is the recipe's message; on the command line argparse takes a
flag that begins exactly one option's name as that option, which the page now says, and these tests pin down, so
that the page and the program cannot drift apart again. Runs ``peftplug fit --print_config`` in-process.
"""

from __future__ import annotations

from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import yaml

from peftplug.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = ["fit", "--config", str(REPO / "recipes" / "quickstart.yaml"), "--model.model", "tiny:llama"]


def _run(args: list[str]) -> int:
    """The exit status of ``peftplug ARGS`` (``--print_config`` ends the program after printing)."""
    try:
        return main(args)
    except SystemExit as done:
        return done.code or 0


def _documented(text: str) -> bool:
    page = " ".join((REPO / "docs" / "cli.md").read_text(encoding="utf-8").split())
    return text in page


def test_a_unique_prefix_of_a_flag_is_that_flag(capsys):
    code = _run([*QUICKSTART, "--trainer.max_epoch", "3", "--print_config"])
    printed = capsys.readouterr().out
    assert code == 0
    assert yaml.safe_load(printed)["trainer"]["max_epochs"] == 3  # the recipe says 1
    assert _documented("`--trainer.max_epoch 3` sets `trainer.max_epochs` without a word")


def test_a_misspelled_flag_names_the_closest_one(capsys):
    code = _run([*QUICKSTART, "--trainer.max_epocs", "3", "--print_config"])
    err = capsys.readouterr().err
    line = "unrecognized arguments: --trainer.max_epocs 3; did you mean '--trainer.max_epochs'?"
    assert code == 2 and f"peftplug: error: {line}" in err, err
    assert _documented(line)
