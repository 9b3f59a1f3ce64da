"""Writing the benchmark pages and their raw results: whole pages, one script's section of a shared page, JSON.

Every write goes through :mod:`peftplug.fileio` (temporary file beside the target, then a rename), so a crash
never leaves half a page or half a result. A section is the text between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``; several scripts (or a script and a GPU run) may each own one section of the same page and
rewrite it without touching the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peftplug.fileio import atomic_write_text


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of section ``name``.

    Args:
        name: Section name (letters, digits, ``-`` and ``_``).

    Raises:
        ValueError: If ``name`` is empty or holds another character (it would not round-trip through a page).
    """
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"section name must be letters, digits, '-' or '_', got {name!r}")
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def read_section(text: str, name: str) -> str | None:
    """The body of section ``name`` in ``text`` (without its markers), or ``None`` when the page has none.

    Args:
        text: A Markdown page.
        name: Section name.
    """
    begin, end = markers(name)
    if begin not in text or end not in text[text.index(begin):]:
        return None
    start = text.index(begin) + len(begin)
    return text[start:text.index(end, start)].strip("\n")


def block(name: str, body: str) -> str:
    """Section ``name`` holding ``body``, markers included (what :func:`replace_section` puts in a page).

    Args:
        name: Section name.
        body: The section's content, without markers.
    """
    begin, end = markers(name)
    return f"{begin}\n{body.strip(chr(10))}\n{end}"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name`` holding ``body`` (the section is appended when the page has none).

    Args:
        text: A Markdown page.
        name: Section name.
        body: The section's new content, without markers.
    """
    begin, end = markers(name)
    if read_section(text, name) is None:
        return text.rstrip("\n") + "\n\n" + block(name, body) + "\n"
    head, rest = text.split(begin, 1)
    return head + block(name, body) + rest.split(end, 1)[1]


def write_section(path: str | os.PathLike, name: str, body: str, title: str) -> Path:
    """Rewrites one section of a shared page atomically, keeping every other section as it is.

    Args:
        path: The page.
        name: Section name.
        body: The section's new content.
        title: The page's first line when the page does not exist yet (``# ...``).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else title.rstrip("\n") + "\n"
    return write_page(path, replace_section(text, name, body))


def rewrite_marked_section(path: str | os.PathLike, name: str, render: Callable[[], str]) -> Path:
    """Rewrites section ``name`` of a hand-written page that must already hold its markers (a generated table inside
    prose must not land at the page's end, as :func:`write_section` would put it).

    Args:
        path: The page.
        name: Section name.
        render: Returns the section's new content; called only once the markers are found.

    Raises:
        ValueError: If the page has no ``<!-- name:begin/end -->`` markers.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if read_section(text, name) is None:
        raise ValueError(f"{path} has no <!-- {name}:begin/end --> markers for the table")
    return write_page(path, replace_section(text, name, render()))


def write_page(path: str | os.PathLike, text: str) -> Path:
    """Writes a whole page atomically (its folder created when missing).

    Args:
        path: The page.
        text: Its content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, text)


def write_json(path: str | os.PathLike, obj: Any, indent: int = 1) -> Path:
    """Writes a result as JSON atomically; two processes writing the same file never share a temporary one.

    Args:
        path: The file.
        obj: JSON-serialisable data.
        indent: JSON indentation.
    """
    return write_page(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: str | os.PathLike) -> Any | None:
    """A JSON result, or ``None`` when the file does not exist.

    Args:
        path: The file.
    """
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def outputs(out: str | os.PathLike | None, page: Path, results: Path) -> tuple[Path, Path]:
    """The page and result file a run writes: the study's own, or with ``--out PAGE`` that page and beside it a JSON
    named after both (``oftv2.cpu.json``: several scripts may write sections of one page), so that a trial run
    never overwrites the committed results.

    Args:
        out: The ``--out`` value, or ``None``.
        page: The study's page under docs/benchmarks/.
        results: The study's committed result file.
    """
    if out is None or Path(out).resolve() == page.resolve():
        return page, results
    out = Path(out)
    return out, out.with_name(f"{out.stem}.{results.name}")


def render_results(results: str | os.PathLike, render: Callable[[Any], object]) -> bool:
    """Hands a result file's content to ``render`` (which writes its page or section): every study's ``report``.

    Args:
        results: The committed result file.
        render: Writes the page from the file's content.

    Returns:
        Whether there was a result file (``False``: the page is left as it is).
    """
    record = read_json(results)
    if record is None:
        return False
    render(record)
    return True


def require_results(rendered: bool, results: str | os.PathLike) -> None:
    """Ends a ``--report`` command that found no result file, saying which file.

    Args:
        rendered: What the study's ``report`` returned.
        results: The result file it looked for.

    Raises:
        SystemExit: When ``rendered`` is false.
    """
    if not rendered:
        raise SystemExit(f"no result file at {results}: run the benchmark first")
