"""What a scalar parameter's declared dtype means for its value.

A float scalar parameter is used at f32 whatever its declared float dtype: an f16 or bf16
one is not rounded to it, as torch uses a Python scalar beside a half-precision tensor
(`x_f16 * 1.0007` computes 1000 * 1.0007 in f32, then rounds once). The compiled kernels
take it as an f32 argument; the reference backend, the oracle's eager leg, holds it so too
(it rounded it to f16, so the two backends disagreed).
"""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import testing

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("n", [1, 17, 1023])
def test_a_half_precision_scalar_is_used_at_f32_as_torch_uses_a_python_scalar(dtype, n):
    x = (randn(n, seed=n) * 300.0).to(DTYPES[dtype])
    # between two values of the dtype, far enough from both that rounding it first changes
    # products
    s = {"f16": 1.0007, "bf16": 1.006}[dtype]
    src = f"kernel f(x: {dtype}[N], s: {dtype}) -> {dtype}[N] {{ return x * s }}"
    want = x * s  # torch, with a Python scalar
    for backend in ("triton", "reference"):
        out = tiledsl.compile(src, backend=backend)(x, s)
        assert torch.equal(out, want), backend
    assert torch.equal(tiledsl.compile(src).reference(x, s), want)
    # the rounded scalar would have given other products somewhere
    assert not torch.equal(x * torch.tensor(s, dtype=DTYPES[dtype]), want) or n == 1


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_half_precision_scalar_in_a_fused_chain_meets_the_oracle(dtype):
    """The golden result takes the scalar as given (float64); compiled and eager (torch
    with the Python scalar) are measured against it."""
    x = randn(37, 113, seed=4).to(DTYPES[dtype])
    s = 0.3337
    fn = tiledsl.compile(f"kernel f(x: {dtype}[M, N], s: {dtype}) -> {dtype}[M, N] {{ return (x * s + 1.0) * s }}")
    out = fn(x, s)
    golden = (x.double() * s + 1.0) * s
    eager = (x * s + 1.0) * s
    report = testing.compare(out, golden, eager)
    assert report.ok, report
    assert testing.compare(fn.reference(x, s), golden, eager).ok


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_comparison_with_a_half_precision_scalar_rounds_both_sides_as_torch(dtype):
    """torch compares in the tensor's dtype (the scalar rounded to it): so do both backends."""
    x = torch.tensor([1.0, 1.0009765625, 0.99951171875, 2.0], dtype=DTYPES[dtype])
    s = 1.0002
    src = f"kernel f(x: {dtype}[N], s: {dtype}) -> (bool[N], bool[N]) {{ return x < s, x == s }}"
    for backend in ("triton", "reference"):
        lt, eq = tiledsl.compile(src, backend=backend)(x, s)
        assert torch.equal(lt, x < s) and torch.equal(eq, x == s), backend
