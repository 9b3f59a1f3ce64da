"""docs/benchmarks/helene_llm.md rendered from cached result files that the test writes: zero-shot, the sweeps
(with an edge extension), the core grid's table (mean ± std, gain over zero-shot, steps to MeZO's final loss),
the plot, and the list of what has not run. No model runs here."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import pytest

from benchmarks.helene.smollm2 import grid as helene_llm
from benchmarks.helene.smollm2 import report as helene_llm_report
from benchmarks.helene.smollm2 import runs as helene_llm_runs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(helene_llm_runs, "RUNS", runs)
    monkeypatch.setattr(helene_llm_runs, "PARTIAL", tmp_path / "partial")
    monkeypatch.setattr(helene_llm_report, "CACHE", tmp_path)
    monkeypatch.setattr(helene_llm_report, "DOC", tmp_path / "helene_llm.md")
    monkeypatch.setattr(helene_llm, "PINNED_LR", {})
    return tmp_path


def _write(spec, acc, losses=(), val=()):
    result = {"spec": asdict(spec), "run_id": spec.run_id, "test_acc": acc, "n_test": spec.max_test,
              "template": "{sentence} It was{answer}", "label_words": [" terrible", " great"],
              "token_lengths": {"test": [24.9, 58]}, "nonfinite_steps": 0,
              "steps": [{"step": i, "loss": v, "time": 10.0, "forward_time": 7.0, "width": 30, "tokens": 400}
                        for i, v in enumerate(losses)],
              "val": [{"step": s, "acc": a} for s, a in val]}
    helene_llm_runs.result_path(spec).write_text(json.dumps(result))


def _finish_sweeps():
    """Every sweep with its middle lr best, except MeZO, whose top lr is best until its extension is worse."""
    for method in helene_llm.PRIORITY:
        for i, spec in enumerate(helene_llm.base_sweep_specs(method)):
            best = 2 if method == "mezo" else 1
            _write(spec, 0.6, [1.0 if i == best else 2.0] * 20)
    (extension,) = helene_llm.extension_specs("mezo")
    _write(extension, 0.5, [3.0] * 20)


def test_page_lists_what_has_not_run_before_the_sweeps(cache):
    for spec in helene_llm.zero_shot_specs():
        _write(spec, 0.5)
    path = helene_llm_report.write_report(helene_llm.queue())
    text = path.read_text()
    assert "| sst2 | `{sentence} It was{answer}` |  terrible /  great | 24.9 / 58 | 872 | 0.500 |" in text
    assert "Zero-shot on the same 200 test sentences: 0.500." in text
    assert "No run of the core grid has finished yet." in text
    assert "- sst2 seed 42 mezo: waits for its lr sweep" in text


def test_core_grid_table_from_finished_runs(cache):
    for spec in helene_llm.zero_shot_specs():
        _write(spec, 0.5)
    _finish_sweeps()
    assert helene_llm.selected_lr("mezo") == helene_llm.GRIDS["mezo"][-1]  # the extension (x10) was worse
    accs = {("mezo", 42): 0.70, ("mezo", 13): 0.66, ("helene", 42): 0.74, ("helene", 13): 0.72}
    for spec in helene_llm.phase_specs("main"):
        if spec.task != "sst2" or (spec.method, spec.split_seed) not in accs:
            continue
        # MeZO's loss falls to 0.5; HELENE's twice as fast, so it reaches MeZO's final loss halfway.
        speed = 2.0 if spec.method == "helene" else 1.0
        losses = [max(0.5, 1.0 - speed * 0.5 * i / 299) for i in range(300)]
        _write(spec, accs[spec.method, spec.split_seed], losses, [(0, 0.5), (150, 0.6), (300, 0.7)])
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    mezo = [0.70, 0.66]
    assert f"{statistics.mean(mezo):.3f} ± {statistics.stdev(mezo):.3f} (2 seeds) | +0.180 |" in text
    helene_row = next(line for line in text.splitlines() if line.startswith("| sst2 | HELENE |"))
    cells = [c.strip() for c in helene_row.split("|")]
    assert cells[5] == "+0.230"  # mean 0.73 vs zero-shot 0.50
    steps_to_loss = int(cells[7])
    assert 150 <= steps_to_loss <= 160  # the running mean of 10 reaches 0.5 a few steps after the curve does
    assert cells[8] == "300"  # MeZO's final dev accuracy 0.7 is reached at the last evaluation
    # Targets: MeZO gains 0.18 over zero-shot with a seed std of 0.028, HELENE 0.23 with 0.014; one task in.
    mezo_target = next(line for line in text.splitlines() if line.startswith("| MeZO (ZO-SGD) | +"))
    # The test-set SE at zero-shot 0.5 on 872 sentences is sqrt(0.25/872) = 0.017: both gains are beyond it too.
    assert mezo_target == (f"| MeZO (ZO-SGD) | +0.180 vs {statistics.stdev(mezo):.3f} (0.017): yes | 1 of 1 complete "
                           "| 1 of 1 |")
    assert "| HELENE | +0.230 vs 0.014 (0.017): yes | 1 of 1 complete | 1 of 1 |" in text
    assert "| ZO-Adam |" not in text.split("Target:")[1].split("![curves]")[0]  # none of its runs has finished
    assert "![curves](helene_llm_curves.png)" in text and (cache / "helene_llm_curves.png").stat().st_size > 0
    assert f"| MeZO (ZO-SGD) | {helene_llm.GRIDS['mezo'][-1] * 10:g} |" in text  # the extension is in the table
    assert "- `rte_k16_s42_mezo_plain_L128" in text  # RTE has not run: listed, not reported


def test_an_lr_on_record_is_shown_as_such_and_links_the_sweep_record(cache, monkeypatch):
    monkeypatch.setattr(helene_llm, "PINNED_LR", {"mezo": 1e-4})
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    assert "| MeZO (ZO-SGD) | 0.0001 | [on record](helene_llm_sweep.md) | | | | **yes** |" in text
    assert "lost with the uncommitted `runs/` folder" in text
    # The other optimizers still list their (unrun) sweep points; the grid waits only for them.
    assert "| HELENE | 1e-07 | not run yet |" in text
    assert "- sst2 seed 42 helene: waits for its lr sweep" in text
    assert "sst2_k16_s42_mezo_plain_lr0.0001_n300_b16_t872_main" in text


def test_a_run_stopped_mid_way_is_listed_with_the_step_its_journal_holds(cache, monkeypatch):
    monkeypatch.setattr(helene_llm, "PINNED_LR", {m: 1e-4 for m in helene_llm.PRIORITY})
    first, second = helene_llm.phase_specs("main")[:2]
    path = helene_llm_runs.partial_path(helene_llm_runs.PARTIAL, first.run_id)
    path.parent.mkdir()
    path.write_text(json.dumps({"spec": asdict(first), "journal": [[1.0, 0.9]] * 40, "steps": [{}] * 40}))
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    assert f"- `{first.run_id}` — journal at step 40 of 300 (running, or stopped and resumable from it)" in text
    assert f"- `{second.run_id}`\n" in text


def test_projected_gradients_and_helenes_hessian_mean_from_the_closure_values(cache, monkeypatch):
    from benchmarks.helene.smollm2.diagnostics import hessian_mean, projected_gradients

    monkeypatch.setattr(helene_llm, "PINNED_LR", {m: 1e-4 for m in helene_llm.PRIORITY})
    for spec in helene_llm.zero_shot_specs():
        _write(spec, 0.5)
    runs = {(s.method, s.split_seed): s for s in helene_llm.phase_specs("main") if s.task == "sst2"}
    # |c| = 10 at every step (L+ − L− = 2ε·10), one NaN step (skipped: no update, no refresh) at step 5.
    values = [[1.0 + 0.01, 1.0 - 0.01]] * 300
    values[4] = [float("nan"), 1.0]
    for key in (("mezo", 42), ("helene", 42)):
        _write(runs[key], 0.6, [0.7] * 300)
        path = helene_llm_runs.result_path(runs[key])
        result = json.loads(path.read_text())
        result["closure_values"] = values
        result["optimizer"] = {"betas": [0.9, 0.99] if key[0] == "helene" else [0.9, 0.999]}
        path.write_text(json.dumps(result))
    cs = projected_gradients(json.loads(path.read_text()))
    assert cs[0] == pytest.approx(10.0) and cs[4] != cs[4]
    h = hessian_mean(cs, 0.99, 10, 16)
    # Refreshed at applied updates 0, 10, 20, ...: steps 1, 12, 22, ... (step 5 applied nothing).
    assert h[0] == pytest.approx(0.01 * 16 * 100) and h[10] == h[0] and h[11] == pytest.approx(16 * 0.99 + 16)
    refreshes = len(range(0, 299, 10))  # 299 applied updates
    assert h[-1] == pytest.approx(1600 * (1 - 0.99 ** refreshes))
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    assert "| sst2 | 42 | MeZO (ZO-SGD) | 10.00 | 10.00 | 10.00 | — | — | — |" in text
    assert "(β2 = 0.99, refreshed every 10 updates;" in text  # HELENE's β2, not another optimizer's
    assert f"| sst2 | 42 | HELENE | 10.00 | 10.00 | 10.00 | 16 | {h[49]:.3g} | {h[299]:.3g} |" in text


def test_a_gain_beyond_a_two_seed_std_but_inside_the_test_sets_sampling_error_is_told_apart():
    # RTE's MeZO runs: +0.009 over zero-shot, 2.5 of 277 test pairs; two close seeds make the std 0.003.
    main = {("rte", 42, "mezo"): {"test_acc": 0.462}, ("rte", 13, "mezo"): {"test_acc": 0.458}}
    zero = {"rte": {"test_acc": 0.451, "n_test": 277}}
    [_, _, row] = helene_llm_report._targets_section(main, zero, ["mezo"], [42, 13])
    assert row == "| MeZO (ZO-SGD) | +0.009 vs 0.003 (0.030): yes | 1 of 1 complete | 0 of 1 |"


def test_a_complete_core_grid_says_so_and_lists_only_its_follow_ups(cache, monkeypatch):
    monkeypatch.setattr(helene_llm, "PINNED_LR", {m: 1e-4 for m in helene_llm.PRIORITY})
    for spec in helene_llm.zero_shot_specs():
        _write(spec, 0.5)
    for spec in helene_llm.phase_specs("main"):
        _write(spec, 0.6 if spec.method == "mezo" else 0.55, [1.0] * 300, [(300, 0.6)])
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    left = text.split("## What has not run yet")[1].split("Resume")[0]
    assert "The core grid is complete; of its follow-ups (`run --phase followup`) these have not run:" in left
    follow = helene_llm.phase_specs("followup")
    assert [line for line in left.splitlines() if line.startswith("- ")] == [f"- `{s.run_id}`" for s in follow]
    # A finished follow-up gets its own row in the task's table, beside MeZO's.
    _write(follow[0], 0.61, [1.0] * 300, [(300, 0.6)])
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    assert "| sst2 | MeZO, Rademacher z (follow-up) | 0.0001 | 0.610 (1 seed" in text


def test_the_majority_class_floor_is_read_from_the_test_file(cache, data_dir, monkeypatch):
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    monkeypatch.setattr(helene_llm, "PINNED_LR", {m: 1e-4 for m in helene_llm.PRIORITY})
    for spec in helene_llm.zero_shot_specs():
        _write(spec, 0.5)
    # Reference: the label column of RTE's test file, counted here (the grid uses every one of its rows).
    lines = (data_dir / "k-shot" / "RTE" / "test.tsv").read_text(encoding="utf-8").splitlines()[1:]
    labels = [line.split("\t")[-1] for line in lines if line]
    floor = max(labels.count(v) for v in set(labels)) / len(labels)
    rte = next(s for s in helene_llm.phase_specs("main") if s.task == "rte" and s.method == "mezo")
    _write(rte, 0.46, [1.0] * 300, [(300, 0.5)])
    text = helene_llm_report.write_report(helene_llm.queue()).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| rte | `"))
    assert row.endswith(f"| {len(labels)} | 0.500 | {floor:.3f} |")
    mezo = next(line for line in text.splitlines() if line.startswith("| rte | MeZO"))
    assert mezo.endswith(f"| {0.46 - floor:+.3f} |")
