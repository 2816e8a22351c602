"""Fusion coverage on the programs of issue 12: never more kernels than a hand-written version.

Each test asserts the kernel count (and which template runs what) and the numerics against
the float64 oracle (`helpers.run_checked`) on awkward sizes.
"""

from __future__ import annotations

import pytest
import torch

from helpers import SIZES, randn, run_checked


def templates(fn) -> list[str]:
    return [k.template for k in fn.kernels]


# --- recompute instead of materialise -------------------------------------------------------


def test_a_scalar_expression_is_computed_inside_the_gemm():
    fn, _ = run_checked("kernel f(a: f32[M, K], b: f32[N, K]) -> f32[M, N] { return a @ b.T * rsqrt(K) }",
                        randn(17, 33), randn(113, 33))
    assert templates(fn) == ["matmul"]
    assert "fusions not made: none" in fn.explain()


@pytest.mark.parametrize("n", SIZES)
def test_a_cheap_smaller_producer_is_recomputed_in_its_reader(n):
    fn, _ = run_checked("kernel f(t: f32[M, N], y: f32[N], x: f32[M, N]) -> f32[M, N] {\n"
                        "    return tanh(t) + sqrt(abs(y)) * sigmoid(x)\n}",
                        randn(17, n), randn(n), randn(17, n))
    assert templates(fn) == ["pointwise"]
    assert "rewrites:\n  [recompute] fused: sqrt (line 2) -> mul (line 2)" in fn.explain()


@pytest.mark.parametrize("src, template", [
    ("kernel f(x: f32[M, N], b: f32[N]) -> f32[M, N] { return softmax(x + sqrt(abs(b)), axis=-1) }",
     "rows"),
    ("kernel f(x: f32[M, N], b: f32[M, 1]) -> f32[M] { return sum(x * sigmoid(b), axis=-1) }", "rows"),
])
def test_recomputed_values_in_row_programs(src, template):
    for m, n in ((1, 1), (17, 113)):
        b = randn(n) if "b: f32[N]" in src else randn(m, 1)
        fn, _ = run_checked(src, randn(m, n), b)
        assert templates(fn) == [template]


def test_a_recomputed_bias_in_a_gemm_epilogue():
    for m, n, k in ((1, 1, 1), (17, 113, 33)):
        fn, _ = run_checked("kernel f(a: f16[M, K], w: f16[K, N], b: f32[N]) -> f16[M, N] {\n"
                            "    return a @ w + exp(b) * 0.5\n}",
                            randn(m, k, dtype=torch.float16), randn(k, n, dtype=torch.float16), randn(n))
        assert templates(fn) == ["matmul"]


@pytest.mark.parametrize("m", SIZES)
def test_document_mask_with_broadcast_ids_is_one_attention_kernel(m):
    src = """kernel f(q: f16[H, M, D], k: f16[H, N, D], v: f16[H, N, D], dq: i32[M, 1],
             dk: i32[1, N]) -> f16[H, M, D] {
    s = q @ k.T * rsqrt(D)
    s = where(dq == dk, s, -inf)
    return softmax(s) @ v
}"""
    n = m + 16
    h = lambda *s: randn(*s, dtype=torch.float16)  # noqa: E731
    ids = torch.sort(torch.randint(0, 3, (n,))).values.to(torch.int32)
    fn, _ = run_checked(src, h(2, m, 32), h(2, n, 32), h(2, n, 32), ids[:m, None].contiguous(),
                        ids[None, :])
    assert templates(fn) == ["attention"]
