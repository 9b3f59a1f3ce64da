"""Second review of the benchmark pages: ``benchmarks.report --check`` covers every page a plain run rewrites (also
the sections it renders into docs/helene.md and docs/oftv2.md), and the equal-forward-pass study's reach rule
counts a tie in correct answers as reaching the target whatever float32 rounding did to the two means."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks import report
from benchmarks.common.paths import DOCS
from benchmarks.helene.smollm2 import budget_report

pytestmark = pytest.mark.filterwarnings("ignore")


def _docs_copy(tmp_path):
    copy = tmp_path / "docs"
    shutil.copytree(DOCS.parent, copy)
    return copy


def test_check_sees_a_stale_section_of_docs_helene(data_dir, monkeypatch, tmp_path, capsys):
    # A plain run rewrites docs/helene.md's "Beating MeZO" section too: --check must say when it would change.
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    docs = _docs_copy(tmp_path)
    page = docs / "helene.md"
    text = page.read_text(encoding="utf-8")
    section = text.split("<!-- helene-beating-mezo:begin -->", 1)[1]
    assert "0.740 ± 0.011" in section
    page.write_text(text.replace(section, section.replace("0.740 ± 0.011", "0.999 ± 0.011", 1)), encoding="utf-8")
    monkeypatch.setattr(report, "DOCS", docs / "benchmarks")
    assert report.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "would change: helene.md" in out
    # --check never writes the pages it checks.
    assert "0.999 ± 0.011" in page.read_text(encoding="utf-8")


def test_check_of_an_unchanged_copy_names_nothing(data_dir, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    docs = _docs_copy(tmp_path)
    monkeypatch.setattr(report, "DOCS", docs / "benchmarks")
    assert report.main(["--check"]) == 0, capsys.readouterr().out
    assert "would change: nothing" in capsys.readouterr().out


def _result(counts: tuple[int, int, int], n: int = 872) -> dict:
    # Accuracy as the runs record it: a float32 mean of 0/1 hits, widened to a Python float.
    accs = [torch.cat([torch.ones(k), torch.zeros(n - k)]).mean().item() for k in counts]
    return {"tests": [{"budget": b, "acc": a} for b, a in zip(budget_report.TEST_BUDGETS, accs)], "n_test": n}


def test_a_tie_in_correct_answers_reaches_the_target():
    # Every pair of seeds below has 1238 correct answers in all at each budget, MeZO's count at 600 forward passes
    # (605 + 633): a tie is "at least" MeZO's accuracy, whichever last bit float32 left on each mean (with the
    # float means, 35 of these 40 splits were judged below it).
    mezo = [_result((612, 606, 605)), _result((593, 587, 633))]
    target = budget_report._mean_at(mezo, budget_report.BUDGET)
    misses = []
    for a in range(600, 640):
        other = [_result((a, a, a)), _result((1238 - a, 1238 - a, 1238 - a))]
        if budget_report._forwards_to(other, target) != budget_report.TEST_BUDGETS[0]:
            misses.append(a)
    assert not misses, f"ties judged below the target for seed-42 counts {misses}"


def test_one_answer_fewer_does_not_reach_the_target():
    mezo = [_result((612, 606, 605)), _result((593, 587, 633))]
    target = budget_report._mean_at(mezo, budget_report.BUDGET)
    for a in range(600, 640):
        other = [_result((a, a, a)), _result((1237 - a, 1237 - a, 1237 - a))]
        assert budget_report._forwards_to(other, target) is None, a


def _speed(flags: list[str] | None) -> dict:
    rows = [{"step": 8.0, "forward": 5.0, "overhead": 3.0}, {"step": 7.0, "forward": 5.0, "overhead": 2.0},
            {"step": 7.2, "forward": 4.9, "overhead": 2.3}]
    record = {"length": 48, "threads": 1, "device": "cpu: 1 threads", "forward": {"16": 2.4},
              "steps": {"mezo": rows}, "commit": "abc", "loadavg": [1.0, 1.0, 1.0]}
    return record if flags is None else {**record, "cpu_flags": flags}


@pytest.mark.parametrize("flags, shown", [(["avx2", "avx512f"], "CPU flags avx2, avx512f"),
                                          (None, "CPU flags not recorded")])
def test_zo_step_cost_says_which_cpu_and_what_each_number_is(monkeypatch, tmp_path, flags, shown):
    from benchmarks.common.pages import write_json
    from benchmarks.helene.smollm2 import report as llm_report

    write_json(tmp_path / "speed.json", _speed(flags))
    monkeypatch.setattr(llm_report, "CACHE", tmp_path)
    text = "\n".join(llm_report._speed_section())
    assert shown in text
    # Medians of the two steps after the first: step 7.1 s, two forwards 4.95 s.
    assert "| mezo | 16 | 7100.0 | 4950.0 | 2150.0 |" in text
    assert "medians of 2 steps after the first" in text and "the fastest of its timed calls" in text


def test_a_zo_measurement_file_keeps_the_cpu_flags():
    from benchmarks.common.provenance import cpu_flags
    from benchmarks.helene.smollm2 import measure

    kept = measure.record({"mode": "inference", "peak_rss_mib": 1.0})
    assert kept["cpu_flags"] == cpu_flags() and kept["mode"] == "inference" and "commit" in kept


def test_llm_sft_names_the_unit_its_peak_rss_is_in():
    # ru_maxrss / 1024 is MiB (the column said MB: 4.9 % apart).
    from benchmarks.oftv2 import llm_sft

    run = {"lr": 1e-3, "trainable": 10, "before": 0.0, "after": 0.5, "fit_s": 1.0, "peak_rss_mb": 4160.4,
           "cpu_flags": ["avx2"]}
    page = llm_sft.render({"LoRA r=16": run}, None, {}, "")
    assert "| peak RSS (MiB) |" in page and "| 4160 |" in page
    # A page written with the new header still hands its rows on when a method's result is missing.
    assert "LoRA r=16" in llm_sft._rows_from_page(page)


def test_llm_sft_says_which_runs_kept_no_cpu_flags():
    from benchmarks.oftv2 import llm_sft

    run = {"lr": 1e-3, "trainable": 10, "before": 0.0, "after": 0.5, "fit_s": 1.0, "peak_rss_mb": 1.0}
    page = llm_sft.render({"LoRA r=16": {**run, "cpu_flags": ["avx2"]}, "QLoRA r=16 (nf4)": run}, None, {}, "")
    assert "the runs recorded: avx2 (LoRA r=16); not recorded: QLoRA r=16 (nf4)." in page
    page = llm_sft.render({"QLoRA r=16 (nf4)": run}, None, {}, "")
    assert "CPU flags not recorded by the runs (QLoRA r=16 (nf4))." in page
