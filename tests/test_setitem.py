"""`x[items] = v`, torch's setitem, out of place: the name is bound to x with v written at
the elements x[items] reads. Through basic indexing (ints, slices, None, `...`) it is an
elementwise select over x that fuses with what reads it; through tensor indices a scatter
into a copy of x (`put_into`). Against torch's in-place setitem on awkward sizes, with
kernel counts, gradients and diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

import tiledsl
from helpers import SIZES, gen, randn, run_checked
from tiledsl import testing


@pytest.mark.parametrize("n", SIZES)
def test_basic_writes_are_one_elementwise_kernel(n):
    src = """
kernel f(x: f32[M, N], v: f32[N], r: f32[M, 1]) -> f32[M, N] {
    y = x * 2.0
    y[..., :1] = -1.0
    y[1::2, :] = v
    y[0] = 7.5
    y[:, -1:] = r
    return y + 1.0
}"""
    x, v, r = randn(5, n, seed=n), randn(n, seed=n + 1), randn(5, 1, seed=n + 2)
    fn, out = run_checked(src, x, v, r)
    want = x * 2.0
    want[..., :1] = -1.0
    want[1::2, :] = v
    want[0] = 7.5
    want[:, -1:] = r
    assert torch.equal(out, want + 1.0)
    assert [k.template for k in fn.kernels] == ["pointwise"]


@pytest.mark.parametrize("n", SIZES)
def test_writes_at_tensor_indices_scatter_into_a_copy(n):
    # HF StaticCache's fallback, `k_out[:, :, cache_position] = key_states`
    src = """
kernel f(cache: f32[B, H, T, D], pos: i64[S], k: f32[B, H, S, D]) -> f32[B, H, T, D] {
    cache[:, :, pos] = k
    return cache
}"""
    cache, k = randn(2, 3, n + 4, 5, seed=n), randn(2, 3, 2, 5, seed=n + 1)
    pos = torch.randperm(n + 4, generator=gen(n))[:2]
    before = cache.clone()
    fn, out = run_checked(src, cache, pos, k)
    want = cache.clone()
    want[:, :, pos] = k
    assert torch.equal(out, want) and torch.equal(cache, before)
    assert [kk.template for kk in fn.kernels] == ["indexed"]


@pytest.mark.parametrize("n", SIZES)
def test_writes_through_a_bool_mask_are_a_select(n):
    # `scores[scores < t] = -inf`, `x[mask] = 0`: masked_fill as model code writes it
    src = """
kernel f(x: f32[M, N], t: f32, rows: bool[M]) -> f32[M, N] {
    y = x * 2.0
    y[y < t] = -inf
    y[rows] = 0
    return softmax(y, axis=0)
}"""
    x, rows = randn(9, n, seed=n), torch.rand(9, generator=gen(n)) < 0.3
    rows[0] = True  # a row of zeros: no column is all -inf
    fn, out = run_checked(src, x, 0.3, rows)
    y = x * 2.0
    y[y < 0.3] = -math.inf
    y[rows] = 0
    torch.testing.assert_close(out, torch.softmax(y, 0), rtol=0, atol=1e-6)
    assert [k.template for k in fn.kernels] == ["rows"]


@pytest.mark.parametrize("n", SIZES)
def test_gradients_flow_through_writes(n):
    fn = tiledsl.compile("""
kernel f(x: f32[M, N], v: f32[M, 1], idx: i64[K], w: f32[K, N]) -> f32[M, N] {
    y = x * x
    y[:, :1] = v * 3.0
    y[idx] = w
    return y
}""")
    m = n + 3
    idx = torch.randperm(m, generator=gen(n))[:2]
    report = testing.check_grads(fn, randn(m, n, seed=n), randn(m, 1, seed=1), idx, randn(2, n, seed=2),
                                 generator=gen(n))
    assert report.ok, f"{report}"


@pytest.mark.parametrize("src, message", [
    ("kernel f(x: f32[M, N], v: f32[3]) -> f32[M, N] { x[:, :2] = v \n return x }",
     "cannot write a value of shape [3] into [M, 2] elements"),
    ("kernel f(x: f32[M, N]) -> f32[M, N] { y[0] = 1.0 \n return x }",
     "undefined name 'y'"),
    ("kernel f(x: f32[M, N], v: f32[M, N]) -> f32[M, N] { x[x > 0.0] = v \n return x }",
     "a write through a bool mask takes one value (torch's would need as many as the mask selects, a "
     "count only the call knows); write where(mask, v, x) for a tensor v"),
    ("kernel f(x: f32[M, N], m: bool[N]) -> f32[M, N] { x[m] = 0.0 \n return x }",
     "a bool mask of shape [N] must have the leading dims of [M, N]"),
    ("kernel f(x: f32[M, N]) -> f32[M, N] { N[0] = 1.0 \n return x }",
     "cannot write into 'N': it is a dim, not a value"),
    ("kernel f(x: f32[M, N], s: f32) -> f32[M, N] { s[0] = 1.0 \n return x }",
     "a 0-d value (f32) cannot be indexed; it broadcasts as it is"),
])
def test_bad_writes_are_located_errors(src, message):
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(src)
    assert err.value.message == message


def test_a_generic_kernel_writes_in_each_dtype():
    fn = tiledsl.compile("kernel f[T: f16 | f32](x: T[M, N]) -> T[M, N] { y = x * 2.0 \n y[:, :1] = 0.0 \n return y }")
    for dtype in (torch.float32, torch.float16):
        x = randn(5, 17, dtype=dtype)
        want = x * 2.0
        want[:, :1] = 0.0
        assert torch.equal(fn(x), want)
