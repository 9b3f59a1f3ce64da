"""The decode study (benchmarks/oftv2/decode.py) at its tiniest size: every configuration and task timed, the cached
and uncached OFTv2 rows generating the same tokens, and ``--report`` rebuilding the page from the result alone."""

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
    assert record["same_tokens"] is True
    assert set(record["timed"]) == set(decode.TASKS)
    assert all(set(row) == set(decode.CONFIGS) and all(r["cpu_s"] > 0 for r in row.values())
               for row in record["timed"].values())
    text = page.read_text()
    assert text.count("| generate |") == len(decode.CONFIGS) and "| eval forward | OFTv2 b32 |" in text
    page.unlink()
    decode.main(["--report", "--out", str(page)])
    assert page.read_text() == text
    with pytest.raises(SystemExit, match="no result file"):
        decode.main(["--report", "--out", str(tmp_path / "none.md")])


def test_unknown_configuration_is_refused():
    from benchmarks.oftv2 import decode

    with pytest.raises(ValueError, match="config must be one of"):
        decode.build("IA3", quick=True)
