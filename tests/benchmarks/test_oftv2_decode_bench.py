"""The decode study (benchmarks/oftv2/decode.py) at its tiniest size: every configuration, base and task timed (the
run itself stops if the cached and uncached OFTv2 rows' logits differ beyond rounding), and ``--report`` rebuilding the
page from the result alone."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")


def test_quick_run_writes_the_result_and_the_report_rebuilds_the_page(tmp_path):
    from benchmarks.oftv2 import decode
    from oftv2 import rotation_cache

    page = tmp_path / "oftv2_decode.md"
    assert decode.main(["--quick", "--out", str(page)]) == 0
    assert rotation_cache.ENABLED  # the uncached row switches the cache off only for its own calls
    record = json.loads(page.with_name("oftv2_decode.decode.json").read_text())
    assert set(record["bases"]) == set(decode.BASES)  # fp32 and NF4 (bitsandbytes 4-bit runs on CPU)
    for result in record["bases"].values():
        assert set(result["timed"]) == set(decode.TASKS)
        assert result["cached_vs_uncached"]["max_logit_diff"] <= 1e-4
        assert all(set(row) == set(decode.CONFIGS) and all(r["cpu_s"] > 0 for r in row.values())
                   for row in result["timed"].values())
    text = page.read_text()
    assert text.count("| generate |") == len(decode.BASES) * len(decode.CONFIGS)
    assert all(f"## {heading}" in text for _, _, heading in decode.BASES.values())
    assert text.count("For scale, rounding alone") == len(decode.BASES)
    page.unlink()
    decode.main(["--report", "--out", str(page)])
    assert page.read_text() == text
    with pytest.raises(SystemExit, match="no result file"):
        decode.main(["--report", "--out", str(tmp_path / "none.md")])


def test_unknown_configuration_is_refused():
    from benchmarks.oftv2 import decode

    with pytest.raises(ValueError, match="config must be one of"):
        decode.build("IA3", "fp32", quick=True)
    with pytest.raises(ValueError, match="base must be one of"):
        decode.build("LoRA r16", "int3", quick=True)


def test_a_cache_that_changes_the_output_stops_the_run(monkeypatch):
    from benchmarks.oftv2 import decode
    from oftv2 import layer

    real = layer.cached_rotation
    # Wrong blocks (half the rotation): the cached row no longer computes the uncached row's rotation.
    monkeypatch.setattr(layer, "cached_rotation", lambda *args: real(*args) * 0.5)
    with pytest.raises(RuntimeError, match="logits differ by"):
        decode.measure_base("fp32", decode.parse_args(["--quick"]))
