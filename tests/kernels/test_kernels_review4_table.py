"""Fourth review of the dispatch table's helpers: ``evidence`` of an entry missing an op is the one-line
``ValueError`` that ``kernel_choice`` gives (a ``KeyError`` before), and ``add_device_kind`` does not copy another
entry over a kind already measured (``"cuda:sm_90"``: the H200's measured choices were replaced silently)."""

from __future__ import annotations

import dataclasses

import pytest

from peftplug_kernels import dispatch_table


def test_evidence_of_an_entry_missing_an_op_is_a_value_error(monkeypatch):
    entry = dispatch_table.TABLE["cpu"]
    choices = {op: c for op, c in entry.choices.items() if op != "block_rotate"}
    monkeypatch.setitem(dispatch_table.TABLE, "cpu", dataclasses.replace(entry, choices=choices))
    with pytest.raises(ValueError, match="entry 'cpu' has no choice for op 'block_rotate'"):
        dispatch_table.evidence("block_rotate", "cpu")
    assert dispatch_table.evidence("cayley_neumann", "cpu") == entry.choices["cayley_neumann"].evidence


def test_a_measured_kind_is_not_replaced(monkeypatch):
    measured = dispatch_table.TABLE["cuda:sm_90"]
    with pytest.raises(ValueError, match="'cuda:sm_90' is already in the table; override its ops with set_choice"):
        dispatch_table.add_device_kind("cuda:sm_90")
    assert dispatch_table.TABLE["cuda:sm_90"] is measured
