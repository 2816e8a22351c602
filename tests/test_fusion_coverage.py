"""Fusion coverage on the programs of issue 12: never more kernels than a hand-written version.

Each test asserts the kernel count (and which template runs what) and the numerics against
the float64 oracle (`helpers.run_checked`) on awkward sizes.
"""

from __future__ import annotations

import pytest
import torch

import tiledsl
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


# --- attention: epilogue, output layout, logsumexp -------------------------------------------


def half(*shape):
    return randn(*shape, dtype=torch.float16)


@pytest.mark.parametrize("m", SIZES)
def test_gated_attention_is_one_kernel(m):
    src = """kernel f(q: f16[H, M, D], k: f16[H, N, D], v: f16[H, N, D], g: f16[H, M, D]) -> f16[H, M, D] {
    o = softmax(q @ k.T * rsqrt(D)) @ v
    return o * sigmoid(g)
}"""
    fn, _ = run_checked(src, half(2, m, 32), half(2, m + 5, 32), half(2, m + 5, 32), half(2, m, 32))
    assert templates(fn) == ["attention"]
    assert "epilogue: sigmoid (line 3), mul (line 3)" in fn.explain()


@pytest.mark.parametrize("m", SIZES)
def test_permuted_attention_output_is_stored_by_the_kernel(m):
    src = """kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, M, H, D] {
    o = softmax(q @ k.T * rsqrt(D)) @ v
    return transpose(o, 1, 2)
}"""
    fn, out = run_checked(src, half(2, 3, m, 32), half(2, 3, 40, 32), half(2, 3, 40, 32))
    assert templates(fn) == ["attention"]
    assert out.shape == (2, m, 3, 32) and out.is_contiguous()
    assert "kernel @k0 attention(%q, %0, %1, %v) : f16[B, H, M, D] stored (0, 2, 1, 3)" in fn.ir("fused")


def test_a_returned_transpose_of_a_gemm_or_row_result_is_stored_transposed():
    fn, out = run_checked("kernel f(a: f32[B, M, K], b: f32[B, K, N]) -> f32[M, B, N] {\n"
                          "    return transpose(a @ b, 0, 1)\n}", randn(2, 17, 33), randn(2, 33, 113))
    assert templates(fn) == ["matmul"] and out.is_contiguous()
    fn, (t, s) = run_checked("kernel f(a: f32[M, N]) -> (f32[N, M], f32[M, N]) {\n"
                             "    s = softmax(a, axis=0)\n    return transpose(s, 0, 1), s * 2.0\n}",
                             randn(17, 113))
    assert templates(fn) == ["rows"] and t.is_contiguous() and s.is_contiguous()


def test_a_returned_transpose_of_a_pointwise_result_is_copied():
    # the pointwise template stores at a flat index: the transpose is its own copy kernel
    fn, out = run_checked("kernel f(a: f32[M, N]) -> f32[N, M] { return transpose(exp(a), 0, 1) }",
                          randn(17, 113))
    assert templates(fn) == ["pointwise", "pointwise"] and out.is_contiguous()


@pytest.mark.parametrize("m", SIZES)
def test_attention_with_an_f32_logsumexp_is_one_kernel(m):
    src = """kernel f(q: f16[H, M, D], k: f16[H, N, D], v: f16[H, N, D]) -> (f16[H, M, D], f32[H, M]) {
    s = cast(q @ k.T, f32) * rsqrt(D)
    return softmax(s) @ v, logsumexp(s, axis=-1)
}"""
    fn, _ = run_checked(src, half(2, m, 32), half(2, m + 3, 32), half(2, m + 3, 32))
    assert templates(fn) == ["attention"]


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_a_cast_between_the_softmax_and_p_at_v_is_one_kernel(dt):
    src = f"""kernel f(q: f16[H, M, D], k: f16[H, N, D], v: {dt}[H, N, D]) -> {dt}[H, M, D] {{
    s = cast(q @ k.T, f32) * rsqrt(D)
    return cast(softmax(s), {dt}) @ v
}}"""
    vdt = torch.float16 if dt == "f16" else torch.bfloat16
    for m in SIZES:
        fn, _ = run_checked(src, half(2, m, 32), half(2, m + 7, 32), randn(2, m + 7, 32, dtype=vdt))
        assert templates(fn) == ["attention"]
    assert "online softmax: softmax (line 3), cast (line 3)" in fn.explain()


# --- horizontal fusion -----------------------------------------------------------------------


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (3, 5000)])
def test_max_and_min_of_the_same_rows_are_one_row_kernel(m, n):
    fn, _ = run_checked("kernel f(x: f32[M, N]) -> (f32[M], f32[M]) { return max(x, axis=-1), "
                        "min(x, axis=-1) }", randn(m, n))
    assert templates(fn) == ["rows"]
    assert ("[fuse-horizontal] fused: max (line 1) -> min (line 1): 2 rows kernels over [M, N] rows "
            "along axis 1 as one: 1 launch fewer; shared inputs read once: saves 4·M·N B") in fn.explain()


ROPE = """kernel rope(q: f32[B, H, S, D], k: f32[B, H, S, D], c: f32[S, D],
            s: f32[S, D]) -> (f32[B, H, S, D], f32[B, H, S, D]) {
    qr = q * c + concat(-q[..., D // 2:], q[..., :D // 2], axis=-1) * s
    kr = k * c + concat(-k[..., D // 2:], k[..., :D // 2], axis=-1) * s
    return qr, kr
}"""


@pytest.mark.parametrize("s, d", [(1, 2), (17, 8), (5, 64)])
def test_rope_q_and_k_are_one_kernel(s, d):
    fn, (qr, kr) = run_checked(ROPE, randn(2, 3, s, d), randn(2, 3, s, d), randn(s, d), randn(s, d))
    assert templates(fn) == ["pointwise"]
    assert qr.shape == kr.shape == (2, 3, s, d)


def test_independent_kernels_that_share_nothing_stay_apart_unless_launch_bound():
    fn, _ = run_checked("kernel f(x: f32[M, N], y: f32[M, N]) -> (f32[M, N], f32[M, N]) {\n"
                        "    return exp(x), exp(y)\n}", randn(17, 113), randn(17, 113))
    assert templates(fn) == ["pointwise", "pointwise"]
    fn, _ = run_checked("kernel f(x: f32[64, 32], y: f32[64, 32]) -> (f32[64, 32], f32[64, 32]) {\n"
                        "    return exp(x), exp(y)\n}", randn(64, 32), randn(64, 32))
    assert templates(fn) == ["pointwise"]


def test_an_epilogue_leaves_a_gate_computed_from_a_pending_softmax_to_fuse_rows():
    src = """kernel f(q: f32[H, M, D], k: f32[H, N, D], v: f32[H, N, D], g: f32[H, M, D]) -> f32[H, M, D] {
    o = softmax(q @ k.T * rsqrt(D)) @ v
    return o * clamp(softmax(g, axis=-1), 0.0, 0.5)
}"""
    fn, _ = run_checked(src, randn(2, 17, 16), randn(2, 23, 16), randn(2, 23, 16), randn(2, 17, 16))
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == [
        ("rows", ["softmax", "clamp"]),
        ("attention", ["matmul", "rsqrt", "mul", "softmax", "matmul", "mul"])]
    assert ("[fuse-attention] refused: clamp (line 3) -> mul (line 3): it is computed from softmax "
            "(line 3), which a later fusion can keep in registers with it; the epilogue takes values "
            "computed from the program's inputs [rule: profit]") in fn.explain()


# --- dual GEMM -------------------------------------------------------------------------------

SWIGLU = """kernel mlp(x: {dt}[M, K], w1: {dt}[F, K], w3: {dt}[F, K], w2: {dt}[N, F]) -> {dt}[M, N] {{
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T
}}"""


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m, k, f, n", [(1, 1, 1, 1), (17, 33, 40, 23), (113, 64, 130, 17)])
def test_swiglu_mlp_is_a_dual_gemm_and_a_gemm(dt, m, k, f, n):
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
    w = lambda *s: randn(*s, dtype=tdt, scale=0.3)  # noqa: E731
    fn, _ = run_checked(SWIGLU.format(dt=dt), w(m, k), w(f, k), w(f, k), w(n, f))
    assert templates(fn) == ["matmul", "matmul"]
    assert "plan gemm {matmul = %r0, a = %a0, b = %a1, dual = %r2 with b = %a2, epilogue = (%r1, %r3)}" \
        in fn.ir("fused")


def test_a_dual_gemm_with_operand_prologues_and_a_second_output():
    src = """kernel f(x: f16[M, K], w1: f16[K, N], w3: f32[K, N], s: f32) -> (f32[M, N], f32[M, N]) {
    a = cast(x, f32) * s
    h = a @ cast(w1, f32)
    g = a @ w3
    return h * sigmoid(g), g
}"""
    for m, k, n in ((1, 1, 1), (17, 33, 23)):
        fn, _ = run_checked(src, randn(m, k, dtype=torch.float16), randn(k, n, dtype=torch.float16),
                            randn(k, n), s=0.7)
        assert templates(fn) == ["matmul"]


def test_matmuls_of_different_a_stay_apart():
    fn, _ = run_checked("kernel f(x: f32[M, K], y: f32[M, K], w: f32[K, N]) -> f32[M, N] {\n"
                        "    return (x @ w) * (y @ w)\n}", randn(17, 9), randn(17, 9), randn(9, 23))
    assert templates(fn) == ["matmul", "matmul"]
    assert ("[fuse-epilogue] refused: matmul (line 2) -> mul (line 2): a dual GEMM shares the A "
            "operand; these multiply different ones [rule: op]") in fn.explain()


# --- norm -> GEMM: the row scale hoisted, the statistic in the K loop ----------------------------

RMS_QKV = """kernel f(x: {dt}[M, K], g: {dt}[K], w: {dt}[N, K]) -> {dt}[M, N] {{
    xf = cast(x, f32)
    y = xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + 1e-6) * g
    return cast(y, {dt}) @ w.T
}}"""


@pytest.mark.parametrize("dt", ["bf16", "f32", "f16"])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 33, 23), (113, 64, 130)])
def test_rmsnorm_then_projection_is_one_gemm(dt, m, k, n):
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
    fn, _ = run_checked(RMS_QKV.format(dt=dt), randn(m, k, dtype=tdt), randn(k, dtype=tdt),
                        randn(n, k, dtype=tdt, scale=0.2))
    report = fn.explain()
    if dt == "f16":  # unscaled, A might not fit f16: the norm stays a row program
        assert templates(fn) == ["rows", "matmul"]
        assert ("[hoist-row-scale] refused: rsqrt (line 3) -> matmul (line 4): the A operand is rounded "
                "to f16 after rsqrt (line 3) scales it; unscaled it could overflow f16 or lose precision, "
                "so the scale stays on A (a bf16 or f32 operand has no such limit) [rule: op]") in report
        return
    assert templates(fn) == ["matmul"]
    assert "rewrites:\n  [hoist-row-scale] fused: rsqrt (line 3) -> matmul (line 4): the row scale" in report


def test_a_prenorm_block_is_three_kernels():
    src = """kernel block(x: bf16[M, K], g1: bf16[K], wqkv: bf16[N, K], wo: bf16[K, N],
                   g2: bf16[K]) -> (bf16[M, N], bf16[M, K]) {
    xf = cast(x, f32)
    h = cast(xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + 1e-6) * g1, bf16)
    qkv = h @ wqkv.T
    r = qkv @ wo.T + x
    rf = cast(r, f32)
    out = cast(rf * rsqrt(mean(rf * rf, axis=-1, keepdims=true) + 1e-6) * g2, bf16)
    return qkv, out
}"""
    h = lambda *s, scale=1.0: randn(*s, dtype=torch.bfloat16, scale=scale)  # noqa: E731
    for m, k, n in ((1, 1, 1), (17, 33, 23)):
        fn, _ = run_checked(src, h(m, k), h(k), h(n, k, scale=0.2), h(k, n, scale=0.2), h(k))
        assert templates(fn) == ["matmul", "matmul", "rows"]


def test_row_and_column_scales_of_a_are_one_gemm():
    for src in ("kernel f(x: f32[M, K], s: f32[M, 1], w: f32[K, N]) -> f32[M, N] { return (x * s) @ w }",
                "kernel f(x: f32[M, K], s: f32[K], w: f32[K, N]) -> f32[M, N] { return (x * s) @ w }"):
        for m, k, n in ((1, 1, 1), (17, 33, 23)):
            s = randn(m, 1) if "s: f32[M, 1]" in src else randn(k)
            fn, _ = run_checked(src, randn(m, k), s, randn(k, n))
            assert templates(fn) == ["matmul"]


def test_a_statistic_of_another_tensor_is_not_computed_in_the_k_loop():
    src = """kernel f(x: f32[M, K], y: f32[M, K], w: f32[K, N]) -> f32[M, N] {
    return (x * rsqrt(mean(y * y, axis=-1, keepdims=true) + 1e-6)) @ w
}"""
    fn, _ = run_checked(src, randn(17, 33), randn(17, 33), randn(33, 23))
    assert templates(fn) == ["rows", "matmul"]
    assert ("[fuse-epilogue] refused: rsqrt (line 2) -> mul (line 2): it is computed from mean (line 2): "
            "the statistic is not computed from the tiles of A alone [rule: op]") in fn.explain()


ATTN_STAT = """kernel f(q: {dt}[B, M, D], k: {dt}[B, N, D], v: {dt}[B, N, D], w: {dt}[D, E]) -> {dt}[B, M, E] {{
    o = softmax(q @ k.T) @ v
    return (o * sum(o, keepdims=true)) @ w
}}"""


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("b, m, n, d, e", [(1, 1, 1, 1, 1), (2, 17, 113, 17, 33), (1, 113, 17, 64, 1)])
def test_a_row_statistic_of_an_attention_output_before_a_matmul_is_not_an_internal_error(dt, b, m, n, d, e):
    """A is the attention kernel's result (a KernelOp, not an Op): its row sum is a statistic
    of the GEMM's own A tiles, summed in the K loop, and the scale its epilogue."""
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
    r = lambda *s: randn(*s, dtype=tdt)  # noqa: E731
    fn, _ = run_checked(ATTN_STAT.format(dt=dt), r(b, m, d), r(b, n, d), r(b, n, d), r(d, e), sm90=False)
    assert [(k.template, [op.kind for op in k.ops if op.kind != "cast"]) for k in fn.kernels] == [
        ("attention", ["matmul", "softmax", "matmul"]), ("matmul", ["sum", "matmul", "mul"])]
    assert "fusions not made:\n  matmul (line 2) -> sum (line 3): no fusion pass joins" in fn.explain()


def test_a_statistic_of_another_result_of_the_kernel_producing_a_is_refused():
    """`o * o` joins the attention kernel as a second result: its row sum is not a statistic
    of A's tiles (result 0 of the same kernel), so a row kernel computes it."""
    src = """kernel f(q: f32[M, D], k: f32[N, D], v: f32[N, D], w: f32[D, E]) -> f32[M, E] {
    o = softmax(q @ k.T) @ v
    return (o * sum(o * o, keepdims=true)) @ w
}"""
    fn, _ = run_checked(src, randn(17, 33), randn(113, 33), randn(113, 33), randn(33, 5), sm90=False)
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == [
        ("attention", ["matmul", "softmax", "matmul", "mul"]), ("rows", ["sum"]), ("matmul", ["matmul", "mul"])]
    assert ("[fuse-epilogue] refused: sum (line 3) -> mul (line 3): the statistic is not computed from "
            "the tiles of A alone [rule: op]") in fn.explain()


# --- distributed matmuls ---------------------------------------------------------------------

DIFF = """kernel diff(q1: {dt}[H, M, D], k1: {dt}[H, N, D], q2: {dt}[H, M, D], k2: {dt}[H, N, D],
            v: {dt}[H, N, D], lam: f32) -> {dt}[H, M, D] {{
    p1 = softmax(q1 @ k1.T * rsqrt(D))
    p2 = softmax(q2 @ k2.T * rsqrt(D))
    return (p1 - lam * p2) @ v
}}"""


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("m", SIZES)
def test_diff_attention_is_two_attention_kernels(dt, m):
    tdt = torch.float32 if dt == "f32" else torch.float16
    r = lambda *s: randn(*s, dtype=tdt)  # noqa: E731
    n = m + 9
    fn, _ = run_checked(DIFF.format(dt=dt), r(2, m, 16), r(2, n, 16), r(2, m, 16), r(2, n, 16), r(2, n, 16),
                        lam=0.6)
    assert templates(fn) == ["attention", "attention"]
    assert "[distribute-matmul] fused: sub (line 5) -> matmul (line 5)" in fn.explain()


# --- attention sinks ---------------------------------------------------------------------------

SINKS = """kernel f(q: {dt}[H, M, D], k: {dt}[H, N, D], v: {dt}[H, N, D], sink: {dt}[H, 1, 1]) -> {dt}[H, M, D] {{
    s = q @ k.T * rsqrt(D)
    m = {m}
    e = exp(s - m)
    p = e / (sum(e, axis=-1, keepdims=true) + exp(sink - m))
    return p @ v
}}"""


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("m_form", ["max(s, axis=-1, keepdims=true)",
                                    "maximum(max(s, axis=-1, keepdims=true), sink)"])
@pytest.mark.parametrize("m", SIZES)
def test_attention_with_a_sink_logit_is_one_kernel(dt, m_form, m):
    tdt = torch.float32 if dt == "f32" else torch.float16
    r = lambda *s: randn(*s, dtype=tdt)  # noqa: E731
    fn, _ = run_checked(SINKS.format(dt=dt, m=m_form), r(2, m, 16), r(2, m + 5, 16), r(2, m + 5, 16),
                        r(2, 1, 1))
    assert templates(fn) == ["attention"]
    structure = next(line for line in fn.explain().splitlines() if "structure:" in line)
    # the sink's factor is computed from the f32 logsumexp of the scores in any dtype
    lse = "logsumexp (line 5)" if dt == "f32" else "cast (line 5), logsumexp (line 5)"
    assert f"online softmax: softmax (line 5); p @ v: matmul (line 6); logsumexp: {lse}; " \
        "epilogue: " in structure and "sub (line 5), sigmoid (line 5)" in structure


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("m", SIZES)
def test_a_16_bit_attention_with_an_f32_sink_is_one_kernel(dt, m):
    # gpt-oss's torch reference with 16-bit q, k, v and an f32 sink: `s - m` reads the scores
    # beside the f32 max of them and the sink (the max rounded to the scores' dtype first), so
    # the written softmax computes in f32, as the recognized one then does
    src = SINKS.replace("sink: {dt}[H, 1, 1]", "sink: f32[H, 1, 1]")
    tdt = torch.float16 if dt == "f16" else torch.bfloat16
    r = lambda *s: randn(*s, dtype=tdt)  # noqa: E731
    fn, _ = run_checked(src.format(dt=dt, m="maximum(max(s, axis=-1, keepdims=true), sink)"),
                        r(2, m, 16), r(2, m + 5, 16), r(2, m + 5, 16), randn(2, 1, 1))
    assert templates(fn) == ["attention"]


def test_a_value_per_query_row_from_the_logsumexp_is_stored_by_the_attention_kernel():
    src = """kernel f(q: f32[H, M, D], k: f32[H, N, D], v: f32[H, N, D], b: f32[H, 1, 1]) -> (f32[H, M, D],
                                                                                    f32[H, M, 1]) {
    s = q @ k.T
    l = logsumexp(s, axis=-1, keepdims=true)
    return softmax(s) @ v * sigmoid(l - b), sigmoid(b - l)
}"""
    for m in SIZES:
        fn, (o, g) = run_checked(src, randn(2, m, 16), randn(2, m + 3, 16), randn(2, m + 3, 16), randn(2, 1, 1))
        assert templates(fn) == ["attention"] and g.shape == (2, m, 1)


# --- returned probabilities ----------------------------------------------------------------------

RETURNED_P = """kernel f(q: {dt}[H, M, D], k: {dt}[H, N, D], v: {dt}[H, N, D]) -> ({dt}[H, M, D], {dt}[H, M, N]) {{
    s = q @ k.T * rsqrt(D)
    {mask}
    p = softmax(s)
    return p @ v, p
}}"""


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("mask", ["", "s = where(causal(s), s, -inf)"])
@pytest.mark.parametrize("m, n", [(1, 1), (17, 23), (113, 77)])
def test_returned_probabilities_are_stored_by_the_attention_kernel(dt, mask, m, n):
    tdt = torch.float32 if dt == "f32" else torch.float16
    r = lambda *s: randn(*s, dtype=tdt)  # noqa: E731
    fn, (o, p) = run_checked(RETURNED_P.format(dt=dt, mask=mask), r(2, m, 16), r(2, n, 16), r(2, n, 16))
    assert templates(fn) == ["attention"] and p.shape == (2, m, n)
    assert "stores_p = %r" in fn.ir("fused")


# --- sm_90: the new GEMM kernels at the benchmark's shape ------------------------------------------


DUAL = """kernel gate_up(x: {dt}[M, K], w1: {dt}[F, K], w3: {dt}[F, K]) -> {dt}[M, F] {{
    return silu(x @ w1.T) * (x @ w3.T)
}}"""


@pytest.mark.parametrize("src", [DUAL, RMS_QKV], ids=["dual_gemm", "rms_projection"])
def test_dual_gemm_and_norm_gemm_compile_for_sm90_without_spills(src):
    from tiledsl.backends.triton import aot

    fn = tiledsl.compile(src.format(dt="bf16"))
    (r,) = aot.inspect_program(fn, {"M": 8192, "N": 8192, "K": 4096, "F": 8192})
    assert r.spill_bytes == 0, r
    assert (r.config["BLOCK_M"], r.config["BLOCK_N"]) == (128, 128) and r.wgmma == ["m64n128k16"], r


# --- reductions over several axes ---------------------------------------------------------------


@pytest.mark.parametrize("src, kernels", [
    ("kernel f(x: f32[B, C, H, W]) -> f32[B, C] { return mean(x, axis=(2, 3)) }", 1),
    ("kernel f(x: f32[B, C, H, W]) -> f32[B] { return sum(x, axis=(1, 2, 3)) }", 1),
    ("kernel f(x: f32[B, C, H, W]) -> f32[B, W] { return max(x, axis=(1, 2)) }", 1),
    ("kernel f(x: f16[B, C, H, W]) -> f16[B, C] { return mean(x, axis=(-1, -2)) }", 1),
    ("kernel f(x: f32[B, C, H, W]) -> f32[C, H] { return min(x, axis=(0, 3)) }", 1),  # not adjacent
])
def test_a_reduction_over_several_axes_is_one_row_kernel(src, kernels):
    dtype = torch.float16 if "f16" in src else torch.float32
    for shape in ((1, 1, 1, 1), (2, 3, 17, 5)):
        x = randn(*shape, dtype=dtype)
        for arg in (x, x.transpose(2, 3).contiguous().transpose(2, 3)):  # a view, and a copy
            fn, _ = run_checked(src, arg)
            assert templates(fn) == ["rows"] * kernels


@pytest.mark.parametrize("n, v", [(1, 1), (17, 113), (5, 5000)])
def test_cross_entropy_with_its_mean_is_one_split_row_kernel(n, v):
    """The per-token loss and the count of counted labels summed over the tokens in the row
    program, as partials that its combine launch merges and divides."""
    src = """kernel f(logits: f32[N, V], labels: i64[N]) -> f32 {
    ignored = labels == -100
    picked = gather(logits, where(ignored, 0, labels), axis=-1)
    loss = where(ignored, 0.0, logsumexp(logits, axis=-1) - picked)
    return sum(loss, axis=0) / sum(where(ignored, 0.0, 1.0), axis=0)
}"""
    labels = torch.randint(0, v, (n,))
    labels[::3] = -100
    labels[0] = 0  # at least one label counts
    logits = randn(n, v)
    fn, out = run_checked(src, logits, labels)
    assert templates(fn) == ["rows"]
    assert sorted(launch.kernel.fn_name for launch in fn.launches) == ["k0_combine", "k0_rows"]
    expect = torch.nn.functional.cross_entropy(logits.double(), labels, ignore_index=-100)
    assert out.shape == () and abs(out.item() - expect.item()) <= 1e-5 * max(1.0, abs(expect.item()))


# --- group norm: the affine step sunk through the reshape --------------------------------------

GROUP_NORM = """kernel group_norm(x: f32[N, C, W], w: f32[C, 1], b: f32[C, 1]) -> f32[N, C, W] {
    g = reshape(x, [N, 4, -1])
    mu = mean(g, axis=-1, keepdims=true)
    d = g - mu
    var = mean(d * d, axis=-1, keepdims=true)
    y = reshape(d * rsqrt(var + 1e-5), [N, C, W])
    return y * w + b
}"""


@pytest.mark.parametrize("n, c, w", [(1, 4, 3), (2, 8, 17), (3, 12, 113)])
def test_group_norm_is_one_row_kernel(n, c, w):
    x, wt, b = randn(n, c, w), randn(c, 1), randn(c, 1)
    fn, out = run_checked(GROUP_NORM, x, wt, b)
    assert templates(fn) == ["rows"]
    assert "rewrites:\n  [sink-reshape] fused: reshape (line 6) -> mul (line 7)" in fn.explain()
    expect = torch.nn.functional.group_norm(x.double(), 4, wt[:, 0].double(), b[:, 0].double(), eps=1e-5)
    assert (out.double() - expect).abs().max() < 1e-5
