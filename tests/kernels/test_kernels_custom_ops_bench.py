"""The two CPU studies behind the dispatch design (benchmarks/kernel_dispatch) at tiny sizes: they run, count what
they claim to count and render their tables."""

from __future__ import annotations

from benchmarks.kernel_dispatch import batched_cayley


def test_batched_cayley_counts_and_agrees():
    result = batched_cayley.measure(layers=3, blocks=2, block=8, terms=3, rounds=1)
    per, bat = result["per layer"], result["batched"]
    assert per["max_grad_diff"] == 0.0 and bat["max_grad_diff"] == 0.0  # same gradients either way
    assert bat["launches"] < per["launches"] and bat["ops"] < per["ops"]
    assert result["triton_launches"] == {"per layer": 6, "batched": 4}
    assert "| batched / per layer |" in batched_cayley.table(result)


def test_dispatch_overhead_runs(monkeypatch, capsys):
    # The study installs stand-in kernel modules where the Triton ones load and marks the forced kernel verified on
    # CPU: both are put back afterwards, so later tests see the real kernels and the interpreter check.
    import sys

    from benchmarks.kernel_dispatch import dispatch_overhead
    from peftplug_kernels import _triton_available, ops

    for name in ("peftplug_kernels.block_rotate.triton", "peftplug_kernels.cayley_neumann.triton"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
    monkeypatch.setattr(ops, "_TRITON_OK", set())
    monkeypatch.setattr(_triton_available, "_LOADED", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch_overhead.main(["--rounds", "1", "--calls", "2", "--no-write"])
    out = capsys.readouterr().out
    assert "| block_rotate fwd+bwd: custom op |" in out
    assert "| cayley_neumann fwd |" in out
