"""Pointwise programs by rows of the last axis (`pointwise.FlatProgram._tiled`): a tile of
BLOCK_R positions of the last axis by BLOCK_O of the axis most inputs are broadcast along,
the other axes one position a program, where the rows fill most of the tile; flat
otherwise. The same numbers either way (the oracle, awkward sizes), built for sm_90."""

from __future__ import annotations

import pytest

import tiledsl
from helpers import randn, run_checked

ROTATE = """kernel f(x: f32[B, H, S, D], c: f32[B, S, D], s: f32[B, S, D]) -> f32[B, H, S, D] {
    return x * c[:, None] + concat(-x[..., D // 2:], x[..., :D // 2], axis=-1) * s[:, None]
}"""


def config(fn):
    (launch,) = fn.launches
    return launch.kernel.launch_config(dict(launch.dims), "cuda").constexprs


@pytest.mark.parametrize("b, h, s, d, tiled", [(2, 5, 3, 113, True), (1, 17, 1, 16, True),
                                               (3, 1, 7, 128, True), (2, 3, 5, 17, False),
                                               (1, 1, 1, 2, False)])
def test_rotate_half_by_rows_of_heads(b, h, s, d, tiled):
    """The tables are broadcast along the heads: a tile's rows are heads of one token."""
    x, c, sn = randn(b, h, s, d), randn(b, s, d, seed=1), randn(b, s, d, seed=2)
    fn, _ = run_checked(ROTATE, x, c, sn)
    cfg = config(fn)
    assert cfg["TILED"] == int(tiled)
    if tiled:
        assert cfg["BLOCK_O"] == min(32, 1 << (h - 1).bit_length()) and cfg["BLOCK_R"] >= d


@pytest.mark.parametrize("shape", [(17, 113), (1, 64), (113, 16), (3, 5, 7, 32)])
def test_a_broadcast_chain_with_views_by_rows(shape):
    """Transposed and broadcast inputs read through their strides at the tile's indices."""
    x = randn(*shape)
    y = randn(shape[-1], seed=1)
    z = randn(*shape[:-1], 1, seed=2)
    src = (f"kernel f(x: f32[{', '.join(f'D{i}' for i in range(len(shape)))}], y: f32[D{len(shape) - 1}], "
           f"z: f32[{', '.join(f'D{i}' for i in range(len(shape) - 1))}, 1]) -> "
           f"f32[{', '.join(f'D{i}' for i in range(len(shape)))}] {{ return tanh(x * y) - z * flip(x, axis=-1) }}")
    run_checked(src, x, y, z)


def test_a_row_read_alike_along_the_tile_is_loaded_once_a_program():
    """cos and sin of RoPE, broadcast along the heads, load as one row of the tile (`cmask`):
    the build's loads of them are BLOCK_R wide, not BLOCK_O * BLOCK_R."""
    fn = tiledsl.compile(ROTATE)
    fn(randn(1, 32, 4, 128), randn(1, 4, 128, seed=1), randn(1, 4, 128, seed=2))
    source = fn.kernels[0].source
    assert "mask=cmask" in source and "if TILED:" in source


@pytest.mark.parametrize("shape", [(0, 128), (3, 0, 128), (0, 5, 64)])
def test_an_empty_axis_launches_nothing(shape):
    """A tensor with no elements (the tile axis or another of size 0): no program runs, the
    result is empty (the launch divided by the empty axis's size)."""
    fn = tiledsl.compile(f"kernel f(x: f32[{', '.join(f'D{i}' for i in range(len(shape)))}], "
                         f"y: f32[D{len(shape) - 1}]) -> f32[{', '.join(f'D{i}' for i in range(len(shape)))}] "
                         "{ return x * y + flip(x, axis=-1) }")
    out = fn(randn(*shape), randn(shape[-1], seed=1))
    assert out.shape == shape
