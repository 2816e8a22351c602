"""The reference kernels of benchmarks/references (after Triton's tutorials) compute what they
claim, through Triton's interpreter at awkward sizes against float64 torch, and
benchmarks/static_sm90.py compares their sm_90 builds with tiledsl's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import randn

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from references import attention, layernorm, matmul, softmax  # noqa: E402


def scores(q, k, scale, causal, cap=None):
    s = q.double() @ k.double().transpose(-1, -2) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if causal:  # top-left aligned: query i sees keys j <= i
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


@pytest.mark.parametrize("M, N, causal", [(65, 65, True), (113, 113, False), (113, 65, True)])
def test_attention_forward_matches_float64(M, N, causal):
    """f16 only: Triton's interpreter multiplies bf16 dot operands as raw bits."""
    q, k, v = (randn(2, 3, L, 64, dtype=torch.float16) for L in (M, N, N))
    o, lse = attention.attention(q, k, v, 0.125, causal)
    s = scores(q, k, 0.125, causal)
    want = torch.softmax(s, -1) @ v.double()
    assert (o.double() - want).abs().max().item() < 5e-3
    # the base-2 log-sum-exp of each row, for the backward
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0)).double(), atol=1e-4)


@pytest.mark.parametrize("L, causal", [(65, True), (113, False)])
def test_attention_backward_matches_float64_autograd(L, causal):
    q, k, v, do = (randn(1, 2, L, 64, dtype=torch.float16) for _ in range(4))
    o, lse = attention.attention(q, k, v, 0.125, causal)
    dq, dk, dv = attention.attention_backward(q, k, v, o, lse, do, 0.125, causal)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    (torch.softmax(scores(leaves[0], leaves[1], 0.125, causal), -1) @ leaves[2]).backward(do.double())
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert (got.double() - leaf.grad).abs().max().item() < 1e-2


def test_softcap_forward_compiles_to_one_tanh_per_score():
    """The inline-asm tanh cannot run in the interpreter: the soft-capped build is checked on
    its sm_90 SASS instead, one MUFU per score more than the plain build's hottest loop."""
    from references.sm90 import report

    plain = report(attention.forward_build(256, 256, 64, torch.bfloat16, True, False))["loop"]
    capped = report(attention.forward_build(256, 256, 64, torch.bfloat16, True, True))["loop"]
    assert capped["mma"] == plain["mma"] and capped["work"] == plain["work"]
    assert capped["mufu"] - plain["mufu"] == plain["work"] // (plain["warps"] * 32)


def test_matmul_matches_float64():
    a, b = randn(113, 64, dtype=torch.float16), randn(65, 64, dtype=torch.float16)
    c = matmul.matmul(a, b)
    assert c.dtype is torch.float16
    assert torch.allclose(c.double(), a.double() @ b.double().T, atol=2e-2, rtol=1e-3)


def test_fp8_matmul_scales_rows_and_columns():
    a, b = randn(113, 64).to(torch.float8_e4m3fn), randn(65, 64).to(torch.float8_e4m3fn)
    rows, cols = randn(113).abs() + 0.5, randn(65).abs() + 0.5
    c = matmul.matmul(a, b, rows, cols)
    want = (a.double() @ b.double().T) * rows.double()[:, None] * cols.double()[None, :]
    assert c.dtype is torch.bfloat16
    assert torch.allclose(c.double(), want, rtol=2 ** -7, atol=1e-2)  # within a bf16 ulp


@pytest.mark.parametrize("N", [17, 113])
def test_softmax_matches_float64(N):
    x = randn(9, N, scale=4.0)
    assert torch.allclose(softmax.softmax(x, 0.7).double(), torch.softmax(x.double() / 0.7, -1), atol=1e-6)


def test_layer_norm_matches_float64():
    x, w, b = randn(17, 113, dtype=torch.float16), randn(113, dtype=torch.float16), randn(113, dtype=torch.float16)
    want = torch.nn.functional.layer_norm(x.double(), (113,), w.double(), b.double(), 1e-5)
    assert (layernorm.layer_norm(x, w, b, 1e-5).double() - want).abs().max().item() < 1e-2


def test_static_sm90_pairs_tiledsl_softmax_with_the_reference():
    import static_sm90

    (case,) = [c for c in static_sm90.cases() if c.name == "softmax f32 N=4096"]
    (row,) = static_sm90.rows(case)
    assert row["role"] == "rows"
    for side in ("tiledsl", "reference"):
        loop = row[side]["report"]["loop"]
        assert loop["source"] == "sass" and loop["instructions"] > 0 and loop["work"] > 0, (side, loop)
        assert loop["work_unit"] == "element" and row[side]["instructions"] > 0 and row[side]["cycles"] > 0
    assert row["ratio"]["cycles"] == row["tiledsl"]["cycles"] / row["reference"]["cycles"]
    assert row["tiledsl"]["over_shared"] == [] and static_sm90.line(row).startswith("softmax f32 N=4096 ")
