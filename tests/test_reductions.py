"""prod, argmax and argmin, each one `Reduction` entry in tiledsl/ops/structure.py: numerics
against float64 torch on awkward sizes and rows longer than one block (the looped form),
ties and NaN as torch's argmax has them, fusion with the ops around them, the gradient of
prod (zeros included), and their diagnostics as text."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import diagnostics as diag
from tiledsl import testing

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32}
# 5000 is longer than the interpreter's row block (4096): the looped form runs
LENGTHS = (1, 17, 113, 5000)


def near_one(*shape, dtype, seed):
    """Factors near 1 (a product of 5000 stays finite); integers in {-2, -1, 1, 2, 3}."""
    g = gen(seed)
    if dtype is torch.int32:
        return torch.tensor([-2, -1, 1, 2, 3], dtype=torch.int32)[torch.randint(0, 5, shape, generator=g)]
    return (1 + 0.01 * torch.randn(shape, generator=g)).to(dtype)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dt", DTYPES)
def test_prod_along_rows(dt, n):
    x = near_one(5, n, dtype=DTYPES[dt], seed=n)
    r = "i32" if dt == "i32" else dt
    fn, out = run_checked(f"""kernel f(x: {dt}[M, N]) -> ({r}[M], {r}[M, 1], {r}[N]) {{
        return prod(x, axis=-1), prod(x, axis=1, keepdims=true), prod(x, axis=0)
    }}""", x)
    # one row program: the column products are partials across its rows (split), x read once
    assert [k.template for k in fn.kernels] == ["rows"]
    if dt == "i32":  # an i32 product wraps, as torch's i64 one narrowed to i32
        assert torch.equal(out[0], x.long().prod(-1).to(torch.int32))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dt", DTYPES)
def test_argmax_argmin_along_rows(dt, n):
    g = gen(n)
    x = torch.randn(5, n, generator=g) * 4
    x = (x.round() if dt == "i32" else x).to(DTYPES[dt])  # i32: many ties
    fn, out = run_checked(f"""kernel f(x: {dt}[M, N]) -> (i64[M], i64[M, 1], i64[N]) {{
        return argmax(x, axis=-1), argmin(x, axis=1, keepdims=true), argmax(x, axis=0)
    }}""", x)
    assert torch.equal(out[0], x.double().argmax(-1))
    assert torch.equal(out[1], x.double().argmin(1, keepdim=True))
    assert torch.equal(out[2], x.double().argmax(0))


@pytest.mark.parametrize("n", [113, 5000])
def test_argmax_takes_the_first_of_ties_and_nan_is_the_extremum(n):
    x = (torch.randn(6, n, generator=gen(3)) * 2).round()  # ties in every row
    x[1, n // 3] = x[1, n - 1] = float("nan")  # the first NaN, for argmax and argmin
    x[2, 0] = float("nan")
    x[3, n - 1] = float("nan")
    x[4] = float("-inf")  # all the same: position 0
    x[5, 7] = x[5, n - 2] = float("inf")
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> (i64[M], i64[M]) { return argmax(x, axis=-1), argmin(x, axis=-1) }")
    out = fn(x)
    assert torch.equal(out[0], x.double().argmax(-1)) and torch.equal(out[1], x.double().argmin(-1))
    assert out[0].tolist()[1:] == [n // 3, 0, n - 1, 0, 7] and out[1].tolist()[1:4] == [n // 3, 0, n - 1]
    assert all(torch.equal(a, b) for a, b in zip(out, fn.reference(x), strict=True))


def test_prod_fused_with_the_elementwise_ops_around_it_is_one_kernel():
    x = torch.randn(17, 113, generator=gen(5))
    fn, _ = run_checked("""kernel f(x: f32[M, N], b: f32[M]) -> f32[M] {
        return prod(exp(x * 0.01) + 0.5, axis=-1) * 2.0 + b
    }""", x, torch.randn(17, generator=gen(6)), sm90=False)
    assert len(fn.kernels) == 1


def test_prod_over_adjacent_axes_is_one_reduction():
    x = near_one(3, 17, 113, dtype=torch.float32, seed=7)
    fn, _ = run_checked("kernel f(x: f32[A, B, C]) -> f32[A] { return prod(x, axis=(1, 2)) }", x, sm90=False)
    assert len(fn.kernels) == 1


def test_reductions_over_an_empty_axis():
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[M] { return prod(x, axis=-1) }")
    assert torch.equal(fn(torch.randn(3, 0)), torch.ones(3))
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> i64[M] { return argmin(x, axis=-1) }")
    with pytest.raises(diag.EmptyReductionError) as err:
        fn(torch.randn(3, 0))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:43: error: argmin over an empty axis (N = 0 at this call): argmin has no "
        "identity (torch raises too)")


def _zeros(x):
    x[0, 3] = 0.0  # one zero: the gradient there is the product of the others
    x[1, 2] = x[1, 7] = 0.0  # two: all zero
    return x


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
def test_prod_gradient_with_and_without_zeros(dt):
    x = _zeros(near_one(17, 113, dtype=torch.float32, seed=9) + 0.1 * torch.randn(17, 113, generator=gen(10)))
    fn = tiledsl.compile(f"""kernel f(x: {dt}[M, N]) -> ({dt}[M], {dt}[1, N]) {{
        return prod(x, axis=-1), prod(x, axis=0, keepdims=true)
    }}""")
    report = testing.check_grads(fn, x.to(DTYPES[dt]), generator=gen(11))
    assert report.ok, str(report)


def test_argmax_stops_the_gradient_as_torch_does():
    x = torch.randn(17, 113, generator=gen(12))
    fn = tiledsl.compile("""kernel f(x: f32[M, N]) -> f32[M, N] {
        return x * cast(argmax(x, axis=-1, keepdims=true), f32)
    }""")
    assert testing.check_grads(fn, x).ok


@pytest.mark.parametrize("src, text", [
    ("kernel f(x: bool[M, N]) -> i64[M] { return argmax(x, axis=-1) }",
     "<string>:1:44: error: 'argmax' needs a number, got bool; use cast(x, i32) first"),
    ("kernel f(x: f32[M, N]) -> i64[M] { return argmin(x, axis=(0, 1)) }",
     "<string>:1:58: error: 'axis' of 'argmin' must be one integer: a position is along one axis "
     "(reshape(x, [...]) merges axes)"),
    ("kernel f(x: f32[M, N]) -> i64 { return argmax(x, axis=None) }",
     "<string>:1:55: error: 'axis' of 'argmax' must be one integer: a position is along one axis "
     "(reshape(x, [...]) merges axes)"),
    ("kernel f(x: f32[M, N]) -> f32[M] { return prod(x, axis=1.5) }",
     "<string>:1:56: error: 'axis' of 'prod' must be an integer constant"),
    ("kernel f(x: f32[M, N]) -> f32[M] { return argmax(x, axis=-1) }",
     "<string>:1:43: error: the returned value is i64 but the kernel declares f32; convert it "
     "explicitly with cast(..., f32)"),
    ("kernel f(x: f32[M, N]) -> f32[M] { return produ(x, axis=-1) }",
     "<string>:1:43: error: unknown function 'produ'; did you mean 'prod'?"),
], ids=["argmax-bool", "argmin-axes", "argmax-all-axes", "prod-float-axis", "argmax-is-i64", "misspelt"])
def test_diagnostics(src, text):
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(src)
    assert str(err.value).splitlines()[0] == text


def test_explain_names_the_new_reductions_in_their_kernel():
    fn = tiledsl.compile("""kernel f(x: f32[M, N]) -> (f32[M], i64[M]) {
        return prod(exp(x), axis=-1) * 2.0, argmax(x, axis=-1)
    }""")
    assert "k0  rows      exp (line 2), prod (line 2), mul (line 2), argmax (line 2)" in fn.explain()


@pytest.mark.parametrize("dtype, wide", [("f16", False), ("bf16", False), ("f32", True)])
@pytest.mark.parametrize("n", [1, 113, 5000])
def test_row_sums_accumulate_in_f64_only_where_an_f32_result_shows_them(dtype, wide, n):
    """sum-precision: a layer norm's f32 row sums (the program casts to f32) accumulate in
    f32 when only its f16 or bf16 result depends on them (issue 29: an f64 accumulator cost
    a conversion an element), in f64 for an f32 result; the oracle holds either way, in
    short rows and in long ones (several blocks of a row)."""
    src = f"""kernel layer_norm(x: {dtype}[M, N], w: {dtype}[N], eps: f32) -> {dtype}[M, N] {{
        xf = cast(x, f32)
        xc = xf - mean(xf, axis=-1, keepdims=true)
        var = mean(xc * xc, axis=-1, keepdims=true)
        return cast(xc * rsqrt(var + eps) * cast(w, f32), {dtype})
    }}"""
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    x = randn(17, n, seed=1, scale=3.0).add(1).to(torch_dtype)
    w = randn(n, seed=2, dtype=torch_dtype)
    fn, _ = run_checked(src, x, w, eps=1e-5)
    (kernel,) = fn.kernels
    assert ("tl.float64" in kernel.source) is wide
