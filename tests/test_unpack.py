"""Tuple assignment: `a, b = x, y` and the builtins with several results
(`values, indices = max(x, axis)`, torch's pair)."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing
from tiledsl.diagnostics import TileDSLError

PAIRS = """
kernel pairs(x: f32[M, N], y: f32[M, N]) -> (f32[M], i64[M], f32[M, 1], i64[M, 1], f32[M, N]) {
    v, i = max(x, -1)
    w, j = min(x * 2.0, axis=1, keepdims=true)
    a, b = y, x,
    a, b = b, a * 2.0
    return v, i, w, j, a - b
}"""


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (113, 17), (3, 1)])
def test_unpacked_max_and_min_are_torchs_pairs_and_tuples_bind_after_evaluating(m, n):
    x, y = randn(m, n), randn(m, n)
    x[0, -1] = x[0, 0]  # a tie: the index of its first occurrence, as torch
    fn, (v, i, w, j, d) = run_checked(PAIRS, x, y)
    assert [k.template for k in fn.kernels] == ["merged"]  # one launch for every row program
    values, indices = x.max(-1)
    assert torch.equal(v, values) and torch.equal(i, indices) and i.dtype == torch.int64
    values, indices = (x * 2).min(1, keepdim=True)
    assert torch.equal(w, values) and torch.equal(j, indices)
    assert torch.allclose(d.double(), x.double() - 2 * y.double())  # `a, b = b, a * 2.0` swapped


def test_unpacked_max_is_differentiable_through_its_values():
    fn = tiledsl.compile("""
    kernel f(x: f32[M, N]) -> f32[M] {
        v, i = max(x, -1)
        return v * cast(i, f32)
    }""")
    report = testing.check_grads(fn, randn(17, 33))
    assert report.ok, report


@pytest.mark.parametrize("stmt, error", [
    ("a, b = x", "<string>:3:16: error: cannot unpack one value into 2 names: only a builtin with "
     "several results (max, min, cummax, cummin, topk, sort) or a tuple (`a, b = x, y`) unpacks"),
    ("a, b = x, y, x", "<string>:3:9: error: 2 names but 3 values"),
    ("a, a = x, y", "<string>:3:12: error: 'a' is assigned twice in one statement"),
    ("a, b, c = max(x, -1)", "<string>:3:9: error: 'max' gives 2 results (values, indices), not 3"),
    ("a, b = max(x, axis=(0, 1))", "<string>:3:28: error: 'axis' of 'max' unpacked must be one "
     "integer: the indices are positions along one axis"),
    ("a, b = sum(x, -1)", "<string>:3:16: error: cannot unpack one value into 2 names: only a builtin "
     "with several results (max, min, cummax, cummin, topk, sort) or a tuple (`a, b = x, y`) unpacks"),
])
def test_unpacking_errors_name_the_statement(stmt, error):
    src = f"""
    kernel f(x: f32[M, N], y: f32[M, N]) -> f32[M, N] {{
        {stmt}
        return x
    }}"""
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(src)
    assert str(err.value).splitlines()[0] == error
