"""Tile choice for the GPU launches: pure integer logic, checked without a GPU."""

from __future__ import annotations

from peftplug_kernels._tiles import block_tile


def test_block_tile_pads_to_a_power_of_two():
    assert [block_tile(b) for b in (4, 12, 16, 24, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
