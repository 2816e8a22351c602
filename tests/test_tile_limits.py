"""Tiles Triton cannot build: a located error, never a raw Triton error (issue 26).

Triton holds at most 2^20 elements in one tile; an attention kernel keeps whole head-dim
rows ([BLOCK_M, BLOCK_D], BLOCK_D the head dim's next power of two). Our own block choices
shrink to fit; a hint that does not fit is refused at the hint, and sizes that no block fits
at the kernel. A GPU refusing a hinted launch for its shared memory is refused at the hints.
"""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import diagnostics as diag
from tiledsl.backends.triton import program as triton_program

HINTED = """
@tile(BLOCK_M=64, BLOCK_N=64)
kernel attention(q: f16[M, D], k: f16[N, D], v: f16[N, D]) -> f16[M, D] {
    return softmax(q @ k.T) @ v
}
"""
PLAIN = HINTED.replace("@tile(BLOCK_M=64, BLOCK_N=64)\n", "")


def qkv(m: int, n: int, d: int) -> tuple[torch.Tensor, ...]:
    return (randn(m, d, dtype=torch.float16, scale=0.02), randn(n, d, dtype=torch.float16),
            randn(n, d, dtype=torch.float16))


def test_tile_hint_past_tritons_tile_limit_is_a_located_error():
    fn = tiledsl.compile(HINTED)
    with pytest.raises(diag.TileHintError) as err:
        fn(*qkv(2, 3, 16385))
    assert str(err.value) == (
        "<string>:2:7: error: tile hint BLOCK_M=64 gives the attention kernel k0 a [BLOCK_M, BLOCK_D] "
        "tile of 64 x 32768 = 2097152 elements at this call's sizes (D = 16385, M = 2, N = 3), more "
        "than Triton holds in one tile (1048576 = 2^20); use BLOCK_M <= 32\n"
        "    @tile(BLOCK_M=64, BLOCK_N=64)\n"
        "          ^~~~~~~~~~")


def test_head_dim_no_tile_can_hold_is_a_located_error():
    fn = tiledsl.compile(PLAIN)
    with pytest.raises(diag.TileSizeError) as err:
        fn(*qkv(2, 3, 100_000))
    assert str(err.value).splitlines()[0] == (
        "<string>:3:12: error: at this call's sizes (D = 100000, M = 2, N = 3) the attention kernel "
        "k0 needs a [BLOCK_M, BLOCK_D] tile of 16 x 131072 = 2097152 elements even with its "
        "smallest blocks, more than Triton holds in one tile (1048576 = 2^20)")


def test_default_blocks_shrink_to_fit_a_wide_head_dim():
    """D = 20000 pads to 32768: the interpreter's default 64-row block would hold 2^21."""
    fn, _ = run_checked(PLAIN, *qkv(40, 3, 20000), sm90=False)
    (launch,) = fn.launches
    assert launch.kernel.launch_config(dict(launch.dims), "interpreter").constexprs["BLOCK_M"] == 32


def _refusing_launcher(monkeypatch):
    from triton.runtime.errors import OutOfResources

    def launcher(fn, target):
        def launch(*args, **kwargs):
            raise OutOfResources(262144, 232448, "shared memory")
        return launch

    monkeypatch.setattr(triton_program, "launcher", launcher)


def test_gpu_refusing_a_hinted_launch_names_the_hints(monkeypatch):
    """Triton's OutOfResources at the first launch (simulated: it needs a GPU)."""
    fn = tiledsl.compile(HINTED)
    _refusing_launcher(monkeypatch)
    with pytest.raises(diag.TileHintError) as err:
        fn(*qkv(17, 33, 64))
    assert str(err.value).splitlines()[0] == (
        "<string>:2:7: error: tile hints BLOCK_M=64, BLOCK_N=64 make the attention kernel k0 need "
        "262144 of shared memory, where this GPU has 232448: use smaller blocks or fewer num_stages")


def test_gpu_refusing_a_default_launch_is_an_internal_error(monkeypatch):
    fn = tiledsl.compile(PLAIN)
    _refusing_launcher(monkeypatch)
    with pytest.raises(diag.InternalError, match="needs 262144 of shared memory, where this GPU has "
                                                 "232448 at its default configuration"):
        fn(*qkv(17, 33, 64))
