"""benchmarks.common: page sections, result files, formatting, interleaved timing, paths and provenance."""

from __future__ import annotations

import json
import math
import re

import pytest

from benchmarks.common import fmt, pages, paths, provenance, timing


def test_a_section_is_replaced_in_place_appended_when_absent_and_read_back():
    page = "# Title\n\n<!-- a:begin -->\nold a\n<!-- a:end -->\n\ntail\n"
    assert pages.read_section(page, "a") == "old a"
    assert pages.read_section(page, "b") is None
    replaced = pages.replace_section(page, "a", "new a\n")
    assert replaced == "# Title\n\n<!-- a:begin -->\nnew a\n<!-- a:end -->\n\ntail\n"
    appended = pages.replace_section(replaced, "b", "\nbody b\n")
    assert appended.endswith("tail\n\n<!-- b:begin -->\nbody b\n<!-- b:end -->\n")
    assert pages.read_section(appended, "b") == "body b" and pages.read_section(appended, "a") == "new a"
    assert pages.block("b", "body b") == "<!-- b:begin -->\nbody b\n<!-- b:end -->"
    # An end marker before the begin marker is no section.
    assert pages.read_section("<!-- a:end -->\n<!-- a:begin -->\n", "a") is None
    with pytest.raises(ValueError, match="section name"):
        pages.markers("two words")


def test_write_section_keeps_the_other_sections_and_starts_a_page_with_its_title(tmp_path):
    page = tmp_path / "p.md"
    pages.write_section(page, "one", "first", "# P")
    pages.write_section(page, "two", "second", "# ignored: the page exists")
    pages.write_section(page, "one", "first again", "# P")
    text = page.read_text()
    assert text.startswith("# P\n\n<!-- one:begin -->\nfirst again\n<!-- one:end -->")
    assert pages.read_section(text, "two") == "second" and "ignored" not in text
    assert not [p for p in tmp_path.iterdir() if p.name != "p.md"]  # no temporary file left behind


def test_results_round_trip_and_outputs_keep_trial_runs_off_the_committed_files(tmp_path):
    data = {"a": [1, 2.5, None], "nan": float("nan")}
    path = pages.write_json(tmp_path / "sub" / "r.json", data)
    back = pages.read_json(path)
    assert back["a"] == [1, 2.5, None] and math.isnan(back["nan"])
    assert pages.read_json(tmp_path / "absent.json") is None
    page, results = tmp_path / "docs" / "x.md", tmp_path / "res" / "cpu.json"
    assert pages.outputs(None, page, results) == (page, results)
    assert pages.outputs(page, page, results) == (page, results)
    assert pages.outputs(tmp_path / "t.md", page, results) == (tmp_path / "t.md", tmp_path / "t.cpu.json")
    seen = []
    assert pages.render_results(path, seen.append) and seen[0]["a"] == [1, 2.5, None]
    assert not pages.render_results(tmp_path / "absent.json", seen.append) and len(seen) == 1
    pages.require_results(True, path)
    with pytest.raises(SystemExit, match="absent.json"):
        pages.require_results(False, tmp_path / "absent.json")


def test_fmt_missing_nan_and_specs():
    assert fmt.fmt(None) == "—" and fmt.fmt(None, none="never") == "never"
    assert fmt.fmt(float("nan")) == "nan" and fmt.fmt(float("nan"), nan="–") == "–"
    assert fmt.fmt(0.12345) == "0.123" and fmt.fmt(-0.5, ".2f") == "-0.50" and fmt.fmt(12, "d") == "12"
    assert fmt.fmt(1234567, ",") == "1,234,567"


def test_interleaved_rotates_the_order_and_warms_every_method_up():
    calls = []

    def step(method):
        calls.append(method)
        return len(calls)

    times = timing.interleaved(["a", "b", "c"], step, rounds=3, steps_per_round=2, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up, untimed
    assert calls[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert times["a"] == [4, 5, 14, 15, 18, 19] and sum(map(len, times.values())) == 18
    with pytest.raises(ValueError, match="rounds"):
        timing.interleaved(["a"], step, rounds=0, steps_per_round=1, warmup=0)
    with pytest.raises(ValueError, match="warmup"):
        timing.interleaved(["a"], step, rounds=1, steps_per_round=1, warmup=-1)


def test_paths_honour_the_data_dir_variable_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(tmp_path))
    assert paths.data_dir() == tmp_path
    monkeypatch.delenv("PEFTPLUG_DATA_DIR")
    assert paths.data_dir() == paths.REPO.parent / "shared" / "data"
    assert (paths.REPO / "benchmarks" / "common" / "paths.py").is_file()
    assert paths.results_dir("helene") == paths.REPO / "benchmarks" / "helene" / "results"


def test_provenance_names_the_commit_threads_flags_and_memory():
    import torch

    prov = provenance.provenance()
    assert re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?|unknown", prov["commit"])
    assert prov["threads"] == torch.get_num_threads() and prov["peak_rss_mib"] > 10
    assert set(prov["cpu_flags"]) <= set(provenance.CPU_FLAGS)
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert prov["cpu_flags"] == [flag for flag in provenance.CPU_FLAGS if flag in flags]
    with open("/proc/cpuinfo") as f:  # the model name, which platform.processor() leaves empty on Linux
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    if model:
        assert prov["cpu"] == model
    line = provenance.provenance_line(json.loads(json.dumps(prov)))
    assert prov["commit"] in line and f"{prov['threads']} thread(s)" in line and "MiB" in line
    assert (f"CPU {prov['cpu']}, " in line) == (prov["cpu"] != "?")
