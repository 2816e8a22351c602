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


PAIR_GRADS = """
kernel f(x: f16[M, N]) -> (f16[M], f16[1, N], f16[M], f16[M, N]) {
    v, i = max(x, -1)
    w, j = min(x, axis=0, keepdims=true)
    u, k = max(x * 2.0, axis=1)
    return v, w, max(x, -1), x - u[:, None]
}"""


def pair_grads_in_torch(x, cotangents):
    """torch's: the pair's values (torch.max/min with a dim) send the gradient to the index
    alone; amax shares it between ties."""
    x = x.detach().requires_grad_(True)
    outs = (torch.max(x, -1).values, torch.min(x, 0, keepdim=True).values, torch.amax(x, -1),
            x - torch.max(x * 2.0, 1).values[:, None])
    (grad,) = torch.autograd.grad(outs, (x,), cotangents)
    return grad


@pytest.mark.parametrize("m, n", [(17, 33), (113, 5), (1, 64)])
def test_the_gradient_of_a_pairs_values_goes_to_its_index_as_torchs(m, n):
    """Many ties (f16 values rounded to a few integers): each row's gradient goes to the
    first maximum (the index returned), not shared between the tied ones; a plain max
    (amax) still shares it. Checked against torch autograd in float64 and in f16."""
    x = (randn(m, n, seed=m + n) * 2.0).round().half()
    fn = tiledsl.compile(PAIR_GRADS)
    cotangents = [randn(*t.shape, seed=7 + i).half() for i, t in enumerate(fn(x))]
    xg = x.detach().requires_grad_(True)
    (got,) = torch.autograd.grad(fn(xg), (xg,), cotangents)
    golden = pair_grads_in_torch(x.double(), [c.double() for c in cotangents])
    eager = pair_grads_in_torch(x, cotangents)
    report = testing.compare(got, golden, eager)
    assert report.ok, report
    # each row's pair gradient lands on one element: the first maximum
    xs = x.detach().requires_grad_(True)
    (alone,) = torch.autograd.grad(tiledsl.compile("""kernel f(x: f16[M, N]) -> f16[M] {
        v, i = max(x, -1)
        return v
    }""")(xs), (xs,), torch.ones(m, dtype=torch.float16))
    assert torch.equal((alone != 0).sum(-1), torch.ones(m, dtype=torch.int64))
    assert torch.equal(alone.argmax(-1), x.max(-1).indices)
