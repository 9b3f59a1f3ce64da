"""An interrupted zeroth-order benchmark run resumes from its journal and ends exactly where an uninterrupted run
ends: same per-step losses, validation points and test numbers, bit for bit (tiny Llama on the real RTE k-shot
split, one-character label words for its char tokenizer)."""

from __future__ import annotations

import json

import pytest

from benchmarks.helene.smollm2 import runs as helene_llm_runs
from benchmarks.helene.smollm2.runs import RunSpec, execute, result_path


class Interrupted(Exception):
    """Stands for the process being stopped right after a journal write."""


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch, data_dir):
    from peftplug import prompt_cls

    monkeypatch.setattr(helene_llm_runs, "MODEL", "tiny:llama")
    monkeypatch.setenv("PEFTPLUG_DATA_DIR", str(data_dir))
    monkeypatch.setattr(helene_llm_runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(helene_llm_runs, "PARTIAL", tmp_path / "partial")
    monkeypatch.setattr(helene_llm_runs, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(helene_llm_runs, "FLUSH_EVERY", 2)
    base = prompt_cls.PromptClassificationData

    class OneCharWords(base):
        def __init__(self, task, **kwargs):
            super().__init__(task, template="{premise}|{hypothesis}?{answer}", label_words=["y", "n"], **kwargs)

    monkeypatch.setattr(prompt_cls, "PromptClassificationData", OneCharWords)
    return tmp_path


def _spec(method: str) -> RunSpec:
    return RunSpec("rte", 13, method, lr=1e-2, steps=6, eval_every=2, batch_size=4, max_test=8, max_length=256)


def _interrupted(monkeypatch, spec: RunSpec, steps: int):
    """Runs ``spec`` until the journal write after ``steps`` steps, stops it there, returns (path, journal)."""
    write = helene_llm_runs._write_json

    def write_then_stop(path, data):
        write(path, data)
        if path.parent == helene_llm_runs.PARTIAL and len(data["journal"]) == steps:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(helene_llm_runs, "_write_json", write_then_stop)
        with pytest.raises(Interrupted):
            execute(spec)
    path = helene_llm_runs.partial_path(helene_llm_runs.PARTIAL, spec.run_id)
    return path, json.loads(path.read_text())


def _same_run(a: dict, b: dict) -> None:
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert a["closure_values"] == b["closure_values"]  # every L+ and L− after the resume, bit for bit
    assert a["val"] == b["val"]
    assert (a["test_acc"], a["test_loss"], a["nonfinite_steps"]) == (b["test_acc"], b["test_loss"],
                                                                      b["nonfinite_steps"])


@pytest.mark.parametrize("method", ["mezo", "helene"])
def test_an_interrupted_run_resumes_from_its_journal_bit_for_bit(tiny_bench, monkeypatch, method):
    spec = _spec(method)
    whole = execute(spec)
    assert len(whole["steps"]) == 6 and "segments" not in whole
    assert len(whole["closure_values"]) == 6 and all(len(v) == 2 for v in whole["closure_values"])
    assert not helene_llm_runs.partial_path(helene_llm_runs.PARTIAL, spec.run_id).exists()
    result_path(spec).unlink()

    _, journal = _interrupted(monkeypatch, spec, steps=4)
    assert len(journal["journal"]) == len(journal["steps"]) == 4 and not result_path(spec).exists()
    assert all(len(values) == 2 for values in journal["journal"])  # L+ and L− per step

    resumed = execute(spec)
    _same_run(resumed, whole)
    assert [s["from_step"] for s in resumed["segments"]] == [0, 4]
    assert resumed["started"] == resumed["segments"][0]["started"] < resumed["segments"][1]["started"]
    assert not helene_llm_runs.partial_path(helene_llm_runs.PARTIAL, spec.run_id).exists()


def test_a_journal_that_does_not_replay_is_dropped_and_the_run_starts_over(tiny_bench, monkeypatch):
    spec = _spec("mezo")
    whole = execute(spec)
    result_path(spec).unlink()
    path, journal = _interrupted(monkeypatch, spec, steps=4)
    journal["journal"][0][0] += 1.0  # a different L+ at step 1: the replayed step-2 validation cannot match
    path.write_text(json.dumps(journal))

    again = execute(spec)
    _same_run(again, whole)
    assert "segments" not in again and not path.exists()


def test_a_journal_of_other_settings_or_another_device_is_not_replayed(tiny_bench, monkeypatch):
    spec = _spec("mezo")
    path, journal = _interrupted(monkeypatch, spec, steps=2)
    settings = dict(journal["spec"])
    assert journal["device"] == "cpu" and helene_llm_runs.load_partial(path, settings, "cpu") is not None
    assert helene_llm_runs.load_partial(path, settings, "cuda") is None  # z is drawn by the device's generator
    assert helene_llm_runs.load_partial(path, {**settings, "lr": 1e-3}, "cpu") is None
    path.write_text(json.dumps({**journal, "spec": {**settings, "lr": 1e-3}}))
    assert "segments" not in execute(spec)  # not replayed: the run started over
    assert not path.exists()


def test_a_replayed_validation_point_matches_up_to_summation_order_only():
    from benchmarks.helene.smollm2.journal import same_point

    point = {"step": 25, "acc": 0.6875, "loss": 0.6501554250717163}
    assert same_point(point, dict(point))
    assert same_point(point, {**point, "loss": point["loss"] * (1 + 1e-7)})  # another thread count's sum order
    assert not same_point(point, {**point, "loss": point["loss"] * (1 + 1e-3)})  # one ZO step's worth
    assert not same_point(point, {**point, "acc": 0.71875})
    assert not same_point(point, {**point, "step": 50})
    nan = {**point, "loss": float("nan")}
    assert same_point(nan, dict(nan)) and not same_point(point, nan)
