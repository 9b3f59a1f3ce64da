"""benchmarks/steering/llm.py without a model: the run order, the budgets, and the report from cached results."""

from __future__ import annotations

import json

import pytest

from benchmarks.steering import llm as bench
from benchmarks.steering import llm_report as report


def test_settings_order_puts_every_method_early_and_both_directions():
    plan = bench.settings_in_order([10, 15], [2.0, 4.0, 8.0], extra_layer=6)
    keys = [s.key for s in plan]
    assert keys[:3] == ["unsteered", "prompt_pos", "prompt_neg"]
    first = keys[3:3 + 2 * len(bench.VECTOR_METHODS)]  # every method at the main layer, middle multiplier, ± both
    assert {k.split("_L")[0] for k in first} == set(bench.VECTOR_METHODS)
    assert all("_L10_" in k and k.endswith(("+4", "-4")) for k in first)
    assert len(keys) == len(set(keys)) == 3 + 2 * 3 * 2 * len(bench.VECTOR_METHODS) + 2 * 3
    assert keys[-1].startswith("caa_L6_")


def _result(key, method, positive_rate, ppl, kept, layer=None, multiplier=0.0):
    direction = 0 if multiplier == 0 else (1 if multiplier > 0 else -1)
    return {"key": key, "method": method, "layer": layer, "multiplier": multiplier, "direction": direction,
            "positive_rate": positive_rate, "concept_mean": positive_rate, "perplexity": ppl,
            "total_perplexity": ppl, "fluency": 5.0, "distinct_1": 0.7, "distinct_2": 0.9, "distinct_3": 0.95,
            "instruction_kept": kept, "instruction_base_accuracy": 0.8, "instruction_answers": ["x"] * 5,
            "mean_new_tokens": 38.0, "seconds": 50.0, "n_prompts": 40, "max_new_tokens": 40,
            "generations": ["Great day!", "Nice.", "Fine."]}


def test_report_picks_the_best_setting_inside_the_budgets(tmp_path):
    root = tmp_path / "sst2"
    (root / "results").mkdir(parents=True)
    plan = bench.settings_in_order([10], [4.0, 8.0], extra_layer=None)
    rows = [
        _result("unsteered", "unsteered", 0.5, 10.0, 1.0),
        _result("prompt_pos", "prompt", 0.7, 11.0, 1.0, multiplier=1.0),
        _result("caa_L10_+4", "caa", 0.85, 11.5, 0.95, 10, 4.0),   # inside: +0.35
        _result("caa_L10_+8", "caa", 0.99, 30.0, 0.95, 10, 8.0),   # larger shift, perplexity ratio 3: outside
        _result("caa_L10_-4", "caa", 0.1, 11.9, 0.9, 10, -4.0),    # inside: -0.40
        _result("pca_center_L10_+4", "pca_center", 0.9, 11.0, 0.5, 10, 4.0),  # instruction lost: outside
    ]
    for r in rows:
        (root / "results" / f"{r['key']}.json").write_text(json.dumps(r))
    base = rows[0]
    best = report.best_settings(report.load_results(root), base)
    assert best[("caa", 1)][0]["key"] == "caa_L10_+4" and best[("caa", -1)][0]["key"] == "caa_L10_-4"
    assert ("pca_center", 1) not in best and best[("prompt", 1)][1]["delta"] == pytest.approx(0.2)
    doc = tmp_path / "doc.md"
    report.write_report(root, plan, doc, {"pairs": 64, "train_steps": 24, "train_lr": 0.05})
    text = doc.read_text()
    assert "**+0.350**" in text and "**-0.400**" in text
    assert "more positive: **met** (+0.350); more negative: **met** (-0.400)." in text
    assert "caa_L10_+8 ✗" in text and "## Not run yet" in text and "`vector_prompt_L10_+4`" in text
    assert "on at least one axis (shift, perplexity or kept): CAA" in text
    assert (tmp_path / "doc.png").stat().st_size > 1000


def test_goal_line_says_when_the_unsteered_rate_leaves_no_room():
    base = {"positive_rate": 0.875}

    def derived(delta):
        return {"delta": delta, "ppl_ratio": 1.05, "kept": 1.0}

    best = {("caa", 1): ({}, derived(0.125)), ("caa", -1): ({}, derived(-0.4)), ("pca_center", 1): ({}, derived(0.05))}
    [goal] = report._verdict(best, {}, base)
    assert goal == ("Goal ±0.3 (best vector setting inside the budgets): more positive: cannot be met on these prompts "
                    "(the unsteered rate 0.875 leaves 0.125); best +0.125 — the bound itself; more negative: **met** "
                    "(-0.400).")
    best[("caa", -1)] = ({}, derived(-0.2))
    assert "more negative: **not met** (-0.200)" in report._verdict(best, {}, base)[0]
