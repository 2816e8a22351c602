"""Random numbers: `rand`, `randn` and `dropout` depend only on the seed and each element's
position, so every backend and every kernel computes the same values (the reference runs
Triton's Philox in torch, bit for bit), and a backward regenerates a forward's mask."""

from __future__ import annotations

import math

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot
from tiledsl.diagnostics import TileDSLError

RANDOM = """
kernel f(x: f32[M, N], seed: i64) -> (f32[M, N], f32[M, N], f32[M, N]) {
    return rand(x, seed), randn(x, seed), dropout(x, 0.25, seed)
}"""


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (113, 17)])
@pytest.mark.parametrize("seed", [0, 7, -3, 2**40 + 5])
def test_random_values_are_the_references_bit_for_bit(m, n, seed):
    fn = tiledsl.compile(RANDOM)
    x = randn(m, n)
    out = fn(x, seed)
    for a, b in zip(out, fn.reference(x, seed), strict=True):
        assert torch.equal(a, b)
    u, z, d = out
    assert ((u >= 0) & (u < 1)).all() and torch.isfinite(z).all()
    kept = d != 0
    assert torch.equal(kept, u >= 0.25)  # the mask is rand's own numbers
    assert torch.equal(d[kept], x[kept] * (1 / 0.75))  # torch scales by 1 / (1 - p)
    assert not torch.equal(fn(x, seed + 1)[0], u)


def test_a_value_depends_on_its_position_alone():
    """rand of a [M, N] value is rand of its flattening, whatever kernel computes it: a
    GEMM epilogue, a row program, a pointwise kernel."""
    flat = tiledsl.compile("kernel f(y: f32[K], seed: i32) -> f32[K] { return rand(y, seed) }")
    gemm = tiledsl.compile("""
    kernel g(a: f32[M, K], b: f32[K, N], seed: i32) -> f32[M, N] {
        c = a @ b
        return c * 0.0 + rand(c, seed)
    }""")
    rows = tiledsl.compile("""
    kernel r(x: f32[M, N], seed: i32) -> f32[M, N] {
        return softmax(x) * 0.0 + rand(x, seed)
    }""")
    assert [k.template for k in gemm.kernels] == ["matmul"] and [k.template for k in rows.kernels] == ["rows"]
    a, b = randn(17, 5), randn(5, 113)
    expected = flat(randn(17 * 113), 11).reshape(17, 113)
    assert torch.equal(gemm(a, b, 11), expected)
    assert torch.equal(rows(randn(17, 113), 11), expected)


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic."""
    both = torch.cat([a, b]).double().sort().values
    fa = torch.searchsorted(a.double().sort().values, both, right=True) / len(a)
    fb = torch.searchsorted(b.double().sort().values, both, right=True) / len(b)
    return (fa - fb).abs().max().item()


def test_distributions_match_torchs():
    """Uniform and normal by their moments and a two-sample KS test against torch's
    generator (at the 0.1% level: c(a) = 1.95), dropout by the fraction it keeps."""
    n = 1 << 16
    fn = tiledsl.compile(RANDOM)
    u, z, d = (v.flatten() for v in fn(randn(256, 256), 2024))
    theirs = torch.Generator().manual_seed(5)
    bound = 1.95 * math.sqrt(2 / n)
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    assert _ks(u, torch.rand(n, generator=theirs)) < bound
    assert abs(z.mean().item()) < 0.02 and abs(z.var().item() - 1) < 0.03
    assert _ks(z, torch.randn(n, generator=theirs)) < bound
    assert abs((d != 0).double().mean().item() - 0.75) < 0.01


def test_dropout_in_a_gemm_epilogue_and_its_gradient_regenerate_the_mask():
    """One kernel for `dropout(relu(a @ w + bias))`; its backward computes the forward's mask
    again from the seed: the gradient is zero exactly where the forward dropped."""
    src = """
    kernel f(a: f32[M, K], w: f32[K, N], bias: f32[N], p: f32, seed: i64) -> f32[M, N] {
        return dropout(relu(a @ w + bias), p, seed)
    }"""
    a, w, bias = randn(33, 17), randn(17, 113), randn(113)
    fn, y = run_checked(src, a, w, bias, 0.3, 99)
    assert [k.template for k in fn.kernels] == ["matmul"]
    report = testing.check_grads(fn, a, w, bias, 0.3, 99)
    assert report.ok, report
    a_, w_, bias_ = (t.clone().requires_grad_() for t in (a, w, bias))
    fn(a_, w_, bias_, 0.3, 99).sum().backward()
    h = a @ w + bias
    dropped = (y == 0) & (h > 0)
    assert dropped.any() and (bias_.grad.double() - ((h > 0) & ~dropped).double().sum(0) / 0.7).abs().max() < 1e-4


def test_dropout_keeps_the_dtype_and_p_extremes():
    fn = tiledsl.compile("kernel f(x: f16[M, N], p: f32, seed: i32) -> f16[M, N] { return dropout(x, p, seed) }")
    x = randn(17, 33, dtype=torch.float16)
    assert torch.equal(fn(x, 0.0, 1), x)
    assert torch.equal(fn(x, 1.0, 1), torch.zeros_like(x))
    _, y = run_checked(fn, x, 0.5, 3)
    assert y.dtype == torch.float16


def test_dropout_in_a_gemm_epilogue_compiles_for_sm90_without_spills():
    fn = tiledsl.compile("""
    kernel f(a: f16[M, K], w: f16[K, N], seed: i64) -> f16[M, N] {
        return dropout(gelu(a @ w), 0.1, seed)
    }""")
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 4096, "K": 4096}, {"seed": 3})
    assert r.spill_bytes == 0 and r.wgmma == ["m64n128k16"]


@pytest.mark.parametrize("body, tiles", [
    ("(a @ w) + 0.1 * randn(a @ w, seed)", {(128, 64), (64, 128)}),
    ("sin(a @ w) * cos(a @ w) + cast(seed, f16)", {(128, 128), (128, 64), (64, 128)}),
])
def test_gemm_epilogues_calling_f64_slow_paths_take_tiles_that_do_not_spill(body, tiles):
    """Box-Muller's log, sqrt and cos (f64, for the reference's bit-exact draw) spilled 8 KB
    at 128 x 128 and 46 KB at 128 x 256; sin and cos 2 KB at 128 x 256: every candidate is a
    tile whose epilogue half keeps its values in registers."""
    fn = tiledsl.compile(f"kernel f(a: f16[M, K], w: f16[K, N], seed: i64) -> f16[M, N] {{ return {body} }}")
    reports = aot.inspect_program(fn, {"M": 4096, "N": 4096, "K": 4096}, {"seed": 3}, every_candidate=True)
    assert all(r.spill_bytes == 0 for r in reports)
    assert {(r.config["BLOCK_M"], r.config["BLOCK_N"]) for r in reports} == tiles


@pytest.mark.parametrize("src, error", [
    ("rand(x, 1.5)", "<string>:1:45: error: a seed is an integer scalar (an i32 or i64 parameter, or a "
     "literal), got weak f32"),
    ("rand(x, x)", "<string>:1:45: error: a seed is an integer scalar (an i32 or i64 parameter, or a "
     "literal), got f32[M]"),
    ("dropout(x, 1.5, 0)", "<string>:1:56: error: dropout probability has to be between 0 and 1, "
     "but got 1.5"),
    ("dropout(x, -0.5, 0)", "<string>:1:56: error: dropout probability has to be between 0 and 1, "
     "but got -0.5"),
    ("dropout(x, 0.5 * 3, 0)", "<string>:1:56: error: dropout probability has to be between 0 and 1, "
     "but got 1.5"),
    ("dropout(x, 2, 0)", "<string>:1:56: error: dropout probability has to be between 0 and 1, "
     "but got 2"),
    ("dropout(x, -inf, 0)", "<string>:1:56: error: dropout probability has to be between 0 and 1, "
     "but got -inf"),
    ("dropout(cast(x, i32), 0.5, 0)", "<string>:1:53: error: dropout needs a float value, got i32[M]"),
])
def test_random_errors(src, error):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(f"kernel f(x: f32[M]) -> f32[M] {{ return cast({src}, f32) }}")
    assert str(err.value).splitlines()[0] == error


def test_a_scalar_parameter_p_carries_dropouts_bounds_for_the_call():
    """A p given at the call cannot be checked at compile time: the parameter records the
    range torch's dropout asks of it and where it is used, for the binder to check."""
    fn = tiledsl.compile("kernel f(x: f32[M], p: f32) -> f32[M] {\n    return dropout(x, p, 0)\n}")
    graph = fn.source_graph
    ((lo, hi, what, span),) = graph.op(graph.params[1]).attr("bounds")
    assert (lo, hi, what, span.location(), span.text) == (0.0, 1.0, "dropout probability", "<string>:2:12",
                                                          "dropout(x, p, 0)")
    assert graph.op(graph.params[0]).attr("bounds") is None


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("p", [1.5, -0.1, float("nan")])
def test_a_dropout_probability_given_at_the_call_outside_0_1_is_refused_naming_it(backend, p):
    """torch.nn.functional.dropout refuses such a p; so does the call, plain or through
    autograd, pointing at the parameter with a note at the dropout that reads it."""
    fn = tiledsl.compile("kernel f(x: f32[M], p: f32) -> f32[M] {\n    return dropout(x, p, 0)\n}",
                         backend=backend)
    x = torch.randn(17, generator=torch.Generator().manual_seed(0))
    for grad in (False, True):
        with pytest.raises(TileDSLError) as err:
            fn(x.clone().requires_grad_(grad), p)
        lines = str(err.value).splitlines()
        assert lines[0] == (f"<string>:1:21: error: argument 'p': dropout probability has to be between "
                            f"0 and 1, but got {p}")
        assert lines[3] == "<string>:2:12: note: used as the dropout probability here"
    kept = fn(x, 0.0)
    assert torch.equal(kept, x) and torch.equal(fn(x, 1.0), torch.zeros(17))


@pytest.mark.parametrize("n", [1, 17, 4099])
def test_tritons_rand_of_seed_and_offsets(n):
    # the low-memory dropout tutorial's `tl.rand(seed, offsets)`: the numbers at the given
    # positions, the same as rand(x, seed) at x's flat positions, and at any others
    src = """
kernel f(x: f32[N], seed: i32) -> (f32[N], f32[N], f32[N], f32[N]) {
    return rand(seed, index(x, 0)), rand(x, seed), randn(seed, index(x, 0) * 2 + 7), randn(x, seed)
}"""
    fn, (a, b, c, d) = run_checked(src, randn(n), 1234)
    assert torch.equal(a, b)
    _, shifted = run_checked("kernel f(x: f32[N], seed: i32) -> f32[N] { return randn(x, seed) }",
                             randn(2 * n + 7), 1234)
    assert torch.equal(c, shifted[7::2])
    assert not torch.equal(c, d)
