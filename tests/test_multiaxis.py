"""Reductions over several axes in one row program (issue 27): a tuple of axes, `axis=None`,
nested reductions of one kind, adjacent axes or not. A row is the elements along the reduced
axes, one program per kept index (batch norm: per channel), looping over blocks when the
row is longer than one. Numerics by the float64 oracle, exact kernel counts."""

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import testing

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

BATCH_NORM = """
kernel batch_norm(x: {t}[N, C, H, W], w: {t}[C], b: {t}[C],
                  eps: f32) -> ({t}[N, C, H, W], f32[1, C, 1, 1], f32[1, C, 1, 1]) {{
    xf = cast(x, f32)
    m = mean(xf, axis=(0, 2, 3), keepdims=true)
    v = mean((xf - m) ** 2, axis=(0, 2, 3), keepdims=true)
    y = (xf - m) * rsqrt(v + eps) * w[None, :, None, None] + b[None, :, None, None]
    return y, m, v
}}"""

GROUP_NORM = """
kernel group_norm(x: {t}[N, C, H, W], w: {t}[C], b: {t}[C]) -> {t}[N, C, H, W] {{
    xg = cast(reshape(x, [N, 4, C // 4, H, W]), f32)
    m = mean(xg, axis=(2, 3, 4), keepdims=true)
    d = xg - m
    v = mean(d * d, axis=(2, 3, 4), keepdims=true)
    wg = reshape(w, [4, C // 4])[None, :, :, None, None]
    bg = reshape(b, [4, C // 4])[None, :, :, None, None]
    return reshape(d * rsqrt(v + 1e-5) * wg + bg, [N, C, H, W])
}}"""

CLIP = """
kernel clip(g: {t}[M, N], c: f32) -> {t}[M, N] {{
    n = sqrt(sum(cast(g, f32) * cast(g, f32), axis=None))
    return g * minimum(1.0, c / (n + 1e-6))
}}"""


def templates(fn):
    return [k.template for k in fn.kernels]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 5, 7, 11), (2, 3, 50, 50)])
def test_batch_norm_is_one_row_program_per_channel(dt, shape):
    # (2, 3, 50, 50): a row of N * H * W = 5000 elements, longer than one block
    fn = tiledsl.compile(BATCH_NORM.format(t=dt))
    assert templates(fn) == ["rows"]
    assert "axes = (0, 2, 3)" in fn.ir("fused")
    t = DTYPES[dt]
    x = randn(*shape, dtype=t, scale=2) + 1.5  # a mean away from 0
    _, (y, m, v) = run_checked(fn, x, randn(shape[1], dtype=t, seed=1), randn(shape[1], dtype=t, seed=2),
                               eps=1e-5)
    var64, mu64 = torch.var_mean(x.double(), dim=(0, 2, 3), unbiased=False, keepdim=True)
    assert torch.allclose(m.double(), mu64, atol=1e-5) and torch.allclose(v.double(), var64, atol=1e-4)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 1, 1), (3, 8, 7, 11), (2, 8, 17, 113)])
def test_group_norm_is_one_row_program_per_group(dt, shape):
    fn = tiledsl.compile(GROUP_NORM.format(t=dt))
    assert templates(fn) == ["rows"]
    t = DTYPES[dt]
    x, w, b = randn(*shape, dtype=t, scale=2), randn(shape[1], dtype=t, seed=1), randn(shape[1], dtype=t, seed=2)
    _, y = run_checked(fn, x, w, b)
    expected = torch.nn.functional.group_norm(x.double(), 4, w.double(), b.double(), eps=1e-5) \
        if shape[0] * shape[2] * shape[3] * shape[1] // 4 > 1 else None
    if expected is not None:
        tol = 2e-5 if dt == "f32" else 0.05
        assert torch.allclose(y.double(), expected, atol=tol)


def test_batch_norm_gradients_are_one_kernel():
    fn = tiledsl.compile(BATCH_NORM.format(t="f32"))
    for shape in [(3, 5, 7, 11), (2, 3, 50, 50)]:
        x = randn(*shape, scale=2)
        report = testing.check_grads(fn, x, randn(shape[1], seed=1), randn(shape[1], seed=2), 1e-5,
                                     generator=gen(shape[0]))
        assert report.ok, report
    # dx and the sums for dw and db over (0, 2, 3) share the channel's rows
    assert templates(fn.backward) == ["rows"]


def test_group_norm_gradients():
    fn = tiledsl.compile(GROUP_NORM.format(t="f32"))
    for shape in [(3, 8, 7, 11), (1, 4, 5, 3)]:
        report = testing.check_grads(fn, randn(*shape, scale=2), randn(shape[1], seed=1), randn(shape[1], seed=2),
                                     generator=gen(shape[0]))
        assert report.ok, report
    # dx per group (axes 2, 3, 4 of [N, 4, C // 4, H, W]); dw and db per channel (axes 0, 3,
    # 4), another row space; dx is k0's result viewed back as [N, C, H, W] (a fresh tensor
    # nothing else reads), dw and db are copied out of k1's [1, 4, C // 4, 1, 1] results
    assert templates(fn.backward) == ["rows", "rows", "pointwise", "pointwise"]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (113, 130)])
def test_global_norm_clipping_is_a_split_sum_and_a_scale(dt, m, n):
    """`axis=None`: the sum over M split over programs (each sums its chunk of rows; the
    combine launch merges them and computes the scale), then a pointwise kernel scales the
    gradient: two kernels, as torch's foreach path, not one program reading every element."""
    fn = tiledsl.compile(CLIP.format(t=dt))
    assert templates(fn) == ["rows", "pointwise"]
    assert "split, tail" in fn.ir()
    t = DTYPES[dt]
    g = randn(m, n, dtype=t)
    for c in (0.5, 1e4):  # clipped, and not
        _, out = run_checked(fn, g, c)
        norm = g.double().norm()
        expected = g.double() * min(1.0, c / (norm.item() + 1e-6))
        assert torch.allclose(out.double(), expected, atol=1e-5 if dt == "f32" else 0.02)


@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min", "prod", "logsumexp"])
def test_nested_reductions_are_the_tuple_form(kind):
    """Nested reductions of one kind over uniform axes are one reduction over them: the same
    kernels and the same values as the tuple form (a mean of equal-sized means is the mean)."""
    nested = tiledsl.compile(f"kernel f(x: f32[B, M, N]) -> f32[B] {{ return {kind}({kind}(x, -1), -1) }}")
    tupled = tiledsl.compile(f"kernel f(x: f32[B, M, N]) -> f32[B] {{ return {kind}(x, (-2, -1)) }}")
    assert templates(nested) == templates(tupled) == ["rows"]
    for shape in [(1, 1, 1), (3, 17, 13), (2, 113, 41)]:
        x = randn(*shape, scale=0.3) + (1.0 if kind == "prod" else 0.0)
        _, a = run_checked(nested, x)
        _, b = run_checked(tupled, x)
        assert torch.equal(a, b)


@pytest.mark.parametrize("axes, keep", [("(0, 2)", "true"), ("(0, 2)", "false"), ("(1, 2)", "true"),
                                        ("None", "false")])
def test_tuple_reductions_of_half_values_round_once(axes, keep):
    # a bf16 sum over several axes accumulates in f32 and rounds once, as torch's
    fn = tiledsl.compile(f"kernel f(x: bf16[A, B, C]) -> bf16 {{ return sum(x, axis={axes}, keepdims={keep}) }}"
                         .replace("-> bf16 {", "-> bf16[" + _result(axes, keep) + "] {"))
    assert templates(fn) == ["rows"]
    for shape in [(1, 1, 1), (5, 17, 113)]:
        run_checked(fn, randn(*shape, dtype=torch.bfloat16))


def _result(axes: str, keep: str) -> str:
    reduced = range(3) if axes == "None" else eval(axes)
    dims = [("1" if i in reduced else "ABC"[i]) for i in range(3) if keep == "true" or i not in reduced]
    return ", ".join(dims)


def test_a_reduction_over_some_of_the_row_axes_is_refused_with_its_reason():
    fn = tiledsl.compile("""
    kernel f(x: f32[N, C, H, W]) -> (f32[N, C, H, W], f32[N, C, H]) {
        d = x - mean(x, axis=(0, 2, 3), keepdims=true)
        return d, sum(d, axis=3) * 2.0
    }""")
    assert templates(fn) == ["rows", "rows"]
    assert ("  [fuse-rows] refused: sub (line 3) -> sum (line 4): sum is used outside the row program "
            "but reduces only some of its axes [rule: tile]") in fn.explain().splitlines()
    run_checked(fn, randn(3, 5, 7, 11))


def test_softmax_along_one_of_the_row_axes_is_its_own_kernel():
    fn = tiledsl.compile("""
    kernel f(x: f32[N, C, W]) -> f32[N, C, W] {
        d = x - mean(x, axis=(0, 2), keepdims=true)
        return softmax(d, axis=2)
    }""")
    assert templates(fn) == ["rows", "rows"]
    assert ("  [fuse-rows] refused: sub (line 3) -> softmax (line 4): softmax runs along one of the row "
            "program's axes only [rule: tile]") in fn.explain().splitlines()
    run_checked(fn, randn(3, 5, 17))


@pytest.mark.parametrize("row_op", ["softmax", "cumsum"])
@pytest.mark.parametrize("width", [2, 3])
def test_a_reduction_across_the_rows_of_a_program_of_literal_sizes(row_op, width):
    """A row program along axis 0 whose max runs across its rows along a literal dim, every
    size a literal and no argument with a size or stride (z is [1]): its rows are indexed
    in int32 and it takes no WIDE flag. (Fuzz finding 0:4981: the row program read WIDE to
    widen its program id whenever its row count was not a bare number, and `(1 * 4)`, the
    rows padded to whole groups, is not; a NameError in the kernel.)"""
    pieces = ", ".join(["z[:, None]", "(z * 0.5)[:, None]", "tanh(z)[:, None]"][:width])
    fn = tiledsl.compile(f"kernel f(z: f32[1]) -> f32[1] {{ return max({row_op}(concat({pieces}, axis=1), "
                         "axis=0), axis=1) }")
    (kernel,) = fn.kernels
    assert kernel.template == "rows" and "WIDE" not in kernel.source
    run_checked(fn, randn(1))


def test_a_partial_reduction_whose_rest_does_not_join_is_not_a_member():
    """Fuzz finding (gradients, seed 11, program 77): the backward's sum over H of a [H, M, N]
    value joined a row program over (H, N) for the sum over N that would continue it, which
    then did not join; the kernel stored the partial sum it never computes (an internal error,
    KeyError: 28, in the template). fuse-rows checks the grown group whole and grows it again
    without such a reduction."""
    src = """kernel f(z: bf16[M, 1], u: bf16[H, M, N], w: bf16[N, N], s: f32, flag: bool) -> bf16[H, M, N] {
    t3 = tanh(hardswish(z + z))
    return where(flag, where(t3 == log2(8.0), u @ w, mean(t3, axis=0, keepdims=false)),
                 (s + N) * where(z < t3, z, z))
}"""
    fn = tiledsl.compile(src)
    for flag in (True, False):
        args = (randn(33, 1, dtype=torch.bfloat16, seed=1), randn(3, 33, 113, dtype=torch.bfloat16, seed=2),
                randn(113, 113, dtype=torch.bfloat16, seed=3), 0.75, flag)
        report = testing.check_grads(fn, *args, generator=gen(77))
        assert report.ok, report
