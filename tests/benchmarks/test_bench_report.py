"""``python -m benchmarks.report``: every page of docs/benchmarks/ is accounted for, and rendering them all from the
committed results changes nothing (the pages in the repository are what their results give)."""

from __future__ import annotations

import pytest

from benchmarks import report
from benchmarks.common.paths import DOCS

pytestmark = pytest.mark.filterwarnings("ignore")


def test_every_page_is_known_to_the_report_command():
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(report.PAGES), f"unregistered: {pages - set(report.PAGES)}, gone: {set(report.PAGES) - pages}"
    for page, sections in report.PAGES.items():
        for section, render in sections:
            assert callable(render) or isinstance(render, str), (page, section)


def test_regenerating_every_page_from_the_committed_results_changes_nothing(data_dir, monkeypatch, capsys):
    # The HELENE SmolLM2 page's majority-class column reads the test files of the shared data.
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    assert report.main(["--check"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "helene_llm.md [page]: regenerated" in out and "kernels_sm90.md [page]: regenerated" in out
    assert "would change: nothing" in out
