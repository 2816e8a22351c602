"""Dims used as values compute as Python's ints would (weak integers compute in i64).

`x / (M * N)` at M·N = 2^31 used to divide by -2^31 and `x * (M * N)` at 2^32 to give 0,
because the product of two dims computed in i32. The sizes here reach past 2^31 through
a stride-0 expanded argument that binds a dim without the memory: only the small
tensors are read.
"""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import testing

PRODUCTS = """
kernel f(a: f32[M], b: f32[N]) -> (f32[M], f32[M], f32[M], i64[M]) {
    return a / (M * N), a * (M * N), a + rsqrt(M * N), cast(index(a, 0), i64) + M * N % 1000003
}
"""


def huge(n: int) -> torch.Tensor:
    """A tensor of n elements that holds one (stride 0)."""
    return torch.zeros(1).expand(n)


def golden_products(a: torch.Tensor, m: int, n: int, dtype) -> tuple:
    """What Python's arithmetic on the sizes gives, with `a` in `dtype`."""
    a = a.to(dtype)
    return a / (m * n), a * (m * n), a + (m * n) ** -0.5


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("m, n", [(5, 2**29 + 3), (2**16, 2**16), (3, 2**31 + 11)])
def test_products_of_dims_past_int32_compute_as_python_does(backend, m, n):
    fn = tiledsl.compile(PRODUCTS, backend=backend)
    a = randn(m, seed=m)
    quotient, product, shifted, ints = fn(a, huge(n))
    for out, gold, eager in zip((quotient, product, shifted), golden_products(a, m, n, torch.float64),
                                golden_products(a, m, n, torch.float32), strict=True):
        report = testing.compare(out, gold, eager)
        assert report.ok, report
    assert torch.equal(ints, torch.arange(m) + (m * n) % 1000003)


def test_a_dim_product_of_2_to_the_31_is_positive():
    """The issue's case: 16k tokens by a 128k vocabulary is 2^31 elements."""
    fn = tiledsl.compile("kernel f(a: f32[M], b: f32[N]) -> f32[M] { return a / (M * N) }")
    a = randn(17, seed=3)
    out = fn(a, huge(2**31 // 17 + 1))
    count = 17 * (2**31 // 17 + 1)
    assert count > 2**31
    assert torch.equal(torch.sign(out), torch.sign(a))
    assert testing.compare(out, a.double() / count, a / count).ok


def test_dim_values_compute_in_int64_in_the_generated_kernel():
    fn = tiledsl.compile("kernel f(a: f32[M], b: f32[N]) -> f32[M] { return a * (M * N) }")
    (kernel,) = fn.kernels
    assert "tl.full([], 0, tl.int64) + in1_val" in kernel.source
    assert "tl.full([], 0, tl.int64) + in2_val" in kernel.source
    assert "tl.int32" not in kernel.source
    # the IR keeps the type rule: a dim is a weak i32 (it does not promote a tensor)
    assert "dim M : weak i32" in fn.ir("graph")
    assert "= mul %0, %1 : weak i32" in fn.ir("graph")
    assert "= mul %a, %2 : f32[M]" in fn.ir("graph")


def test_a_cast_of_a_dim_product_to_i32_wraps_there():
    """An explicit cast wraps, as torch's does; only the weak arithmetic is wide."""
    src = "kernel f(a: i32[M], b: f32[N]) -> (i32[M], i64[M]) { return a + cast(M * N, i32), cast(a, i64) + M * N }"
    m, n = 4, 2**30 + 1
    a = torch.arange(m, dtype=torch.int32)
    wrapped = torch.tensor(m * n, dtype=torch.int64).to(torch.int32)
    for backend in ("triton", "reference"):
        x, y = tiledsl.compile(src, backend=backend)(a, huge(n))
        assert torch.equal(x, a + wrapped), backend
        assert torch.equal(y, a.long() + m * n), backend


@pytest.mark.parametrize("m, n", [(3, 2**29 + 7), (113, 2**26 + 1)])
def test_dim_products_in_row_and_gemm_kernels(m, n):
    """The row template and a GEMM epilogue read dims as arguments too."""
    src = """
    kernel f(x: f32[M, K], w: f32[K, P], b: f32[N]) -> (f32[M], f32[M, P]) {
        return sum(x, axis=-1) / (K * N), (x @ w) * (P * N)
    }
    """
    fn = tiledsl.compile(src)
    x, w = randn(m, 17, seed=1), randn(17, 9, seed=2)
    rows, gemm = fn(x, w, huge(n))
    assert testing.compare(rows, x.double().sum(-1) / (17 * n), x.sum(-1) / (17 * n)).ok
    assert testing.compare(gemm, (x.double() @ w.double()) * (9 * n), (x @ w) * (9 * n)).ok


@pytest.mark.parametrize("shape, axis", [((7, 1000), -1), ((3, 131, 67), (1, 2)), ((5, 4099), -1)])
def test_a_mean_divides_its_f64_total_by_the_exact_count_and_rounds_once(shape, axis):
    """An f32 mean is its f64 sum divided by the row's length (an argument of the kernel,
    exact however long the row is), rounded to f32 once: the correctly rounded mean."""
    fn = tiledsl.compile(f"kernel f(x: f32[A, B, C]) -> f32[A] {{ return mean(x, axis={axis}) }}"
                         if len(shape) == 3 else
                         "kernel f(x: f32[A, B]) -> f32[A] { return mean(x, axis=-1) }")
    x = randn(*shape, seed=sum(shape)) + 0.3
    out = fn(x)
    exact = x.double().mean(dim=axis if isinstance(axis, int) else tuple(axis))
    assert torch.equal(out, exact.float())
    source = "\n".join(k.source for k in fn.kernels)
    assert ".to(tl.float32)" in source and "tl.float64" in source
    divided = [line for line in source.splitlines() if " / " in line and "tl.float32" in line]
    assert divided, source


def test_mean_gradient_divides_by_a_product_of_dims_in_int64():
    """The gradient of a mean over a flattened axis divides by the size of that axis, a
    product of dims: exact (the backward's dims are weak integers too)."""
    src = "kernel f(x: f32[B, T]) -> f32[1] { return mean(reshape(x, [1, B * T]), axis=-1) }"
    fn = tiledsl.compile(src)
    x = randn(13, 29, seed=5)
    report = testing.check_grads(fn, x)
    assert report.ok, report
