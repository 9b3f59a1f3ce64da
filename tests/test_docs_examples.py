"""README's and docs' runnable examples run, so they cannot rot (the convention: docs/index.md, Runnable examples).

A fenced block right after the line ``<!-- runnable -->`` (or ``<!-- runnable: given NAME, ... -->``) runs here;
the blocks of one page in page order, in one scratch folder per page (``recipes/`` linked into it), so a block
may use what an earlier one wrote (a checkpoint, an exported adapter):

- ``bash`` blocks, line by line (``\\`` continuations and quoted newlines joined, ``#`` comments dropped), in
  this process through the CLI's entry point :func:`peftplug.cli.main`: ``peftplug ARGS`` or
  ``.venv/bin/peftplug ARGS``; ``make quickstart`` (the Makefile's command); ``NAME=$(ls -t GLOB | head -1)`` and
  ``$NAME`` in later lines. ``make test`` is skipped: it is the suite this test belongs to. Every ``fit`` gets
  :data:`TINY_FIT` appended, documented flags a user would add to try a recipe quickly (a tiny model, two steps,
  a few examples); ``chat`` reads :data:`CHAT_INPUT` as typed input. Any other line fails: it is not runnable.
- ``python`` blocks, with ``exec`` in this process; ``given`` names the variables the surrounding text assumes
  (``base_model``, ``fresh_base_model``, ``model``, ``tokenizer``, ``inputs``, ``batch``), which :func:`given`
  builds tiny.
"""

from __future__ import annotations

import glob
import io
import os
import re
import shlex
import sys
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- runnable(?::\s*given\s+(?P<given>[\w ,]+?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
#: Appended to every ``peftplug fit``: the tiny Llama, two optimizer steps, 16/4/4 examples, quiet.
TINY_FIT = ["--model.model", "tiny:llama", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--data.init_args.n_train", "16",
            "--data.init_args.n_val", "4", "--data.init_args.n_test", "4"]
#: What ``peftplug chat`` reads: one message, then the word that ends the conversation.
CHAT_INPUT = "Topic of this article?\nexit\n"
#: At least this many runnable blocks exist (a lost marker would otherwise pass silently).
MIN_BLOCKS = 5


def runnable_blocks(page: Path) -> list[tuple[int, str, list[str], str]]:
    """The runnable blocks of a page: ``(line number, language, given names, code)``.

    Raises:
        AssertionError: If a marker is not directly followed by a ``bash`` or ``python`` fence, or a fence is
            not closed.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.startswith("<!-- runnable"):
            continue
        marker = MARKER.match(line)
        assert marker, (f"{page.name}:{i + 1}: malformed marker {line!r} "
                        "(write <!-- runnable --> or <!-- runnable: given a, b -->)")
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert fence and fence["lang"] in ("bash", "python"), (
            f"{page.name}:{i + 1}: a runnable marker must be followed directly by a ```bash or ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.name}:{i + 2}: the fence is not closed"
        given_names = [n.strip() for n in (marker["given"] or "").split(",") if n.strip()]
        blocks.append((i + 2, fence["lang"], given_names, "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block as argument lists (continuations, quoted newlines joined; no comments)."""
    commands, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        pending += line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the argument goes on on the next line
            pending += "\n"
            continue
        pending = ""
        if words:
            commands.append(words)
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return commands


def makefile_command(target: str) -> list[str]:
    """The ``peftplug`` arguments of a one-command Makefile target (``quickstart``)."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{target}:.*\n\t(.+)$", text, re.MULTILINE)
    assert recipe, f"Makefile has no target {target!r}"
    words = shlex.split(recipe[1])
    start = next(i for i, w in enumerate(words) if w.endswith("/peftplug"))
    return words[start + 1:]


def run_shell(code: str, env: dict[str, str], monkeypatch) -> None:
    """Runs a bash block's commands in this process (see the module docstring)."""
    from peftplug.cli import main

    for words in shell_commands(code):
        words = [re.sub(r"\$(\w+)", lambda m: env[m[1]], w) for w in words]
        assignment = re.fullmatch(r"(\w+)=\$\(ls", words[0])
        if assignment and words[1] == "-t" and words[3:] == ["|", "head", "-1)"]:
            # The newest file, as `ls -t` sorts (by name, version_9 would come after version_14).
            found = sorted(glob.glob(words[2]), key=os.path.getmtime)
            assert found, f"{words[2]!r} matches nothing"
            env[assignment[1]] = found[-1]
            continue
        if words[:2] == ["make", "test"]:
            continue
        if words[:2] == ["make", "quickstart"]:
            args = makefile_command("quickstart")
        elif Path(words[0]).name == "peftplug":
            args = [m for w in words[1:] for m in (sorted(glob.glob(w)) or [w])]
        else:
            raise AssertionError(f"not runnable as written: {' '.join(words)}")
        if args[:1] == ["fit"]:
            args = args + TINY_FIT
        if args[:1] == ["chat"]:
            monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
        try:
            code_ = main(args)
        except SystemExit as done:  # --print_config and --help end the program after printing
            code_ = done.code or 0
        assert code_ == 0, f"peftplug {' '.join(args)} exited with {code_}"


def given(name: str):
    """A tiny stand-in for a variable a Python example assumes."""
    import torch

    from peftplug.loading import load_model
    from peftplug.tiny import char_tokenizer, tiny_model

    if name in ("base_model", "fresh_base_model"):
        return load_model("tiny:llama")  # what `--model.model tiny:llama` trained the page's adapters on
    if name == "model":
        return tiny_model("llama", num_hidden_layers=4)  # examples steer layer 2
    if name == "tokenizer":
        return char_tokenizer()
    if name == "inputs":
        return char_tokenizer()(["The weather today"], return_tensors="pt")
    if name == "batch":
        ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids}
    raise AssertionError(f"no tiny stand-in for the given name {name!r}; add one to test_docs_examples.given")


def test_the_docs_have_runnable_examples():
    blocks = [block for page in PAGES for block in runnable_blocks(page)]
    assert len(blocks) >= MIN_BLOCKS, f"only {len(blocks)} runnable blocks in README.md and docs/*.md"
    assert {lang for _, lang, _, _ in blocks} == {"bash", "python"}


@pytest.mark.parametrize("page", [p for p in PAGES if runnable_blocks(p)], ids=lambda p: p.name)
def test_runnable_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    env = dict(os.environ)
    for line, lang, names, code in runnable_blocks(page):
        try:
            if lang == "bash":
                run_shell(code, env, monkeypatch)
            else:
                namespace = {"__name__": "__docs_example__", **{n: given(n) for n in names}}
                # The code is the repository's own docs, run on purpose (S102 warns of exec).
                exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # noqa: S102
        except Exception as err:
            raise AssertionError(f"{page.name}, the runnable block at line {line} failed: {err}") from err


def test_links_and_recipe_paths_in_the_docs_exist():
    """Every relative link of README.md and docs/*.md, and every ``recipes/....yaml`` they name, exists."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            external = target.startswith(("http://", "https://", "#", "mailto:"))
            if not external and not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.name}: link {target}")
        missing += [f"{page.name}: {path}" for path in re.findall(r"recipes/[\w./-]+\.yaml", text)
                    if not (REPO / path).is_file()]
    assert not missing, "missing: " + "; ".join(sorted(set(missing)))
