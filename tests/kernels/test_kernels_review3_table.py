"""Third review: a hand-edited per-device dispatch table entry is read with a one-line ``ValueError`` naming what
it accepts, never a ``KeyError`` or a ``TypeError`` from a QOFT forward."""

from __future__ import annotations

import dataclasses

import pytest

from peftplug_kernels import dispatch_table


def test_an_entry_missing_an_op_is_a_value_error(monkeypatch):
    entry = dispatch_table.TABLE["cpu"]
    choices = {op: c for op, c in entry.choices.items() if op != "block_rotate"}
    monkeypatch.setitem(dispatch_table.TABLE, "cpu", dataclasses.replace(entry, choices=choices))
    with pytest.raises(ValueError, match="has no choice for op 'block_rotate'") as err:
        dispatch_table.kernel_choice("block_rotate", "cpu")
    assert "('torch', 'triton')" in str(err.value) and "\n" not in str(err.value)
    assert dispatch_table.kernel_choice("cayley_neumann", "cpu") == "torch"  # the other ops still read


def test_an_unknown_kernel_in_an_entry_is_a_value_error(monkeypatch):
    entry = dispatch_table.TABLE["cpu"]
    choices = {**entry.choices, "dequantize_4bit": dispatch_table.Choice("Triton", "hand-edited")}
    monkeypatch.setitem(dispatch_table.TABLE, "cpu", dataclasses.replace(entry, choices=choices))
    with pytest.raises(ValueError, match=r"must be one of \('torch', 'triton'\), got 'Triton'"):
        dispatch_table.kernel_choice("dequantize_4bit", "cpu")


@pytest.mark.parametrize("tokens", [-1, "16", 8.0, None, True])
def test_a_hand_edited_threshold_is_checked_when_read(monkeypatch, tokens):
    entry = dispatch_table.TABLE["cpu"]
    monkeypatch.setitem(dispatch_table.TABLE, "cpu", dataclasses.replace(entry, fused_nf4_max_tokens=tokens))
    with pytest.raises(ValueError, match="fused_nf4_max_tokens of 'cpu' must be an integer >= 0") as err:
        dispatch_table.fused_nf4_max_tokens("cpu")
    assert repr(tokens) in str(err.value)


def test_valid_thresholds_read_unchanged(monkeypatch):
    entry = dispatch_table.TABLE["cpu"]
    for tokens in (0, 64):
        monkeypatch.setitem(dispatch_table.TABLE, "cpu", dataclasses.replace(entry, fused_nf4_max_tokens=tokens))
        assert dispatch_table.fused_nf4_max_tokens("cpu") == tokens
