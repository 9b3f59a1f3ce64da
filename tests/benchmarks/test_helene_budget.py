"""The equal-forward-pass comparison (benchmarks.helene.smollm2.budget*): runs stop and test at budgets counted by
the optimizers' own counters, resume and replay bit for bit from their journal, the nf4 run kind trains an OFTv2
adapter on a 4-bit base, and the queue keeps every run on one shard while sweeps and runs finish elsewhere.

Model runs use a tiny Llama on the real RTE k-shot split with one-character label words (its char tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.helene.smollm2 import budget, budget_cli, budget_report, budget_run, grid
from benchmarks.helene.smollm2 import runs as runs_mod
from benchmarks.helene.smollm2.budget import BudgetSpec


class Interrupted(Exception):
    """Stands for the process being stopped right after a journal write."""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Empty result and journal folders for the study (and for the grid, whose lrs the baselines take)."""
    monkeypatch.setattr(budget, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(budget, "PARTIAL", tmp_path / "partial")
    monkeypatch.setattr(budget, "CACHE", tmp_path)
    return tmp_path


@pytest.fixture
def tiny(cache, monkeypatch, data_dir):
    from peftplug import prompt_cls

    monkeypatch.setattr(runs_mod, "MODEL", "tiny:llama")
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    monkeypatch.setattr(runs_mod, "SCRATCH", cache / "scratch")
    monkeypatch.setattr(runs_mod, "FLUSH_EVERY", 2)
    base = prompt_cls.PromptClassificationData

    class OneCharWords(base):
        def __init__(self, task, **kwargs):
            template = "{sentence}?{answer}" if task == "sst2" else "{premise}|{hypothesis}?{answer}"
            super().__init__(task, template=template, label_words=["y", "n"], **kwargs)

    monkeypatch.setattr(prompt_cls, "PromptClassificationData", OneCharWords)
    return cache


def _spec(method: str, budget_: int, tests: tuple[int, ...], lr: float = 1e-2, **kw) -> BudgetSpec:
    return BudgetSpec("rte", 13, method, lr, budget=budget_, tests=tests, dev_every=4, batch_size=4, max_test=8,
                      **kw)


def test_a_run_stops_and_tests_where_the_optimizers_own_counter_reaches_each_budget(tiny):
    # HiZOO-style HELENE: 3 forwards on refresh steps (the first and every 10th), else 2 -- steps 1..5 reach
    # 3, 5, 7, 9, 11 forward passes, so budget 10 stops at step 5 (11 passes), its test point 5 at step 2.
    result = budget_run.execute(_spec("hizoo", 10, (5, 10)))
    assert [s["forward_passes"] for s in result["steps"]] == [3, 5, 7, 9, 11]
    assert [(t["budget"], t["forward_passes"], t["step"]) for t in result["tests"]] == [(5, 5, 2), (10, 11, 5)]
    assert result["tests"][-1]["acc"] == result["test_acc"] and result["planned_steps"] == 5
    # FZOO N=4: 5 forwards a step, the N + 1 closure values of every step journaled.
    fzoo = budget_run.execute(_spec("fzoo4", 15, (5, 15)))
    assert [s["forward_passes"] for s in fzoo["steps"]] == [5, 10, 15]
    assert [len(v) for v in fzoo["closure_values"]] == [5, 5, 5]
    assert fzoo["optimizer"]["class"] == "FZOO" and fzoo["cpu_flags"] is not None
    assert budget.result_path(_spec("fzoo4", 15, (5, 15))).is_file()


def test_the_test_points_equal_trainer_test_bit_for_bit(tiny):
    import lightning as L

    spec = _spec("mezo", 4, (4,))
    module, data = runs_mod.build(spec.run_spec())
    data.setup()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tiny / "scratch"))
    [test] = trainer.test(module, datamodule=data, verbose=False)
    ours = budget_run.evaluate(module, data.test_dataloader())
    assert (ours["acc"], ours["loss"]) == (test["test_acc"], test["test_loss"]) and ours["n"] == 8


def test_an_interrupted_run_resumes_from_its_journal_and_a_result_replays_step_for_step(tiny, monkeypatch):
    spec = _spec("fzoo4", 30, (10, 30))
    whole = budget_run.execute(spec)
    budget.result_path(spec).unlink()
    write = runs_mod._write_json

    def write_then_stop(path, data):
        write(path, data)
        if path.parent == budget.PARTIAL and len(data["journal"]) == 4:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(runs_mod, "_write_json", write_then_stop)
        with pytest.raises(Interrupted):
            budget_run.execute(spec)
    journal = json.loads((budget.PARTIAL / f"{spec.run_id}.json").read_text())
    assert [t["budget"] for t in journal["tests"]] == [10]  # the test point at step 2 is on record
    resumed = budget_run.execute(spec)
    for key in ("closure_values", "val", "test_acc", "test_loss"):
        assert resumed[key] == whole[key], key

    def points(result):  # wall times aside
        return [{k: v for k, v in t.items() if k != "train_seconds"} for t in result["tests"]]

    assert points(resumed) == points(whole)
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in whole["steps"]]
    assert [s["from_step"] for s in resumed["segments"]] == [0, 4]

    # Replay from the result alone (closure values + seed): every point again, no training forward.
    same = budget_run.replay(whole, tiny / "replay")
    assert same["same"] and same["differences"] == []
    assert (tiny / "replay" / "runs" / f"{spec.run_id}.json").is_file()  # its own files, never the record's
    tampered = {**whole, "closure_values": [list(v) for v in whole["closure_values"]]}
    tampered["closure_values"][-1][1] += 0.5  # the last step moves differently: its dev point (every step) differs
    report = budget_run.replay(tampered, tiny / "replay2")
    assert not report["same"] and report["differences"][0].startswith("validation at step 6")


def test_replay_command_says_identical_for_a_recorded_run(tiny, capsys):
    spec = _spec("mezo_rademacher", 6, (6,))
    budget_run.execute(spec)
    assert budget_cli.main(["replay", spec.run_id]) == 0
    assert "identical" in capsys.readouterr().out


def test_the_nf4_run_kind_trains_an_oftv2_adapter_on_a_4bit_base(tiny):
    pytest.importorskip("bitsandbytes")
    spec = _spec("mezo_nf4", 4, (4,), lr=1e-1)
    module, _ = runs_mod.build(spec.run_spec())
    import bitsandbytes as bnb

    linear4 = [m for m in module.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert len(linear4) == 14 and trainable and all("oftv2_Q" in n for n in trainable)
    result = budget_run.execute(spec)
    assert [s["forward_passes"] for s in result["steps"]] == [2, 4]
    # Block 32 on every linear layer: in/32 blocks of 32·31/2 rotation parameters each, nothing else trains.
    assert result["trainable"] == sum(m.in_features // 32 * (32 * 31 // 2) for m in linear4)
    assert result["optimizer"]["class"] == "ZOSGD"


def test_bad_specs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="method: no optimizer 'fzoo'"):
        BudgetSpec("sst2", 42, "fzoo", 1e-3)
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        BudgetSpec("sst2", 42, "mezo", 1e-3, budget=0, tests=(0,))
    with pytest.raises(ValueError, match="tests must be increasing"):
        BudgetSpec("sst2", 42, "mezo", 1e-3, tests=(300, 120, 600))
    with pytest.raises(ValueError, match="tests must be increasing"):
        BudgetSpec("sst2", 42, "mezo", 1e-3, tests=(120, 300))
    spec = BudgetSpec("sst2", 42, "hizoo", 1e-5)
    assert (spec.planned_steps(), spec.max_steps(), spec.dev_steps()) == (286, 300, 29)
    assert BudgetSpec.from_settings(json.loads(json.dumps(spec.settings()))) == spec


# ------------------------------------------------------------------------------------------------- the queue
def _finish(spec: BudgetSpec, loss: float = 1.0, acc: float = 0.7, accs: dict | None = None) -> None:
    budget.RUNS.mkdir(parents=True, exist_ok=True)
    steps = [{"step": i + 1, "loss": loss, "time": 1.0, "forward_passes": 2 * (i + 1)} for i in range(6)]
    accs = accs or {}
    tests = [{"budget": b, "forward_passes": b, "step": b // 2, "acc": accs.get(b, acc), "loss": 0.5}
             for b in spec.tests]
    budget.result_path(spec).write_text(json.dumps({"spec": spec.settings(), "steps": steps, "nonfinite_steps": 0,
                                                    "test_acc": acc, "tests": tests, "val": []}))


def _finish_sweeps(best_index: int = 1, fzoo8_better: bool = False) -> None:
    for method in budget.NEW:
        for i, spec in enumerate(budget.sweep_specs(method)):
            better = 0.5 if (method == "fzoo8") == fzoo8_better else 0.6
            _finish(spec, loss=better if i == best_index else 2.0)


def test_sweeps_first_then_main_in_the_issues_order_and_the_baselines_at_the_grids_lrs(cache):
    names = [name for name, _, _ in budget.queue()]
    first_main = names.index("sst2:fzoo_best:s42")
    assert all(n.startswith("sweep:") for n in names[:first_main])
    assert budget.selected("mezo")[0] == grid.selected_lr("mezo") == 1e-4
    assert budget.selected("zoadam")[0] == grid.selected_lr("zoadam") == 1e-3
    _finish_sweeps(fzoo8_better=True)
    main = [s for n, s, _ in budget.queue() if n.startswith("sst2:")]
    assert [(s.method, s.split_seed) for s in main] == [
        (m, seed) for m in ("fzoo8", "helene_scalar", "mezo", "mezo_rademacher", "zoadam", "fzoo4",
                            "helene_scalar_bc", "hizoo") for seed in (42, 13)]
    assert all(s.budget == 600 and s.tests == (120, 300, 600) and s.max_test == 872 for s in main)
    assert budget.selected("fzoo4")[0] == budget.GRIDS["fzoo4"][1]


def test_follow_ups_come_last_in_their_own_phase_and_render_beside_the_queues_run(cache, tmp_path):
    follow = budget.follow_ups()
    names = [name for name, _, _ in budget.queue()]
    third = len(budget.THIRD_SEED_METHODS)  # the seed-21 items, queued after the follow-ups
    # Appended after every comparison item, so no item changes shard.
    assert follow and names[-len(follow) - third:-third] == [name for name, _, _ in follow]
    specs = [spec for _, spec, _ in follow]
    assert all(s.purpose == "followup" and s.run_id.endswith("_followup") for s in specs)
    assert {s.run_id for i in (0, 1) for s in budget.shard_members("followup", (i, 2))} == {s.run_id for s in specs}
    assert not any(budget.in_phase(name, "nf4") for name, _, _ in follow)
    doc = tmp_path / "helene.md"
    doc.write_text("## Beating MeZO\n\n<!-- helene-beating-mezo:begin -->\n<!-- helene-beating-mezo:end -->\n")
    page = tmp_path / "benchmarks" / "helene_budget.md"
    page.parent.mkdir()
    budget_report.write_report(page, doc)
    assert "Follow-ups" not in doc.read_text()  # nothing to show before a follow-up has finished
    fzoo = next(s for s in specs if s.method == "fzoo8_nf4")
    for i, spec in enumerate(budget.sweep_specs("fzoo8_nf4")):
        _finish(spec, loss=0.5 if i == 1 else 2.0)
    queued = budget.main_spec("sst2", fzoo.split_seed, "fzoo8_nf4", budget.selected("fzoo8_nf4")[0])
    _finish(queued, accs={120: 0.67, 300: 0.52, 600: 0.5}, acc=0.5)
    _finish(fzoo, accs={120: 0.6, 300: 0.66, 600: 0.7})
    budget_report.write_report(page, doc)
    for text in (page.read_text(), doc.read_text()):
        row = next(line for line in text.splitlines() if line.startswith("| FZOO N=8, nf4 + OFTv2 b32, seed 42 |"))
        assert f"| {fzoo.lr:g} | 0.600 | 0.660 | 0.700 | {queued.lr:g} | 0.670 | 0.520 | 0.500 |" in row, row
    nf4 = next(line for line in doc.read_text().splitlines() if line.startswith("| FZOO N=8, nf4 + OFTv2 b32 |"))
    assert "0.600" not in nf4 and "0.670 (1 seed)" in nf4  # the nf4 table holds the queue's run only
    pending = [spec for spec in specs if spec is not fzoo]
    for spec in pending:
        row = next(line for line in doc.read_text().splitlines()
                   if line.startswith(f"| {budget_report._label(spec.method)}, seed {spec.split_seed} |"))
        assert f"| {spec.lr:g} | not run yet |" in row, row


def test_the_third_seed_comes_last_in_its_own_phase_and_adds_three_seed_means(cache, tmp_path):
    positions = [name for name, _, _ in budget.queue()]
    assert positions[-2:] == ["seed21:mezo:s21", "seed21:fzoo8:s21"]
    _finish_sweeps(fzoo8_better=True)
    assert [name for name, _, _ in budget.queue()] == positions  # nothing moved
    third = [spec for i in (0, 1) for spec in budget.shard_members("seed21", (i, 2))]
    assert sorted((s.method, s.split_seed, s.purpose) for s in third) == [("fzoo8", 21, "main"), ("mezo", 21, "main")]
    assert not budget.in_phase("seed21:mezo:s21", "main") and budget.in_phase("seed21:mezo:s21", "all")
    accs = {("mezo", 42): {120: 0.6, 300: 0.65, 600: 0.7}, ("mezo", 13): {120: 0.6, 300: 0.65, 600: 0.7},
            ("fzoo8", 42): {120: 0.72, 300: 0.74, 600: 0.75}, ("fzoo8", 13): {120: 0.72, 300: 0.74, 600: 0.75}}
    for (method, seed), points in accs.items():
        _finish(budget.main_spec("sst2", seed, method, budget.selected(method)[0]), accs=points)
    doc = tmp_path / "helene.md"
    doc.write_text("## Beating MeZO\n\n<!-- helene-beating-mezo:begin -->\n<!-- helene-beating-mezo:end -->\n")
    page = tmp_path / "benchmarks" / "helene_budget.md"
    page.parent.mkdir()
    budget_report.write_report(page, doc)
    assert "Third split seed" not in page.read_text() + doc.read_text()  # nothing before a seed-21 run
    mezo21, fzoo21 = sorted(third, key=lambda s: s.method != "mezo")
    _finish(mezo21, accs={120: 0.55, 300: 0.6, 600: 0.61})  # MeZO's 3-seed final accuracy: (0.7+0.7+0.61)/3 = 0.67
    budget_report.write_report(page, doc)
    fzoo_head = f"| FZOO N=8 | {budget.selected('fzoo8')[0]:g} |"
    row = next(line for line in doc.read_text().splitlines() if line.startswith(fzoo_head))
    assert row.endswith("| not run yet |  |  | — | — | — | — |"), row  # no two-seed means under 3-seed headers
    _finish(fzoo21, accs={120: 0.63, 300: 0.7, 600: 0.71})  # 3-seed means 0.690 / 0.727 / 0.737
    budget_report.write_report(page, doc)
    for text in (page.read_text(), doc.read_text()):
        lines = text.splitlines()
        fzoo = next(line for line in lines if line.startswith(fzoo_head))
        means = "| 0.690 ± 0.052 | 0.727 ± 0.023 | 0.737 ± 0.023 |"
        assert f"| 0.630 | 0.700 | 0.710 {means} 120 (0.20×) |" in fzoo, fzoo
        mezo = next(line for line in lines if line.startswith("| MeZO (ZO-SGD) | 0.0001 | 0.550 |"))
        assert mezo.endswith("| 600 (1.00×) |"), mezo
        assert "MeZO's 3-seed final accuracy: 0.670" in text
    # MeZO first reaches its final accuracy at its full budget here: no note on the ratio.
    assert "does not climb after" not in doc.read_text()
    # MeZO's seed 21 peaks early: its 3-seed mean reaches its own final accuracy (0.567) at 120 passes (0.700).
    _finish(mezo21, accs={120: 0.9, 300: 0.6, 600: 0.3})
    budget_report.write_report(page, doc)
    text = doc.read_text()
    assert "reaches its final accuracy already at 120 forward passes (it does not climb after)" in text
    assert "FZOO N=8 reaches it at 120 (0.20× MeZO's 600) and its mean is above MeZO's at 300, 600 forward " \
           "passes." in text  # 0.690 < 0.700 at 120; 0.727 > 0.633, 0.737 > 0.567
    # (the fake runs' steps count 2 forward passes each)
    two_seed = next(line for line in doc.read_text().splitlines() if line.startswith("| FZOO N=8 | 2.00 |"))
    assert "0.750 ± 0.000" in two_seed  # the comparison's table keeps the two-seed means


def test_a_sweep_best_on_its_edge_extends_a_decade_and_keeps_its_shard(cache):
    before = {i: [s.run_id for s in budget.shard_members("all", (i, 2))] for i in (0, 1)}
    for i, spec in enumerate(budget.sweep_specs("helene_scalar")):
        _finish(spec, loss=3.0 - i)  # the largest lr is best: one more point a decade above
    points = budget.sweep_specs("helene_scalar")
    assert [s.lr for s in points][-1] == pytest.approx(1e-2) and len(points) == 5
    after = {i: [s.run_id for s in budget.shard_members("all", (i, 2))] for i in (0, 1)}
    owner = next(i for i in (0, 1) if points[0].run_id in after[i])
    assert points[-1].run_id in after[owner]
    for i in (0, 1):  # nothing that was a shard's moved to the other
        assert set(before[i]) <= set(after[i])


def test_slots_keep_their_shard_when_the_best_optimizers_become_known(cache):
    def owners():
        return {name: i for i in (0, 1) for name in _names(i)}

    def _names(i):
        ids = {s.run_id for s in budget.shard_members("all", (i, 2))}
        return {name for name, spec, _ in budget.queue() if spec is not None and spec.run_id in ids}

    positions = [name for name, _, _ in budget.queue()]
    _finish_sweeps()
    assert [name for name, _, _ in budget.queue()] == positions  # slots filled, none moved
    mid = owners()
    assert budget.best_new(2) is None and budget.waiting("cr")
    # HiZOO and the bias-correction ablation are not candidates: the better of them never fills a slot, and the
    # slots fill without their mains.
    accs = {"hizoo": 0.9, "fzoo4": 0.8, "helene_scalar": 0.78, "fzoo8": 0.7}
    for method, acc in accs.items():
        for seed in budget.SEEDS:
            assert budget.best_new(2) is None  # a candidate's mains are still missing
            _finish(budget.main_spec("sst2", seed, method, budget.selected(method)[0]), acc=acc)
    assert budget.best_new(2) == ["fzoo4", "helene_scalar"]
    assert [name for name, _, _ in budget.queue()] == positions
    cr = [s for n, s, _ in budget.queue() if n.startswith("cr:")]
    assert [(s.method, s.split_seed) for s in cr] == [(m, seed) for m in ("adamw_lora", "mezo", "fzoo4",
                                                                         "helene_scalar") for seed in (42, 13)]
    assert cr[0].budget == 300 and cr[0].tests == (300,) and all(s.max_test == 1000 for s in cr)
    nf4 = [s.method for n, s, _ in budget.queue() if n.startswith("sweep:nf4") and s is not None]
    assert nf4 == ["mezo_nf4"] * 3 + ["fzoo4_nf4"] * 3
    after = owners()
    assert all(after[name] == shard for name, shard in mid.items() if name in after)
    assert budget_cli.main(["queue", "--phase", "nf4"]) == 0


def test_the_page_renders_not_yet_run_with_the_queue_then_the_tables(cache, tmp_path):
    page = tmp_path / "page.md"
    assert budget_report.write_report(page)
    text = page.read_text()
    assert "**Not yet run.**" in text and "sst2_k16_s42_fzoo4_plain_lr0.0001_f120_b16_t200_sweep" in text
    assert "--shard $i/2" in text
    _finish_sweeps()
    for method in budget_report.SST2_METHODS:
        for seed in budget.SEEDS:
            accs = {120: 0.72, 300: 0.74, 600: 0.75} if method == "fzoo4" else {120: 0.6, 300: 0.65, 600: 0.7}
            _finish(budget.main_spec("sst2", seed, method, budget.selected(method)[0]), accs=accs)
    budget_report.write_report(page)
    text = page.read_text()
    assert "Not yet run" not in text and (tmp_path / budget_report.PLOT).is_file()
    fzoo = next(line for line in text.splitlines() if line.startswith("| FZOO N=4 |"))
    assert "0.750 ± 0.000" in fzoo and "| 120 (0.20×) |" in fzoo  # reaches MeZO's 0.700 at its first test point
    mezo = next(line for line in text.splitlines() if line.startswith("| MeZO (ZO-SGD) |"))
    assert "| 600 (1.00×) |" in mezo and "| 2.00 |" in mezo
    # nf4: every test point, so an lr that learns early and loses it by the full budget shows both.
    for i, spec in enumerate(budget.sweep_specs("mezo_nf4")):
        _finish(spec, loss=0.5 if i == 1 else 2.0)
    _finish(budget.main_spec("sst2", 42, "mezo_nf4", budget.selected("mezo_nf4")[0]),
            accs={120: 0.67, 300: 0.52, 600: 0.5}, acc=0.5)
    budget_report.write_report(page)
    nf4 = next(line for line in page.read_text().splitlines() if line.startswith("| MeZO (ZO-SGD), nf4"))
    assert "| 0.670 (1 seed) | 0.520 (1 seed) | 0.500 (1 seed) | 0.700 ± 0.000 |" in nf4, nf4


def _memory_record(mode: str, peak: float) -> None:
    (budget.CACHE / f"memory_{mode}.json").write_text(json.dumps({"mode": mode, "peak_rss_mib": peak,
                                                                   "trainable": 134_515_008}))


def test_the_beating_mezo_section_states_the_targets_from_the_results(cache, tmp_path):
    doc = tmp_path / "helene.md"
    markers = "<!-- helene-beating-mezo:begin -->\nstale\n<!-- helene-beating-mezo:end -->"
    doc.write_text(f"# HELENE\n\n## Beating MeZO\n\nintro\n\n{markers}\n\n## Next\n")
    page = tmp_path / "benchmarks" / "helene_budget.md"
    page.parent.mkdir()
    budget_report.write_report(page, doc)
    assert "no verdict yet" in doc.read_text() and "stale" not in doc.read_text()
    _finish_sweeps()
    accs = {"fzoo4": {120: 0.72, 300: 0.74, 600: 0.75},  # reaches MeZO's 0.700 at 120 and ends higher: a win
            "helene_scalar": {120: 0.71, 300: 0.69, 600: 0.68},  # reaches it at 120 but ends lower: not a win
            "mezo": {120: 0.6, 300: 0.65, 600: 0.7}}
    for method in ("fzoo4", "helene_scalar", "mezo"):
        for seed in budget.SEEDS:
            _finish(budget.main_spec("sst2", seed, method, budget.selected(method)[0]), accs=accs[method])
    for mode, peak in (("mezo", 1300.0), ("fzoo4", 1352.0), ("helene_scalar", 1830.0)):
        _memory_record(mode, peak)
    budget_report.write_report(page, doc)
    text = doc.read_text()
    assert text.startswith("# HELENE\n\n## Beating MeZO\n\nintro\n\n<!-- helene-beating-mezo:begin -->")
    assert text.endswith("<!-- helene-beating-mezo:end -->\n\n## Next\n")
    verdict = next(line for line in text.splitlines() if "Target met" in line)
    assert "FZOO N=4 (0.20×, 0.750)" in verdict and "HELENE" not in verdict and "moonshot (≤ 0.2×) met" in verdict
    assert "**0.700**" in text and (page.parent / budget_report.PLOT).is_file()
    assert "- FZOO N=4: peak RSS 1352 MiB = 1.04× MeZO's (target for a stateless one ≤ 1.1×: met); no optimizer" \
           in text
    assert "- HELENE scalar preconditioner: peak RSS 1830 MiB = 1.41× MeZO's; its state: 4 B × 134.5M parameters " \
           "= 513 MiB." in text
    assert "](benchmarks/helene_budget_curves.png)" in text
    doc.write_text("# HELENE\n")
    with pytest.raises(ValueError, match="helene-beating-mezo"):
        budget_report.write_report(page, doc)


def test_the_first_order_check_on_cr_is_a_reference_not_a_contender(cache, tmp_path):
    doc = tmp_path / "helene.md"
    doc.write_text("## Beating MeZO\n\n<!-- helene-beating-mezo:begin -->\n<!-- helene-beating-mezo:end -->\n")
    page = tmp_path / "benchmarks" / "helene_budget.md"
    page.parent.mkdir()
    for seed in budget.SEEDS:  # AdamW-LoRA reaches MeZO's final accuracy in half MeZO's steps
        _finish(budget.main_spec("cr", seed, "adamw_lora", budget.selected("adamw_lora")[0]), acc=0.85)
        _finish(budget.main_spec("cr", seed, "mezo", budget.selected("mezo")[0]), accs={600: 0.8})
    budget_report.write_report(page, doc)
    text = doc.read_text()
    adamw = next(line for line in text.splitlines() if line.startswith("| AdamW LoRA r=8 |"))
    assert "first-order reference" in adamw and "0.50×" not in adamw
    assert "First-order reference AdamW LoRA r=8: 0.850 ± 0.000 after 6 steps" in text
    assert "Target" not in text.split("**CR**")[1]  # no verdict from the reference alone
    assert "besides MeZO has finished both seeds yet" in text.split("**CR**")[1]


def test_the_optimizers_step_through_lightning_with_their_counters(tiny):
    for method in ("helene_scalar", "helene_scalar_bc"):
        spec = _spec(method, 4, (4,))
        opt = runs_mod.optimizer_factory(spec.run_spec())([torch.nn.Parameter(torch.zeros(3))])
        assert opt.preconditioner == "scalar" and opt.bias_correction == (method == "helene_scalar_bc")
    assert runs_mod.OPTIMIZERS["fzoo8"].forwards_per_step == 9


def test_memory_modes_measure_nf4_inference_alone_and_refuse_unknown_modes(tiny):
    pytest.importorskip("bitsandbytes")
    from benchmarks.helene.smollm2 import budget_memory

    record = budget_memory.measure("nf4_inference")
    assert record["quantization"] == "nf4" and record["trainable"] == 0 and record["steps"] == 0
    assert record["peak_rss_mib"] > 0 and record["rss_end_mib"] > 0
    assert record["eval_batch_size"] == record["batch_size"]  # equal batches: the ratio is the optimizer's cost
    trained = budget_memory.measure("fzoo4_nf4", steps=1)
    assert trained["quantization"] == "nf4" and 0 < trained["trainable"] < trained["params"]
    with pytest.raises(ValueError, match="mode must be one of"):
        budget_memory.measure("adamw_full")
