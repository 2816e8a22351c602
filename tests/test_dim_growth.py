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
    # Ones make every sum 2, so names bound to the wrong parameters would go unseen. An
    # irregular choice, then one per bit of the sum's index (its two names 2 where the bit
    # is set, else 1): swapping names of two different sums changes some product, which
    # every prefix sum of positive integers then shows (exactly, in float32).
    irregular = [1, 1, 1, 2, 2, 1, 1, 1, 3, 1, 1, 1, 1, 3, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    by_bit = [[2 if i // 2 >> bit & 1 else 1 for i in range(24)] for bit in range(4)]
    choices = [irregular, *by_bit]
    for p, q in itertools.combinations(range(24), 2):
        if p // 2 != q // 2:
            assert any(product(swapped(c, p, q)) != product(c) for c in choices), (p, q)
    g = torch.Generator().manual_seed(0)
    for sizes in choices:
        n = product(sizes)
        tensors = [torch.ones(k) for k in sizes]
        x = torch.randint(1, 9, (n + 3,), generator=g).float()
        got = fn(x, *tensors)
        torch.testing.assert_close(got, x[:n].sum(), rtol=1e-5, atol=1e-4)
        assert torch.equal(got, x[:n].sum())
        with pytest.raises(TileDSLError) as err:
            fn(x[:n - 1], *tensors)
        named = at_sizes(names, sizes, n - 1)
        first = str(err.value).splitlines()[0]
        assert f"ends past the axis (size N); at these sizes ({named}) it is not (N - " in first
        assert first.endswith(" = -1)")


def product(sizes: list[int]) -> int:
    """(A0 + A1) * (A2 + A3) * ... at these sizes of A0, A1, ..."""
    return math.prod(sizes[i] + sizes[i + 1] for i in range(0, len(sizes), 2))


def at_sizes(names: list[str], sizes: list[int], n: int) -> str:
    """The sizes as a message names them: `A0=1, A1=2, A10=1, ..., N=n`, in text order."""
    return ", ".join(f"{k}={v}" for k, v in sorted({**dict(zip(names, sizes, strict=True)), "N": n}.items()))


def swapped(sizes: list[int], p: int, q: int) -> list[int]:
    out = list(sizes)
    out[p], out[q] = out[q], out[p]
    return out


def shown(sums: list[tuple[str, str]]) -> str:
    """A product of sums of two names as a message prints it: the first four multiplied out
    (512 characters hold no more of these), names and terms in text order, then the other
    sums, all factors in text order."""
    terms = sorted(" * ".join(sorted(t)) for t in itertools.product(*sums[:4]))
    factors = [f"({' + '.join(terms)})", *(f"({' + '.join(sorted(s))})" for s in sums[4:])]
    return " * ".join(sorted(factors))


def excerpt(src: str, at: int) -> str:
    """The two lines under a message whose span starts at `src[at]` and runs 53 characters or
    more, in a one-line program: a window of 100 around the caret, and its underline."""
    assert 50 < at and at + 50 < len(src)
    return f"    ...{src[at - 50:at + 50]}...\n    {' ' * 53}^{'~' * 52}"


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
    declared = [(names[2 * i], names[2 * i + 1]) for i in range(n)]
    # At small sizes (every sum past the fifth 1 + 0) it returns x's first `prod` elements...
    sizes = [2, 1, 0, 3, 1, 1, 0, 1, 2, 2] + [1, 0] * (n - 5)
    assert product(sizes) == 72
    tensors = [torch.ones(k) for k in sizes]
    x = torch.arange(80.0)
    assert torch.equal(fn(x, *tensors), x[:72])
    # ... and one fewer is refused, with the sizes named
    with pytest.raises(TileDSLError) as err:
        fn(x[:71], *tensors)
    named = at_sizes(names, sizes, 71)
    at = src.index("x[0:") + 2  # at the slice
    assert str(err.value) == (
        f"<string>:1:{at + 1}: error: slice 0:{prod} ends past the axis (size N); at these sizes "
        f"({named}) it is not (N - {shown(declared)} = -1)\n{excerpt(src, at)}")
    # Returning the same kind of product over other pairs of names: equal to the declared dim
    # at some sizes and not at others, so compile cannot decide and each call checks it.
    returned = [(names[2 * i + 1], names[(2 * i + 2) % (2 * n)]) for i in range(n)]
    other = "*".join(f"({a}+{b})" for a, b in returned)
    src = f"kernel k(x: f32[N], {params}) -> f32[{prod}] {{ return x[0:{other}] }}"
    start = time.perf_counter()
    fn = tiledsl.compile(src)
    assert time.perf_counter() - start < 5
    sizes = [1, 1, 1, 1] + [1, 0] * (n - 2)
    assert product(sizes) == product(sizes[1:] + sizes[:1]) == 4  # declared and returned
    assert torch.equal(fn(x, *[torch.ones(k) for k in sizes]), x[:4])
    # Declared (1 + 2) * (2 + 1) = 9 and returned (2 + 2) * (1 + 1) * (0 + 1) = 8: the check
    # that returned - declared >= 0 fails; and 9 against (1 + 1) * (2 + 1) * (0 + 2) = 12.
    at = src.index("x[0:")  # at the returned value
    for head, fails in (([1, 2, 2, 1], f"-{shown(declared)} + {shown(returned)} = -1"),
                        ([2, 1, 1, 2], f"{shown(declared)} - {shown(returned)} = -3")):
        sizes = head + [1, 0] * (n - 2)
        assert product(sizes) == 9 and product(sizes[1:] + sizes[:1]) == {1: 8, 2: 12}[head[0]]
        with pytest.raises(TileDSLError) as err:
            fn(x, *[torch.ones(k) for k in sizes])
        named = at_sizes(names, sizes, 80)
        assert str(err.value) == (
            f"<string>:1:{at + 1}: error: the returned value has shape [{shown(returned)}] but the "
            f"kernel declares [{shown(declared)}]; at these sizes ({named}) it is not ({fails})\n"
            f"{excerpt(src, at)}")


def test_products_are_equal_in_any_order_of_small_factors():
    a, b, c = (Lin.of(s) + Lin.of(1) for s in "ABC")
    for p in itertools.permutations((a, b, c)):
        assert (p[0] * p[1] * p[2]).dim() == (a * b * c).dim()


def test_a_floor_division_of_a_dim_may_be_zero():
    """`D // 2` is 0 at D = 1, so `D // 2 + 1` meets a declared 1 there: checked at the call,
    not refused when compiled as if they never met."""
    fn = tiledsl.compile("""kernel f(x: f32[D]) -> f32[1] {
    return x[0 : D // 2 + 1] * 2.0
}""")
    x = torch.randn(1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fn(x), x * 2.0)
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn(torch.randn(4))
    assert str(err.value).splitlines()[0] == (
        "<string>:2:12: error: the returned value has shape [(D // 2) + 1] but the kernel declares [1]; "
        "at these sizes (D=4) it is not (-(D // 2) = -2)")
