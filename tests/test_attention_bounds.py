"""The key bound an attention kernel derives from its mask (which key blocks it skips, and
which it runs without the mask) agrees with the mask as the reference evaluates it, at
i32's extremes too: index arithmetic is i32 and wraps as torch's does (a 0-d i64 scalar
meeting an i32 index is taken as i32, as torch takes it), so a bound is computed in int64
and kept only while the mask's sums cannot wrap at the call. Forward and backward against
the float64 reference by the oracle, on awkward sizes with blocks small enough that
programs skip blocks, run them unmasked and cut them."""

import pytest

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing

ATTENTION = """@tile(BLOCK_M=16, BLOCK_N=16)
kernel attn(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]{params}) -> f32[B, M, D] {{
    s = q @ k.T
    i = index(s, -2)
    j = index(s, -1)
    s = where({mask}, s, -inf)
    return softmax(s) @ v
}}"""

# mask, scalar parameters, their values
CASES = {
    # i - 2147483647 cannot wrap, but the strict bound's offset is -2^31 - 1 + 1 - 1: no row
    # keeps a key (the kernel failed on the int32 literal 2147483648)
    "below i32": ("j < i - 2147483647", "", ()),
    # i + 2147483647 wraps from row 1 on: row 0 keeps every key, the others none (the bound,
    # overflowing in int32, dropped row 0's keys)
    "wrapping past i32": ("j <= i + 2147483647", "", ()),
    # the mask takes an i64 scalar as i32 (2^40 is 0 there: causal); the bound took it whole
    # and ran every block without the mask
    "i64 window": ("j <= i + w", ", w: i64", (2**40,)),
    "i64 window, wrapped to 5": ("j <= i + w", ", w: i64", (2**32 + 5,)),
    "i32 window at its max": ("j <= i + w", ", w: i32", (2**31 - 1,)),
    # a window's start i - w that wraps (w = -2^31)
    "window start wrapping": ("(j <= i + 3) & (j >= i - w)", ", w: i32", (-(2**31),)),
    # the same window with values that do not wrap: its bound holds, blocks are skipped
    "window": ("(j <= i + 3) & (j >= i - w)", ", w: i32", (5,)),
}
SIZES = [(1, 37), (17, 53), (53, 17), (37, 1)]

_compiled: dict[str, tiledsl.Program] = {}


def program(case: str) -> tiledsl.Program:
    if case not in _compiled:
        mask, params, _ = CASES[case]
        _compiled[case] = tiledsl.compile(ATTENTION.format(mask=mask, params=params))
    return _compiled[case]


@pytest.mark.parametrize("m, n", SIZES, ids=[f"{m}x{n}" for m, n in SIZES])
@pytest.mark.parametrize("case", list(CASES))
def test_the_forward_agrees_with_the_mask_at_i32_extremes(case, m, n):
    fn = program(case)
    assert [k.template for k in fn.kernels] == ["attention"]
    run_checked(fn, randn(2, m, 16), randn(2, n, 16), randn(2, n, 16), *CASES[case][2])


BACKWARD_SIZES = [(37, 53), (53, 17)]


@pytest.mark.parametrize("m, n", BACKWARD_SIZES, ids=[f"{m}x{n}" for m, n in BACKWARD_SIZES])
@pytest.mark.parametrize("case", list(CASES))
def test_the_backward_agrees_with_the_mask_at_i32_extremes(case, m, n):
    """The backward's two walks skip the blocks outside the same bound."""
    fn = program(case)
    assert [k.template for k in fn.backward.kernels] == ["rows", "attention_backward", "attention_backward"]
    report = testing.check_grads(fn, randn(2, m, 16), randn(2, n, 16), randn(2, n, 16), *CASES[case][2])
    assert report.ok, f"{case}: {report}"


@pytest.mark.parametrize("mask, params, bound", [
    ("j <= i + 2147483647", "", "j <= i + 2147483647 exactly while i + 2147483647 fits i32"),
    ("j < i - 2147483647", "", "j < i - 2147483647 exactly"),
    ("j <= i + w", ", w: i64", "j <= i + %a2 exactly while i + %a2 fits i32"),
    ("(j <= i + 3) & (j >= i - w)", ", w: i32",
     "j <= i + 3 and j >= i - %a2 exactly while i + 3 and i - %a2 fit i32"),
    # differences of indices and windows as distances cannot wrap: nothing to check
    ("(i - j >= 0) & (i - j < w)", ", w: i32", "j <= i and j >= i - %a2 + 1 exactly"),
    ("causal(s)", "", "j <= i exactly"),
    # a comparison in f32 (an index plus a float) is no i32 bound
    ("j <= i + 2.0", "", "none"),
])
def test_the_plan_names_the_sums_the_bound_needs_to_fit_i32(mask, params, bound):
    fn = tiledsl.compile(ATTENTION.format(mask=mask, params=params))
    assert f"key_bound = {bound}}}" in fn.ir()


def test_a_bound_that_could_wrap_is_int64_and_checked_at_the_call():
    """Its offsets are int64 scalars, the flag says whether the mask's sums fit i32 over the
    call's rows and keys, and without it no block runs without the mask and every key is
    walked."""
    source = program("wrapping past i32").kernels[0].source
    assert "kb_ok = (kb_sum0 >= -2147483648) & (kb_sum0 + (kb_rows - 1) <= 2147483647)" in source
    assert "kb_hi = tl.where(kb_ok, tl.full([], 2147483647, tl.int64), kb_keys)" in source
    assert "n_full = tl.where(kb_ok, n_full, 0)" in source
    # the walk's limits go back to the kernel's index type
    assert ("for n0 in range(tl.maximum(n_full, kv_lo), tl.minimum((tl.minimum(d1, tl.maximum(0, (pid_m + 1) "
            "* BLOCK_M + kb_hi))).to(tl.int64 if WIDE else tl.int32), kv_hi), BLOCK_N):") in source
    # a large offset that cannot wrap is int64 with no check
    source = program("below i32").kernels[0].source
    assert "kb_hi = tl.full([], -2147483648, tl.int64)" in source and "kb_ok" not in source
