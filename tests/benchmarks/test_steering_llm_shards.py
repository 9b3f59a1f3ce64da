"""benchmarks/steering/llm.py on a tiny model (CPU): shards partition the plan, vectors stay in one shard, and
``--no-score`` then ``--rescore`` gives the same results as a scored run (the real wedding-word scorer)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.steering import llm as bench


def test_shards_partition_the_plan_with_shared_vectors_together():
    plan = bench.settings_in_order([10, 15], [1.0, 2.0, 4.0], extra_layer=6)
    for n in (1, 2, 3, 6, 7, 60):
        shard = bench.shard_of(plan, n)
        assert set(shard) == {s.key for s in plan} and all(0 <= i < n for i in shard.values())
        for s in plan:
            if s.layer is None:
                assert shard[s.key] == 0  # the baselines (and the facts baseline they need) in shard 0
            else:  # every setting with this vector lands in the same shard
                assert {shard[t.key] for t in plan if (t.method, t.layer) == (s.method, s.layer)} == {shard[s.key]}
    loads = [list(bench.shard_of(plan, 6).values()).count(i) for i in range(6)]
    assert max(loads) - min(loads) <= 6 and min(loads) > 0
    assert bench.parse_shard("2/6") == (2, 6)
    for bad in ("6/6", "-1/2", "x", "1/0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shard(bad)


@pytest.fixture
def tiny_llm(monkeypatch, tiny_model, tokenizer):
    import peftplug.loading

    monkeypatch.setattr(peftplug.loading, "load_model", lambda name, **kw: tiny_model(seed=0))
    monkeypatch.setattr(peftplug.loading, "load_tokenizer", lambda name, **kw: tokenizer)


def _run(data_dir, out, doc, *extra):
    argv = ["--data-dir", str(data_dir), "--out-dir", str(out), "--doc", str(doc), "--concept", "weddings",
            "--device", "cpu", "--layers", "0", "--extra-layer", "1", "--multipliers", "2", "--prompts", "3",
            "--pairs", "4", "--new-tokens", "4", "--batch", "8", "--train-steps", "1", "--overhead-rounds", "1",
            *extra]
    assert bench.main(argv) == 0


def _load(root):
    return {p.stem: json.loads(p.read_text()) for p in sorted((root / "results").glob("*.json"))}


def test_no_score_shards_then_rescore_equal_a_scored_run(tiny_llm, data_dir, tmp_path):
    _run(data_dir, tmp_path / "a", tmp_path / "a.md")
    for i in range(3):
        _run(data_dir, tmp_path / "b", tmp_path / "b.md", "--no-score", "--shard", f"{i}/3")
    plan = bench.settings_in_order([0], [2.0], 1)
    a, b = _load(tmp_path / "a" / "weddings"), _load(tmp_path / "b" / "weddings")
    assert set(a) == set(b) == {s.key for s in plan}
    assert all(not r["scored"] and r["classifier"] is None and "positive_rate" not in r and "scores" not in r
               for r in b.values())
    assert (tmp_path / "b" / "weddings" / "overhead.json").is_file()
    assert not (tmp_path / "b.md").exists()  # unscored / sharded runs write no report
    # An unscored result is never shown as a score.
    _run(data_dir, tmp_path / "b", tmp_path / "b.md", "--report-only")
    assert "not scored yet" in (tmp_path / "b.md").read_text() and "Nothing is scored yet" in (
        tmp_path / "b.md").read_text()
    _run(data_dir, tmp_path / "b", tmp_path / "b.md", "--rescore")
    b = _load(tmp_path / "b" / "weddings")
    timing = {"seconds", "tokens_per_second"}
    for key, r in a.items():
        assert set(r) == set(b[key]), key
        assert r["scored"] and b[key]["scored"] and r["classifier"] == b[key]["classifier"]
        for field in set(r) - timing:
            assert json.dumps(r[field]) == json.dumps(b[key][field]), (key, field)
    text = (tmp_path / "b.md").read_text()
    assert "not scored yet" not in text and "wedding word" in text
