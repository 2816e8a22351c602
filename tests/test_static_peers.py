"""benchmarks/static_peers.py: our side of each op compiled for sm_90 without a GPU, measured
as the peer's is. The peer's kernels (Liger-Kernel 0.8.5) are an optional dependency; the
comparison itself runs where it is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import static_peers  # noqa: E402


def op(name):
    (found,) = [o for o in static_peers.ops() if o.name == name]
    return found


def test_our_rmsnorm_backward_moves_the_bytes_of_the_design():
    """One split row program (its combine the second launch) reading dY and x once and
    writing dx: 6 bytes an element as designed, the weight read once a chunk of rows (not a
    row), the forward's mean of squares once a row, no spills."""
    side = static_peers.ours(op("RMSNorm backward"))
    assert side["launches"] == 2 and side["spills"] == 0
    assert side["design_bytes"] == pytest.approx(6.0, abs=0.01)
    assert side["code_bytes"] < 6.3


def test_our_rope_forward_reads_each_element_once_and_the_tables_once_a_token():
    """Rotate-half's halves are one gather of q at the partner position; a tile runs over the
    heads of one token (the axis cos and sin are broadcast along), so they are read as a row
    each, not an element each: about 6 bytes an element of loads and stores (q, its partner
    and the store; the design's 4 B read and write each once)."""
    side = static_peers.ours(op("RoPE forward"))
    assert side["launches"] == 1 and side["spills"] == 0
    assert side["design_bytes"] == pytest.approx(4.06, abs=0.01)
    assert side["code_bytes"] < 6.5
    (kernel,) = side["kernels"]
    assert kernel["config"]["M0_TILED"] == 1 and kernel["config"]["M0_BLOCK_O"] == 32


def test_our_rope_backward_is_one_launch_without_scatters():
    side = static_peers.ours(op("RoPE backward"))
    assert side["launches"] == 1 and side["spills"] == 0
    assert side["design_bytes"] == pytest.approx(4.06, abs=0.01)


def test_the_comparison_with_liger():
    pytest.importorskip("liger_kernel", reason="Liger-Kernel 0.8.5 (optional: pip install -e \".[peers]\")")
    norm = op("RMSNorm backward")
    a, b = static_peers.ours(norm), static_peers.peer(norm)
    (text, _) = static_peers.lines(norm.name, a, b)
    assert text.startswith("RMSNorm backward") and b["spills"] == 0 and b["launches"] == 2
    assert a["time_us"] / b["time_us"] < 1.15
