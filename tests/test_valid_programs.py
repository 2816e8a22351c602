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
    assert [k.template for k in fn.kernels] == ["merged"]  # a pointwise and a row program
    # rsqrt(2) * N (rsqrt folded to a constant) is cloned into both members
    assert sum(op.kind == "mul" and op.shape == () for op in fn.kernels[0].ops) == 2


def test_a_scalar_expression_is_never_a_kernel_of_its_own():
    fn, _ = run_checked("""
    kernel k(x: f32[M, N], s: f32) -> (f32[M, N], f32[M, N]) {
        t = s * 2.0 + N
        return sum(x, keepdims=true) * t + x, softmax(x) * t
    }""", randn(17, 33), s=0.5)
    assert [k.template for k in fn.kernels] == ["rows"]  # both row programs, merged


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


SHARED = "x: f16[M, N], w: f16[N, N], s: f32"


@pytest.mark.parametrize("body, templates", [
    ("return maximum(softmax(x @ w.T * rsqrt(N), axis=-1) @ w, abs(rsqrt(N)))", ["attention"]),
    ("return softmax((x * rsqrt(N)) @ w.T * rsqrt(N)) @ w", ["attention"]),
    ("return softmax(x @ (w * (s + N)).T * (s + N)) @ w * (s + N)", ["attention"]),
    ("return softmax(where(causal(x), x @ w.T * rsqrt(N), -inf)) @ (w * rsqrt(N))", ["pointwise", "attention"]),
    ("return relu((x * (s * 2.0)) @ w) + s * 2.0", ["matmul"]),
    ("return sum(x * rsqrt(N), keepdims=true) * rsqrt(N) + x * rsqrt(N)", ["rows"]),
])
def test_a_scalar_expression_read_in_several_places_of_one_kernel(body, templates):
    # found by the program fuzzer: the epilogue of an attention kernel reading a scalar the
    # score modification also reads
    fn, _ = run_checked(f"kernel f({SHARED}) -> f16[M, N] {{\n    {body}\n}}",
                        randn(33, 33, dtype=torch.float16), randn(33, 33, dtype=torch.float16), 0.3)
    assert [k.template for k in fn.kernels] == templates


def test_a_constant_shared_by_an_attention_epilogue_and_its_logsumexp():
    fn, _ = run_checked(f"""
    kernel f({SHARED}) -> (f16[M, N], f32[M]) {{
        t = softmax(x @ w.T * 0.5, axis=-1) @ w
        return t * 0.5, logsumexp(x @ w.T * 0.5) + 0.5
    }}""", randn(17, 33, dtype=torch.float16), randn(33, 33, dtype=torch.float16), 0.3)
    # the logsumexp's `+ 0.5`, one value per row, is the attention kernel's too (stored per row)
    assert [k.template for k in fn.kernels] == ["attention"]


def test_or_of_a_scalar_comparison_and_a_mask():
    # Triton's interpreter cannot `|` a 0-d comparison result: and/or are selects
    fn, _ = run_checked("""
    kernel f(x: f32[M, N], mask: bool[M, N], s: f32) -> f32[M, N] {
        return where(((0.5 == (s + N)) | mask) & (s < x), x, -inf)
    }""", randn(17, 33), randn(17, 33) > 0, -0.25)


def test_an_explicit_cast_to_the_same_half_dtype_still_rounds():
    # found by the program fuzzer: canonicalize dropped cast(x - s, bf16) of a bf16 value,
    # but kernels hold x - s in f32, so the cast is where the program rounds
    x = randn(17, 113, dtype=torch.bfloat16)
    fn, out = run_checked("kernel f(x: bf16[M, N], s: f32) -> f32[M, N] { return cast(x - s, bf16) }", x, 0.3)
    assert torch.equal(out, (x.float() - 0.3).bfloat16().float())
