"""Zero-size dims follow torch for every op family (issue 26; they were refused at the call).

Sizes of 0 give empty results where torch's are empty, and torch's values where they are
not: a sum over an empty axis is 0, a mean NaN, a logsumexp -inf, a matmul with K = 0 its
epilogue applied to zeros, attention with no keys 0. A max or min over an empty axis has
no value, and torch raises: so do both backends, at the reduction.
"""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import diagnostics as diag


def agrees_with_torch(src: str, expected, *args: torch.Tensor, backend: str = "triton") -> None:
    """The program's result has torch's shape, dtype and values (NaN where torch has NaN)."""
    fn = tiledsl.compile(src, backend=backend)
    for _ in range(2):  # the first call builds the launch plan; the second takes the fast path
        got = fn(*args)
        want = expected(*(a.double() if a.is_floating_point() else a for a in args))
        assert got.shape == want.shape and got.dtype == args[0].dtype
        torch.testing.assert_close(got.double(), want, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_zero_size_pointwise_is_empty(shape):
    agrees_with_torch("kernel f(x: f32[M, N]) -> f32[M, N] { return exp(x) * 2.0 - x }",
                      lambda x: torch.exp(x) * 2 - x, randn(*shape))


REDUCTIONS = [
    ("sum(x)", lambda x: x.sum(-1)),
    ("mean(x)", lambda x: x.mean(-1)),
    ("logsumexp(x)", lambda x: x.logsumexp(-1)),
]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("expr, expected", REDUCTIONS, ids=["sum", "mean", "logsumexp"])
def test_zero_size_reduction_over_an_empty_axis_is_its_identity(expr, expected, backend):
    agrees_with_torch(f"kernel f(x: f32[M, N]) -> f32[M] {{ return {expr} }}", expected,
                      randn(3, 0), backend=backend)


@pytest.mark.parametrize("expr, expected", [
    ("sum(x)", lambda x: x.sum(-1)), ("max(x)", lambda x: x.amax(-1)),
    ("min(x)", lambda x: x.amin(-1))], ids=["sum", "max", "min"])
def test_zero_size_reduction_of_no_rows_is_empty(expr, expected):
    agrees_with_torch(f"kernel f(x: f32[M, N]) -> f32[M] {{ return {expr} }}", expected, randn(0, 5))


def test_zero_size_sum_of_everything_is_zero():
    agrees_with_torch("kernel f(x: f32[M, N]) -> f32 { return sum(x, axis=None) }",
                      lambda x: x.sum(), randn(0, 7))


@pytest.mark.parametrize("body, expected", [
    ("softmax(x)", lambda x: x.softmax(-1)),
    ("cumsum(x)", lambda x: x.cumsum(-1)),
    ("x * rsqrt(mean(x * x, keepdims=true) + 1e-6)", lambda x: x * torch.rsqrt((x * x).mean(-1, True) + 1e-6)),
], ids=["softmax", "cumsum", "rmsnorm"])
def test_zero_size_row_programs_over_empty_rows_are_empty(body, expected):
    agrees_with_torch(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return {body} }}", expected, randn(3, 0))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["max", "min"])
def test_max_over_an_empty_axis_raises(kind, backend):
    fn = tiledsl.compile(f"kernel f(x: f32[M, N]) -> f32[M] {{ return {kind}(x) }}", backend=backend)
    with pytest.raises(diag.EmptyReductionError) as err:
        fn(randn(3, 0))
    size = "N = 0" if backend == "triton" else "axis 1 has size 0"
    assert str(err.value).splitlines()[0] == (
        f"<string>:1:43: error: {kind} over an empty axis ({size} at this call): {kind} has no "
        "identity (torch raises too)")
    with pytest.raises(IndexError):  # torch agrees
        getattr(torch, f"a{kind}")(torch.randn(3, 0), -1)


@pytest.mark.parametrize("a, b", [((3, 0), (0, 4)), ((0, 5), (5, 4)), ((3, 5), (5, 0)),
                                  ((2, 0, 5), (5, 4))], ids=["K=0", "M=0", "N=0", "B=0"])
def test_zero_size_matmul_follows_torch(a, b):
    """K = 0 is a matmul of zeros, then the epilogue (+ 1.5)."""
    src = ("kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M, N] { return a @ b + 1.5 }" if len(a) == 2 else
           "kernel f(a: f32[B, M, K], b: f32[K, N]) -> f32[B, M, N] { return a @ b + 1.5 }")
    agrees_with_torch(src, lambda x, y: x @ y + 1.5, randn(*a), randn(*b))


ATTENTION = """
kernel f(q: f32[M, D], k: f32[N, D], v: f32[N, D]) -> f32[M, D] {
    s = q @ k.T * rsqrt(D)
    return softmax(where(causal(s), s, -inf)) @ v
}
"""


def reference_attention(q, k, v):
    s = q @ k.T * q.shape[-1] ** -0.5
    s = torch.where(torch.ones(s.shape, dtype=torch.bool).tril(), s, -torch.inf)
    p = torch.softmax(s, -1).nan_to_num()  # a row with no keys: 0 (the numerics contract)
    return p @ v


@pytest.mark.parametrize("m, n", [(3, 0), (0, 5)], ids=["no keys", "no queries"])
def test_zero_size_attention_follows_torch(m, n):
    q, k, v = randn(m, 16), randn(n, 16), randn(n, 16)
    agrees_with_torch(ATTENTION, reference_attention, q, k, v)
    fn = tiledsl.compile(ATTENTION)
    assert [op.template for op in fn.kernel_ops()] == ["attention"]


@pytest.mark.parametrize("m, n", [(3, 0), (0, 5)], ids=["no keys", "no queries"])
def test_zero_size_attention_backward_follows_torch(m, n):
    fn = tiledsl.compile(ATTENTION)
    leaves = [randn(m, 16).requires_grad_(), randn(n, 16).requires_grad_(), randn(n, 16).requires_grad_()]
    out = fn(*leaves)
    grad = randn(*out.shape)
    out.backward(grad)
    twins = [x.detach().double().requires_grad_() for x in leaves]
    reference_attention(*twins).backward(grad.double())
    for got, want in zip(leaves, twins, strict=True):
        assert got.grad.shape == want.grad.shape
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_zero_size_gradients_of_a_reduction_and_a_matmul():
    fn = tiledsl.compile("kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M] { return sum(a @ b) + sum(a * a) }")
    a, b = randn(3, 0).requires_grad_(), randn(0, 4).requires_grad_()
    fn(a, b).backward(randn(3))
    assert a.grad.shape == (3, 0) and b.grad.shape == (0, 4)


def test_zero_size_slices_gathers_and_reshapes():
    agrees_with_torch("kernel f(x: f32[M, N]) -> f32[M, N // 2] { return x[:, :N // 2] * 2.0 }",
                      lambda x: x[:, :0] * 2, randn(3, 1))
    ids = torch.zeros(0, dtype=torch.int32)
    agrees_with_torch("kernel f(t: f32[V, D], i: i32[N]) -> f32[N, D] { return t[i] + 1.0 }",
                      lambda t, i: t[i] + 1, randn(5, 3), ids)
    agrees_with_torch("kernel f(x: f32[A, B, C]) -> f32[A, B * C] { return reshape(x, [A, B * C]) - 1.0 }",
                      lambda x: x.reshape(x.shape[0], -1) - 1, randn(2, 0, 3))
