"""The overhead study (benchmarks/oftv2/overhead*.py) at its tiniest size: per-layer timing and op counts of every
method (block 32 and, through ``--extra-blocks``, block 8), eager and compiled, and the whole-model step ratio,
written and rendered into a page that ``--report`` rebuilds from the result files alone; the op counter against
counts worked out by hand. One quick run of both parts, shared by the tests that read it (each compile of a
method costs seconds; the checks do not depend on which test paid for it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")


def test_kernel_count_of_a_frozen_linear_layer_is_the_hand_count():
    from benchmarks.oftv2.overhead import build, fwd_bwd
    from benchmarks.oftv2.overhead_ops import count_ops, top_kernels

    # y = x Wᵀ, loss = sum(y): forward linear (its one mm) + sum; backward: the seed gradient (fill), sum's backward
    # (an expand: a view), mm for x's gradient; W is frozen, so no second mm. Views and allocations are not kernels.
    x = torch.randn(4, 32, requires_grad=True)
    run = fwd_bwd(build("base", 32, 1), x)
    run()
    assert dict(top_kernels(run)) == {"aten::linear": 1, "aten::sum": 1, "aten::fill_": 1, "aten::mm": 1}
    counts = count_ops(run)
    assert counts["kernels"] == 4 and counts["aten"] > counts["aten_top"] >= counts["kernels"] - 1
    # LoRA adds its two matmuls forward and their gradients: more kernels per layer, and two parameters' grads.
    lora = fwd_bwd(build("LoRA r16", 32, 1), x)
    lora()
    assert count_ops(lora)["kernels"] > counts["kernels"] + 4


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``--quick`` run of both parts with block 8 measured beside block 32, labelled ``baseline``: returns its
    results folder and the page as that run rendered it (tests that change the folder work on a copy)."""
    from benchmarks.oftv2 import overhead

    root = tmp_path_factory.mktemp("overhead")
    out, page = root / "results", root / "oftv2_overhead.md"
    assert overhead.main(["--quick", "--extra-blocks", "8", "--label", "baseline", "--out-dir", str(out),
                          "--page", str(page)]) == 0
    return out, page.read_text()


def test_quick_run_writes_both_parts_and_the_report_rebuilds_the_page(quick_run, tmp_path):
    from benchmarks.oftv2 import overhead, overhead_llm, overhead_report

    # Without --extra-blocks a run measures METHODS exactly; this one adds block 8 (checked in the next test).
    assert overhead.methods(()) == overhead.METHODS and overhead.parse_args(["--quick"]).extra_blocks == []
    measured = overhead.methods((8,))
    out, page = tmp_path / "results", tmp_path / "oftv2_overhead.md"
    shutil.copytree(quick_run[0], out)
    layers = json.loads((out / "baseline_layers.json").read_text())
    smollm2 = json.loads((out / "baseline_smollm2.json").read_text())
    summary = layers["widths"]["32"]["summary"]
    assert set(summary) == {"eager", "compiled"} and all(set(s) == set(measured) for s in summary.values())
    for mode in ("eager", "compiled"):
        rows = summary[mode]
        assert rows["base"]["added_ops_per_layer"]["kernels"] == 0
        # Every adapter adds kernels to a layer, in both modes; compiled, the graph has no break.
        assert all(rows[m]["added_ops_per_layer"]["kernels"] > 0 for m in measured[1:])
        assert all(rec["samples_us"] and min(rec["samples_us"]) > 0 for rec in layers["widths"]["32"]["raw"][mode].values())
    assert all(r["dynamo"]["graph_breaks"] == 0 for r in layers["widths"]["32"]["raw"]["compiled"].values())
    assert set(smollm2["timed"]) == {f"{a} {m}" for a in overhead_llm.ADAPTERS for m in ("eager", "compiled")}
    assert "OFTv2 b32 stacked" in overhead_llm.ADAPTERS
    assert smollm2["timed"]["OFTv2 b32 compiled"]["dynamo"]["graphs"] >= 1
    text = quick_run[1]
    assert "| eager | OFTv2 b32 |" in text and "| SmolLM2 step, compiled |" in text and "## Run `baseline`" in text
    assert text.count("| not met |") + text.count("| met |") == len(overhead_report.ratios(overhead_report.load(out)["baseline"]))
    # A second label joins the first as another column; --report renders the same page from the files alone.
    (out / "final_layers.json").write_text((out / "baseline_layers.json").read_text())
    (out / overhead_report.NOTES).write_text("## What the runs show\n\nwritten by hand\n")
    overhead.main(["--report", "--out-dir", str(out), "--page", str(page)])
    text = page.read_text()
    assert "| `baseline` | `final` |" in text and text.index("## Run `baseline`") < text.index("## Run `final`")
    # `final` measured no SmolLM2 step: those rows' verdicts come from `baseline`, and say so.
    assert "| SmolLM2 step, compiled | " in text
    smollm2_row = next(line for line in text.splitlines() if line.startswith("| SmolLM2 step, compiled |"))
    assert smollm2_row.endswith("(`baseline`) |") and "met" in smollm2_row
    assert text.index("| OFTv2 / LoRA r16 |") < text.index("written by hand") < text.index("## Run `baseline`")
    page.unlink()
    overhead.main(["--report", "--out-dir", str(out), "--page", str(page)])
    assert page.read_text() == text
    with pytest.raises(SystemExit, match="no result files"):
        overhead.main(["--report", "--out-dir", str(tmp_path / "none"), "--page", str(page)])


def test_ab_worker_and_table():
    from benchmarks.oftv2 import overhead_ab

    # The worker (what each process of a tree runs), here in this process: every method adds a positive time.
    added = overhead_ab.worker(width=32, layers=1, tokens=2, rounds=3, iters=3)
    assert set(added) == set(overhead_ab.METHODS[1:]) and all(t > 0 for t in added.values()), added
    runs = {"before": [{"LoRA r16": 10.0, "OFTv2 b32": 30.0}, {"LoRA r16": 20.0, "OFTv2 b32": 40.0}],
            "after": [{"LoRA r16": 10.0, "OFTv2 b32": 15.0}, {"LoRA r16": 20.0, "OFTv2 b32": 30.0}]}
    rows = overhead_ab.summarize(["before", "after"], runs)
    # Median of the processes' added times; mean of their ratios to LoRA, min–max beside it.
    assert "| `before` | OFTv2 b32 | 35 | 2.500 (2.000–3.000) |" in rows
    assert "| `after` | OFTv2 b32 | 22 | 1.500 (1.500–1.500) |" in rows
    assert not any("stacked" in row for row in rows)  # a method missing from a run is left out


def test_extra_block_sizes_are_measured_beside_block_32_and_join_the_targets_table(quick_run):
    from benchmarks.oftv2 import overhead, overhead_report

    out, text = quick_run
    record = json.loads((out / "baseline_layers.json").read_text())
    assert record["settings"]["extra_blocks"] == [8]
    rows = record["widths"]["32"]["summary"]["eager"]
    assert list(rows) == ["base", "OFTv2 b32", "OFTv2 b32 stacked", "OFTv2 b8", "OFTv2 b8 stacked", "LoRA r16",
                          "PEFT OFT b32"]
    # Block 8 holds a quarter of block 32's parameters per layer (b - 1 per feature / 2): the adapter really differs.
    model = overhead.build("OFTv2 b8", 32, 1)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 32 * 7 // 2
    ratios = overhead_report.ratios(overhead_report.load(out)["baseline"])
    assert "eager µs / layer, width 32, block 8" in ratios and "compiled kernels / layer, width 32, block 8 (stacked rotations)" in ratios
    assert "| eager | OFTv2 b8 stacked |" in text


def test_step_ops_quick_run_splits_each_step_by_op(tmp_path):
    from benchmarks.oftv2 import overhead_report, step_ops

    assert step_ops.main(["--quick", "--label", "t", "--out-dir", str(tmp_path), "--order", "LoRA r16",
                          "OFTv2 b32"]) == 0
    record = json.loads((tmp_path / "step_ops_t.json").read_text())
    assert list(record["adapters"]) == ["LoRA r16", "OFTv2 b32"]
    lora, oft = record["adapters"]["LoRA r16"]["ops"], record["adapters"]["OFTv2 b32"]["ops"]
    # LoRA's adapters are extra plain products; OFTv2's are batched ones (the series and the block rotation).
    assert lora["aten::mm"]["calls"] > oft["aten::mm"]["calls"]
    assert "aten::bmm" in oft and "aten::bmm" not in lora
    assert all(r["median_step_cpu_s"] > 0 for r in record["adapters"].values())
    assert overhead_report.load(tmp_path) == {}  # not a run of the overhead page


def test_step_flops_quick_run_counts_the_adapters_products_by_hand(tmp_path):
    from benchmarks.common.llama import llama
    from benchmarks.oftv2 import step_flops

    assert step_flops.main(["--quick", "--label", "t", "--out-dir", str(tmp_path),
                            "--adapters", "OFTv2 b16", "OFTv2 b32", "LoRA r16"]) == 0
    record = json.loads((tmp_path / "step_flops_t.json").read_text())
    lora = record["adapters"]["LoRA r16"]["by_op"]
    # The quick model: one decoder layer, width 64; batch 1 × 8 tokens; OFTv2 blocks of 16 and 32 (default 5 series
    # terms), LoRA r16, each on every linear layer of the block (not the LM head).
    cfg, tokens, r = llama(64, 1, 128).config, 8, 16
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, inter), "up": (h, inter),
              "down": (inter, h)}
    # q, k and v read the first layer's normed embeddings, which need no gradient: their input gradient is skipped.
    first = {"q", "k", "v"}
    for b in (16, 32):
        oft = record["adapters"][f"OFTv2 b{b}"]["by_op"]
        # Per layer: 7 block products of the series (3 forward, 4 backward) and the rotation's x R, g Rᵀ, xᵀ g.
        series = sum(7 * 2 * (i // b) * b**3 for i, _ in shapes.values())
        rotation = sum((2 if name in first else 3) * 2 * tokens * i * b for name, (i, _) in shapes.items())
        assert oft["aten.bmm"] + oft["aten.baddbmm"] == series + rotation, b
    # LoRA r16: A and B forward, their weight gradients and their input gradients (A's skipped where x needs none);
    # OFTv2 instead needs the frozen products' input gradients there too, for its rotations' gradients.
    lora_products = sum((6 * i + 6 * o - (2 * i if name in first else 0)) * tokens * r
                        for name, (i, o) in shapes.items())
    extra_frozen = sum(2 * tokens * i * o for name, (i, o) in shapes.items() if name in first)
    assert lora["aten.mm"] - record["adapters"]["OFTv2 b32"]["by_op"]["aten.mm"] == lora_products - extra_frozen
    assert "aten.bmm" not in lora and lora["aten._scaled_dot_product_flash_attention_for_cpu"] > 0  # attention counted
    totals = {name: rec["total"] for name, rec in record["adapters"].items()}
    assert record["summary"]["OFTv2 b32 / LoRA r16"]["total"] == pytest.approx(totals["OFTv2 b32"] / totals["LoRA r16"])
    assert set(record["summary"]) == {"OFTv2 b16 / LoRA r16", "OFTv2 b32 / LoRA r16"}


def test_layer_split_runs_the_functions_own_forward_and_backward(tmp_path):
    from benchmarks.oftv2 import layer_split
    from peftplug_kernels.cayley_rotate.function import CayleyRotateFunction

    # The stand-in context runs the very computation autograd runs: same output, same gradients.
    x = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    q_vec = (0.05 * torch.randn(2, 32 * 31 // 2, dtype=torch.float64)).requires_grad_(True)
    grad = torch.randn(8, 64, dtype=torch.float64)
    out = CayleyRotateFunction.apply(x, q_vec, 32, 5, None)
    out.backward(grad)
    ctx = layer_split._Context()
    plain = CayleyRotateFunction.forward(ctx, x.detach(), q_vec.detach(), 32, 5, None)
    with torch.no_grad():  # as autograd runs a backward
        grad_x, grad_q = CayleyRotateFunction.backward(ctx, grad)[:2]
    torch.testing.assert_close(plain, out.detach())
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_q, q_vec.grad)

    assert layer_split.main(["--quick", "--label", "t", "--out-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "layer_split_t.json").read_text())
    assert list(record["depths"]) == ["2", "4"]
    for rec in record["depths"].values():
        assert set(rec["us_per_layer"]) == {*layer_split.STACKS, layer_split.BODIES}
        assert rec["added_over_lora"]["LoRA r16"] == pytest.approx(1.0)
        assert all(us > 0 for us in rec["us_per_layer"].values())
