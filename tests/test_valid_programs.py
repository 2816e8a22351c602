"""Valid programs that once stopped the compiler with an internal error.

Each compiles, runs and meets the design section 5 oracle. The class behind
most of them: constants and scalar expressions (`rsqrt(2) * N`) shared by
several ops, which are now cloned into every kernel that reads them.
"""

import pytest
import torch

from helpers import randn, run_checked


def test_where_of_one_constant_twice():
    fn, out = run_checked("kernel k(x: f32[M, N]) -> f32[M, N] { return where(x > 0.0, 1.0, 1.0) }",
                          randn(17, 113))
    assert torch.equal(out, torch.ones(17, 113))
    assert len(fn.kernels) == 1


def test_where_of_a_folded_constant_under_a_mask():
    m = randn(17, 33) > 0
    _, out = run_checked("kernel k(x: f32[M, N], m: bool[M, N]) -> f32[M, N] "
                         "{ return where(m, log2(1.0), 0.0) }", randn(17, 33), m)
    assert torch.equal(out, torch.zeros(17, 33))  # log2(1) is 0 on both sides


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 33, 113)])
def test_a_constant_shared_by_a_prologue_and_an_epilogue(m, k, n):
    fn, _ = run_checked("""
    kernel k(a: bf16[M, K], b: bf16[K, N]) -> bf16[M, N] {
        t1 = cast((a * 2.0) @ cast(b, f32), f16)
        return where(t1 > 0.0, cast(2, f32), 0.0)
    }""", randn(m, k, dtype=torch.bfloat16), randn(k, n, dtype=torch.bfloat16))
    assert [k.template for k in fn.kernels] == ["matmul"]


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113)])
def test_a_scalar_expression_read_by_two_kernels(m, n):
    fn, _ = run_checked("""
    kernel k(m: bool[M, N], y: f32[M, N], w: f16) -> (f32[M, N], f32[M, N]) {
        t0 = rsqrt(2) * N
        t2 = minimum(where(m, N, 0.0), minimum(w, N))
        return -maximum(N, t0 - -y), y / logsumexp(t2, keepdims=true) - t0
    }""", randn(m, n) > 0, randn(m, n), 0.75)
    assert sorted(k.template for k in fn.kernels) == ["pointwise", "rows"]
    # rsqrt(2) * N (rsqrt folded to a constant) is cloned into both kernels
    assert all(any(op.kind == "mul" and op.shape == () for op in k.ops) for k in fn.kernels)


def test_a_scalar_expression_is_never_a_kernel_of_its_own():
    fn, _ = run_checked("""
    kernel k(x: f32[M, N], s: f32) -> (f32[M, N], f32[M, N]) {
        t = s * 2.0 + N
        return sum(x, keepdims=true) * t + x, softmax(x) * t
    }""", randn(17, 33), s=0.5)
    assert [k.template for k in fn.kernels] == ["rows", "rows"]


def test_a_returned_scalar_expression_is_stored():
    fn, (a, b) = run_checked("""
    kernel k(x: f32[M, N], s: f32) -> (f32[M, N], f32) {
        t = s * 2.0 + N
        return x * t, t
    }""", randn(17, 33), s=0.5)
    assert b.shape == () and b.item() == 34.0


def test_a_smaller_value_used_inside_and_outside_a_pointwise_group():
    fn, _ = run_checked("""
    kernel k(x: f32[M, N], y: f32[N]) -> (f32[M, N], f32[N]) {
        u = exp(y) * 2.0
        return x * u, u
    }""", randn(17, 33), randn(33))
