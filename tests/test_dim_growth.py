"""Dim expressions grow with the program's text, never exponentially: a product of sums is
multiplied out only while it stays small, nested `%` stay atoms, and either form has the
right value at every size (the hardening issue's 512-character slice took 152 s)."""

import itertools
import math
import random
import time

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import TileDSLError
from tiledsl.dims import EXPAND_LIMIT, Lin, evaluate, never_zero, parse


def product_of_sums(n: int) -> tuple[list[str], str]:
    names = [f"A{i}" for i in range(2 * n)]
    return names, "*".join(f"({names[2 * i]}+{names[2 * i + 1]})" for i in range(n))


def test_a_slice_bound_of_twelve_sums_compiles_at_once_and_is_right():
    names, prod = product_of_sums(12)
    params = ", ".join(f"p{i}: f32[{name}]" for i, name in enumerate(names))
    src = f"kernel k(x: f32[N], {params}) -> f32 {{ return sum(x[0:{prod}]) }}"
    assert len(src) < 520
    start = time.perf_counter()
    fn = tiledsl.compile(src)
    assert time.perf_counter() - start < 5  # was 152 s; about 0.01 s of it is the dims now
    ones = [torch.ones(1) for _ in names]
    x = randn(4100)
    torch.testing.assert_close(fn(x, *ones), x[:4096].sum(), rtol=1e-5, atol=1e-4)
    with pytest.raises(TileDSLError) as err:
        fn(randn(4000), *ones)
    assert "ends past the axis (size N); at these sizes" in str(err.value).splitlines()[0]


def test_a_product_of_many_sums_stays_factored_and_evaluates_right():
    rng = random.Random(0)
    for n in (2, 5, 12, 60):
        sums = [Lin.of(f"A{2 * i}") + Lin.of(f"A{2 * i + 1}").scale(rng.choice((1, -2))) + Lin.of(i % 3)
                for i in range(n)]
        x = math.prod(sums[1:], start=sums[0])
        assert len(str(x.dim())) < 2 * EXPAND_LIMIT + 40 * n
        for _ in range(3):
            sizes = {f"A{k}": rng.randint(1, 9) for k in range(2 * n)}
            want = math.prod(evaluate(s.dim(), sizes) for s in sums)
            assert evaluate(x.dim(), sizes) == want
            assert evaluate(parse(str(x.dim())).dim(), sizes) == want
    small = (Lin.of("H") + Lin.of(1)) * (Lin.of("W") + Lin.of(1))
    assert small.dim() == "H + W + H * W + 1"  # small products are still multiplied out


def test_nested_remainders_stay_atoms_and_evaluate_right():
    x, v = Lin.of("N"), 1_000_003
    for k in range(3, 150):
        x, v = x % Lin.of(k), v % k
    assert len(str(x.dim())) < 4000
    assert evaluate(x.dim(), {"N": 1_000_003}) == v
    assert (Lin.of("N") % Lin.of(4)).dim() == "N - 4 * (N // 4)"  # small ones as before


def test_nested_remainders_in_a_slice_compile_and_run():
    bound, v = "N", 1000
    for k in range(40):
        bound, v = f"({bound}) % {k + 3}", v % (k + 3)
    fn = tiledsl.compile(f"kernel k(x: f32[N]) -> f32 {{ return sum(x[0:{bound} + 1]) }}")
    x = randn(1000)
    torch.testing.assert_close(fn(x), x[:v + 1].sum())


def test_a_kept_factor_that_can_be_zero_decides_nothing():
    big = [Lin.of(f"A{i}") + Lin.of(f"B{i}") for i in range(12)]
    p = math.prod(big[1:], start=big[0] - Lin.of("C"))  # (A0 + B0 - C) may be 0 or negative
    assert not never_zero(p)
    q = math.prod(big[1:], start=big[0])
    assert never_zero(q) and never_zero(q + Lin.of(1))
    kept = Lin.of("N")
    for k in range(3, 60):
        kept = kept % Lin.of(k)
    assert not never_zero(kept + Lin.of("M"))


@pytest.mark.parametrize("n", [12, 40])
def test_a_declared_return_dim_of_many_sums_is_fast(n):
    names, prod = product_of_sums(n)
    params = ", ".join(f"p{i}: f32[{name}]" for i, name in enumerate(names))
    src = f"kernel k(x: f32[N], {params}) -> f32[{prod}] {{ return x[0:{prod}] }}"
    start = time.perf_counter()
    fn = tiledsl.compile(src)
    assert time.perf_counter() - start < 5
    text = fn.ir()
    assert "(A22 + A23)" in text and len(text) < 100_000


def test_products_are_equal_in_any_order_of_small_factors():
    a, b, c = (Lin.of(s) + Lin.of(1) for s in "ABC")
    for p in itertools.permutations((a, b, c)):
        assert (p[0] * p[1] * p[2]).dim() == (a * b * c).dim()
