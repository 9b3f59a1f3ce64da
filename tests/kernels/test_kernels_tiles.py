"""Tile choice for the GPU launches: pure integer logic, checked without a GPU."""

from __future__ import annotations

import pytest

from peftplug_kernels._tiles import block_tile, fit_tiles

H200 = 132


@pytest.mark.parametrize(
    ("tokens", "n", "bb", "expected"),
    [
        (4096, 4096, 32, (128, 128, 8)),  # large: the base tiles already give 1024 programs
        (1, 4096, 32, (16, 32, 4)),  # decoding: no 128-token padding, 128 programs of 32 outputs
        (256, 4096, 32, (128, 32, 8)),  # 2 token tiles × 128 output tiles ≥ 132 programs
        (16, 4096, 64, (16, 32, 8)),  # a 64-wide rotation block keeps its 8 warps (4 spilled on sm_90)
        (256, 14336, 32, (128, 128, 8)),  # wide layer: 2 × 112 programs with the base tiles already
    ],
)
def test_fit_tiles_fills_the_device(tokens, n, bb, expected):
    got = fit_tiles(128, 128, 8, tokens, n, H200, bb)
    assert got == expected
    block_t, block_n, _ = got
    programs = -(-tokens // block_t) * -(-n // block_n)
    assert programs >= H200 or block_n == 32  # either the device is full or the output tile is at its floor
    assert block_t >= 16 and block_n >= 32  # tl.dot needs every dimension >= 16


def test_block_tile_pads_to_a_power_of_two():
    assert [block_tile(b) for b in (4, 12, 16, 24, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
