"""The SmolLM2 HELENE benchmark's queue: phases, shards for parallel processes, device selection and file names.

No model runs here: the queue is a function of the cached result files, which the tests write themselves.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.common.device import lightning_device, parse_shard
from benchmarks.common.paths import REPO
from benchmarks.helene.smollm2 import cli
from benchmarks.helene.smollm2 import grid as helene_llm
from benchmarks.helene.smollm2 import runs as helene_llm_runs


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """An empty result cache, with no lr on record: every optimizer needs its sweep."""
    monkeypatch.setattr(helene_llm_runs, "RUNS", tmp_path)
    monkeypatch.setattr(helene_llm, "PINNED_LR", {})
    return tmp_path


@pytest.fixture
def pinned(runs_dir, monkeypatch):
    """An empty cache with an lr on record for every optimizer (a sweep whose files were lost)."""
    lrs = {m: helene_llm.GRIDS[m][0] for m in helene_llm.PRIORITY}
    monkeypatch.setattr(helene_llm, "PINNED_LR", lrs)
    return lrs


def _finish(spec, losses):
    """Writes a result file for ``spec`` whose last 20 training losses are ``losses``."""
    steps = [{"step": i, "loss": v} for i, v in enumerate(losses)]
    helene_llm_runs.result_path(spec).write_text(json.dumps({"spec": {"lr": spec.lr}, "steps": steps,
                                                             "nonfinite_steps": 0}))


def test_first_phase_is_zero_shot_and_every_sweep_and_main_waits_for_the_sweeps(runs_dir):
    first = helene_llm.phase_specs("first")
    methods = helene_llm.PRIORITY
    # Zero-shot per task, plus one on the sweeps' test subset, then every grid point.
    assert len(first) == len(helene_llm.TASKS) + 1 + sum(len(helene_llm.GRIDS[m]) for m in methods)
    assert {s.method for s in first if s.purpose != "sweep"} == {"zeroshot"}
    assert helene_llm.phase_specs("main") == []
    # Finish every sweep, with the middle lr best for each optimizer: the main grid appears, at those lrs.
    for method in methods:
        for i, spec in enumerate(helene_llm.sweep_specs(method)):
            _finish(spec, [1.0 if i == 1 else 2.0] * 20)
    main = helene_llm.phase_specs("main")
    assert len(main) == len(helene_llm.TASKS) * len(helene_llm.SEEDS) * len(methods)
    assert all(s.steps == helene_llm.MAIN_STEPS and s.lr == helene_llm.GRIDS[s.method][1] for s in main)
    assert {s.task for s in main} == set(helene_llm.TASKS)


def test_an_lr_on_record_skips_its_sweep_and_the_grid_runs_task_then_optimizer_major(pinned):
    assert [s.method for s in helene_llm.phase_specs("first")] == ["zeroshot"] * (len(helene_llm.TASKS) + 1)
    main = helene_llm.phase_specs("main")
    assert all(s.lr == pinned[s.method] for s in main)
    per_task = len(helene_llm.SEEDS) * len(helene_llm.PRIORITY)
    # Every run of the first task (both seeds) comes before any of the second: a partial grid completes a task.
    assert [s.task for s in main] == [t for t in helene_llm.TASKS for _ in range(per_task)]
    # Within a task, both seeds of one optimizer before the next: a partial task gives MeZO's and HELENE's std.
    assert [(s.method, s.split_seed) for s in main[:per_task]] == [(m, seed) for m in helene_llm.PRIORITY
                                                                  for seed in helene_llm.SEEDS]


def test_a_sweep_whose_files_are_present_takes_over_from_the_lr_on_record(pinned):
    specs = helene_llm.base_sweep_specs("mezo")
    _finish(specs[0], [2.0] * 20)
    # Part of the sweep is back: its own selection applies, and waits for the rest of it.
    assert helene_llm.selected_lr("mezo") is None
    assert {s.method for s in helene_llm.phase_specs("main")} == set(helene_llm.PRIORITY) - {"mezo"}
    assert set(specs[1:]) <= set(helene_llm.phase_specs("first"))
    _finish(specs[1], [1.0] * 20)
    _finish(specs[2], [3.0] * 20)
    assert helene_llm.selected_lr("mezo") == specs[1].lr != pinned["mezo"]
    assert helene_llm.selected_lr("helene") == pinned["helene"]


def test_a_non_finite_sweep_point_is_never_selected(runs_dir):
    specs = helene_llm.sweep_specs("mezo")
    _finish(specs[0], [3.0] * 20)
    _finish(specs[1], [2.0] * 20)
    _finish(specs[2], [float("nan")] * 20)  # the top diverged: the best (middle) is inside the grid, no extension
    assert helene_llm.sweep_specs("mezo") == specs
    assert helene_llm.selected_lr("mezo") == specs[1].lr


def test_a_sweep_whose_best_is_on_an_edge_extends_a_decade_at_a_time(runs_dir):
    grid = helene_llm.GRIDS["mezo"]
    base = helene_llm.sweep_specs("mezo")
    for spec, loss in zip(base, (3.0, 2.0, 1.0)):  # the largest lr is best: the optimum is not bracketed
        _finish(spec, [loss] * 20)
    first = helene_llm.sweep_specs("mezo")[len(grid):]
    assert [s.lr for s in first] == [pytest.approx(grid[-1] * 10)]
    assert helene_llm.selected_lr("mezo") is None  # selection waits for the extension
    queue = [s for s, _ in helene_llm.queue() if s is not None]
    assert queue.index(first[0]) > max(queue.index(s) for m in helene_llm.PRIORITY
                                       for s in helene_llm.base_sweep_specs(m))  # appended: no shard shifts
    _finish(first[0], [0.5] * 20)  # still best at the edge: one more decade, then the cap
    second = helene_llm.sweep_specs("mezo")[len(grid):]
    assert [s.lr for s in second] == [pytest.approx(grid[-1] * 10), pytest.approx(grid[-1] * 100)]
    _finish(second[1], [0.4] * 20)
    assert len(helene_llm.sweep_specs("mezo")) == len(grid) + helene_llm.MAX_EXTENSIONS
    assert helene_llm.selected_lr("mezo") == pytest.approx(grid[-1] * 100)


def test_a_sweep_whose_smallest_lr_is_best_extends_downwards(runs_dir):
    grid = helene_llm.GRIDS["helene"]
    for spec, loss in zip(helene_llm.sweep_specs("helene"), (1.0, 2.0, 3.0)):
        _finish(spec, [loss] * 20)
    (low,) = helene_llm.sweep_specs("helene")[len(grid):]
    assert low.lr == pytest.approx(grid[0] / 10)
    _finish(low, [1.5] * 20)  # worse than the grid's smallest: bracketed, selection is that smallest
    assert helene_llm.sweep_specs("helene")[len(grid):] == [low]
    assert helene_llm.selected_lr("helene") == grid[0]


@pytest.mark.parametrize("count", [1, 2, 6, 40])
def test_shards_split_a_phase_without_overlap(runs_dir, count):
    specs = helene_llm.phase_specs("first")
    shares = [[s for i, s in enumerate(specs) if i % count == k] for k in range(count)]
    assert sorted(s.run_id for share in shares for s in share) == sorted(s.run_id for s in specs)
    assert len({s.run_id for s in specs}) == len(specs)


@pytest.mark.parametrize("text", ["3", "2/2", "-1/4", "a/b", "1/0"])
def test_bad_shard_is_a_one_line_error(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def test_device_selection_and_measurement_files(monkeypatch):
    monkeypatch.setattr(helene_llm_runs, "DEVICE", "cpu")
    helene_llm_runs.set_device("auto")
    assert helene_llm_runs.DEVICE == ("cuda" if torch.cuda.is_available() else "cpu")
    helene_llm_runs.set_device("cpu")
    assert helene_llm_runs.measurement_file("memory", "inference") == "memory_inference.json"
    assert helene_llm_runs.measurement_file("speed") == "speed.json"
    assert helene_llm_runs.device_name().startswith("cpu")
    with pytest.raises(ValueError, match="expected cpu, cuda, cuda:N or auto"):
        helene_llm_runs.set_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            helene_llm_runs.set_device("cuda")
    assert lightning_device("cpu") == {"accelerator": "cpu", "devices": 1}
    assert lightning_device("cuda:1") == {"accelerator": "gpu", "devices": [1]}
    monkeypatch.setattr(helene_llm_runs, "DEVICE", "cuda")
    assert helene_llm_runs.measurement_file("memory", "inference") == "memory_cuda_inference.json"
    assert helene_llm_runs.measurement_file("speed") == "speed_cuda.json"


def _finish_all_but(skip=()):
    """Zero-shot and every base sweep point finished (middle lr best, so no extension), except ``skip``."""
    for spec in helene_llm.zero_shot_specs():
        if spec not in skip:
            _finish(spec, [1.0] * 20)
    for method in helene_llm.PRIORITY:
        for i, spec in enumerate(helene_llm.base_sweep_specs(method)):
            if spec not in skip:
                _finish(spec, [1.0 if i == 1 else 2.0] * 20)


@pytest.mark.parametrize("count", [2, 3, 6])
def test_an_extension_keeps_its_shard_whatever_order_the_sweeps_finish_in(runs_dir, count):
    owners = []
    for order in (("mezo", "helene"), ("helene", "mezo")):
        for f in runs_dir.iterdir():
            f.unlink()
        _finish_all_but()
        for method in order:  # the top lr best: each of the two grows an extension, in this order
            for spec, loss in zip(helene_llm.base_sweep_specs(method), (3.0, 2.0, 1.0)):
                _finish(spec, [loss] * 20)
        shares = [helene_llm.shard_members("first", (k, count)) for k in range(count)]
        ids = [s.run_id for share in shares for s in share]
        assert len(ids) == len(set(ids)) == len(helene_llm.phase_specs("first"))  # a partition, no overlap
        owners.append({s.run_id: k for k, share in enumerate(shares) for s in share})
    assert owners[0] == owners[1]
    for method in ("mezo", "helene"):
        (ext,) = helene_llm.extension_specs(method)
        assert owners[0][ext.run_id] == helene_llm.PRIORITY.index(method) % count


def test_a_shard_with_nothing_left_waits_for_an_extension_that_falls_to_it(runs_dir, monkeypatch):
    top = helene_llm.base_sweep_specs("helene")[-1]
    _finish_all_but(skip=[top])
    assert top in helene_llm.shard_members("first", (0, 2))  # another shard is running HELENE's top point
    executed, sleeps = [], []

    def other_shard_finishes(seconds):  # meanwhile that shard finishes it, and it is the best: an extension appears
        sleeps.append(seconds)
        if len(sleeps) == 2:
            _finish(top, [0.5] * 20)

    def execute(spec):
        executed.append(spec.run_id)
        _finish(spec, [0.9] * 20)  # worse than 0.5: bracketed, the sweep is complete
        return {"test_acc": 0.5, "seconds": 1.0}

    monkeypatch.setattr(cli.time, "sleep", other_shard_finishes)
    monkeypatch.setattr(cli, "execute", execute)
    cli.run_queue(None, "first", (1, 2), write_page=False, poll_seconds=1.0)
    (extension,) = helene_llm.extension_specs("helene")
    assert executed == [extension.run_id] and len(sleeps) == 2
    assert helene_llm.selected_lr("helene") == top.lr


def test_a_shard_gives_up_waiting_when_no_sweep_point_finishes(runs_dir, monkeypatch):
    top = helene_llm.base_sweep_specs("helene")[-1]
    _finish_all_but(skip=[top])  # its owner crashed: the point never finishes
    sleeps = []
    monkeypatch.setattr(cli.time, "sleep", sleeps.append)
    cli.run_queue(None, "first", (1, 2), write_page=False, poll_seconds=10.0, max_wait=60.0)
    assert sum(sleeps) == 60.0


def test_a_sweep_that_diverged_everywhere_says_so(runs_dir):
    for spec in helene_llm.base_sweep_specs("zoadam"):
        _finish(spec, [float("inf")] * 20)
    assert helene_llm.selected_lr("zoadam") is None and helene_llm.sweep_diverged("zoadam")
    reasons = [why for spec, why in helene_llm.queue() if spec is None and " zoadam:" in why]
    assert reasons and all("every point of its lr sweep diverged" in why for why in reasons)


def test_the_result_cache_is_not_git_ignored():
    """The grid spans sessions and only committed files survive one: a result file must not be ignored."""
    import shutil
    import subprocess

    repo = REPO
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    probe = helene_llm_runs.RUNS.relative_to(repo) / "a_run.json"
    done = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=repo, check=False)
    assert done.returncode == 1, f"{probe} is git-ignored (see .gitignore)"


def test_follow_ups_come_after_the_core_grid_at_the_lr_they_borrow_and_leave_core_shards_alone(pinned):
    queue = helene_llm.queue()
    specs = [s for s, _ in queue if s is not None]
    follow = helene_llm.phase_specs("followup")
    assert [(s.task, s.method, s.split_seed) for s in follow] == [
        (t, m, seed) for m in helene_llm.FOLLOW_UPS for t in helene_llm.FOLLOW_UP_TASKS for seed in helene_llm.SEEDS]
    assert specs[-len(follow):] == follow  # last: no core run changes position, so no core run changes shard
    assert all(s.lr == pinned[helene_llm.FOLLOW_UPS[s.method]] and s.steps == helene_llm.MAIN_STEPS for s in follow)
    main = helene_llm.phase_specs("main")
    assert not set(main) & set(follow) and {s.method for s in main} == set(helene_llm.PRIORITY)
    assert set(helene_llm.phase_specs("all")) == set(specs)
    # Each follow-up builds the optimizer it names.
    opt = helene_llm_runs.optimizer_factory(follow[0])([torch.nn.Parameter(torch.zeros(2))])
    assert opt.perturbation == "rademacher" and type(opt).__name__ == "ZOSGD"


def test_follow_ups_wait_for_the_sweep_whose_lr_they_borrow(runs_dir):
    assert helene_llm.phase_specs("followup") == []
    waiting = [why for s, why in helene_llm.queue() if s is None and "mezo_rademacher" in why]
    assert waiting and all("waits for mezo's lr sweep" in why for why in waiting)


def test_each_registered_optimizer_builds_and_the_page_reads_its_entry():
    from benchmarks.helene.smollm2 import report

    expected = {"mezo": "ZOSGD", "mezo_rademacher": "ZOSGD", "zoadam": "ZOAdam", "helene": "Helene",
                "helene_anneal": "Helene", "adamw_lora": "AdamW"}
    # The equal-forward-pass comparison's optimizers (benchmarks.helene.smollm2.budget), each also on nf4.
    added = {"fzoo4": "FZOO", "fzoo8": "FZOO", "helene_scalar": "Helene", "helene_scalar_bc": "Helene",
             "hizoo": "Helene"}
    nf4 = {f"{m}_nf4": expected.get(m) or added[m] for m in ("mezo", "mezo_rademacher", "zoadam", *added)}
    forwards = {"fzoo4": 5, "fzoo8": 9, "hizoo": 2.1}
    expected = {**expected, **added, **nf4}
    assert set(helene_llm_runs.OPTIMIZERS) == set(expected)
    for method, entry in helene_llm_runs.OPTIMIZERS.items():
        spec = helene_llm_runs.RunSpec("sst2", 42, method, lr=1e-3, steps=1)
        params = [torch.nn.Parameter(torch.zeros(3))]
        opt = helene_llm_runs.optimizer_factory(spec)(params)
        assert type(opt).__name__ == expected[method]
        assert entry.zeroth_order == (method in helene_llm_runs.ZO_METHODS) == (method != "adamw_lora")
        assert entry.quantization == ("nf4" if method in nf4 else "none")
        assert report.NAMES[method] == entry.label
        assert entry.forwards_per_step == forwards.get(method.removesuffix("_nf4"), 2 if entry.zeroth_order else 1)
    assert helene_llm_runs.METHODS[0] == "zeroshot" and set(helene_llm_runs.METHODS[1:]) == set(expected)
    with pytest.raises(ValueError, match="method: no optimizer 'fzoo'"):
        helene_llm_runs.optimizer_factory(helene_llm_runs.RunSpec("sst2", 42, "fzoo", lr=1e-3, steps=1))
