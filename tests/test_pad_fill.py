"""pad, full and zeros: index maps and fills computed where they are read (never stored),
checked against torch in float64 with kernel counts, spills on sm_90 and the exact text of
their diagnostics."""

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import TileDSLError, testing
from tiledsl.backends.triton import aot


@pytest.mark.parametrize("n, d", [(1, 1), (17, 5), (113, 100)])
def test_pad_of_a_computed_value_is_read_in_place(n, d):
    src = """
    kernel f(x: f32[N, D], w: f32[E]) -> f32[N, E] {
        return pad(x * 2.0, (1, 2), axis=-1) * w
    }"""
    x, w = randn(n, d), randn(d + 3)
    fn, out = run_checked(src, x, w)
    assert len(fn.kernels) == 1
    assert torch.equal(out, F.pad(x * 2.0, (1, 2)) * w)


@pytest.mark.parametrize("n, d", [(1, 1), (17, 5), (113, 33)])
def test_pad_widths_are_dims_along_any_axis(n, d):
    """A causal convolution's left pad along time (axis 0 of [T, D]) of width K - 1, a value
    from a scalar parameter; a pad along the middle axis of a rank-3 value."""
    src = """
    kernel f(x: f32[T, D], k: f32[K, 1, 1], v: f32, y: f32[A, D, C]) -> (f32[T + K - 1, D], f32[T, D + 4],
                                                                     f32[A, D + 3, C]) {
        return pad(x, (K - 1, 0), axis=0, value=v), pad(x, (3, 1), value=-inf), pad(y, (0, 3), axis=1)
    }"""
    x, k, y = randn(n, d), randn(4, 1, 1), randn(3, d, 2)
    fn, (a, b, c) = run_checked(src, x, k, y=y, v=0.75)
    assert torch.equal(a, F.pad(x, (0, 0, 3, 0), value=0.75))
    assert torch.equal(b, F.pad(x, (3, 1), value=float("-inf")))
    assert torch.equal(c, F.pad(y, (0, 0, 0, 3)))
    assert len(fn.kernels) == 2  # x's two pads in one launch; y shares no input with them


def test_pad_keeps_an_integer_dtype():
    src = "kernel f(i: i64[N]) -> i64[N + 2] { return pad(i, (2, 0), value=-1) }"
    i = torch.randint(-5, 50, (17,))
    fn, out = run_checked(src, i)
    assert torch.equal(out, F.pad(i, (2, 0), value=-1))


@pytest.mark.parametrize("n, d", [(1, 1), (17, 5), (113, 100)])
def test_full_and_zeros_take_a_shape_and_dtype_not_values(n, d):
    src = """
    kernel f(x: f16[N, D], s: f32) -> (f16[N, D], f16[N, D], i64[N, D]) {
        return full(x, 1.5) * x, zeros(x) - x, full(cast(x, i64), s) + 1
    }"""
    x = randn(n, d).half()
    fn, (a, b, c) = run_checked(src, x, s=-2.5)
    assert torch.equal(a, torch.full_like(x, 1.5) * x)
    assert torch.equal(b, -x)
    assert torch.equal(c, torch.full((n, d), -2, dtype=torch.int64) + 1)
    assert len(fn.kernels) == 2  # the fill reads no tensor, so it shares none with x's kernel


def test_pad_and_full_compile_for_sm90_without_spills():
    src = """
    kernel f(x: f32[T, D], w: f32[E]) -> f32[T, E] {
        return pad(x, (1, 1), axis=-1, value=1.0) * w + full(w, 0.5)
    }"""
    fn = tiledsl.compile(src)
    (r,) = aot.inspect_program(fn, {"T": 4096, "D": 4094, "E": 4096})
    assert r.spill_bytes == 0


@pytest.mark.parametrize("src, message", [
    ("kernel f(x: f32[N]) -> f32[N + 2] { return pad(x, 2) }",
     "<string>:1:51: error: the widths of 'pad' must be two dims (before, after), like (1, 0) or (0, D - N)"),
    ("kernel f(x: f32[N]) -> f32[N + 1] { return pad(x, (2, -1)) }",
     "<string>:1:55: error: a pad width must be at least 0 (it is -1)"),
    ("kernel f(x: f32[N]) -> f32[N + 2] { return pad(x, (1, 1), value=x) }",
     "<string>:1:65: error: the value of 'pad' is one number, got f32[N]"),
    ("kernel f(x: f32[N]) -> f32[N] { return full(x, x) }",
     "<string>:1:48: error: the value of 'full' is one number, got f32[N]"),
    ("kernel f(x: f32) -> f32 { return pad(x, (1, 1)) }",
     "<string>:1:34: error: 'pad' needs a value of rank 1 or more"),
])
def test_bad_pads_and_fills_are_refused(src, message):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(src)
    assert str(err.value).splitlines()[0] == message


def test_a_pad_width_only_the_sizes_decide_is_checked_at_the_call():
    fn = tiledsl.compile("kernel f(x: f32[N], y: f32[M]) -> f32[M] { return pad(x, (0, M - N)) + y }")
    x, y = randn(5), randn(9)
    assert torch.equal(fn(x, y), F.pad(x, (0, 4)) + y)
    with pytest.raises(TileDSLError) as err:
        fn(randn(9), randn(5))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:62: error: a pad width must be at least 0 (it is M - N); at these sizes "
        "(M=5, N=9) it is not (M - N = -4)")


@pytest.mark.parametrize("b, d, l", [(1, 1, 1), (2, 5, 17), (1, 33, 113)])
def test_mamba_causal_conv1d_is_one_kernel(b, d, l):
    """Mamba's depthwise causal conv1d (kernel 4) as its reference writes it: a left pad of
    K - 1 and K shifted slices of the padded value, each read through the pad's index map."""
    src = """
    kernel causal_conv1d(x: f32[B, D, L], w: f32[D, 4], b: f32[D]) -> f32[B, D, L] {
        xp = pad(x, (3, 0), axis=-1)
        y = (xp[:, :, 0:L] * w[:, 0:1] + xp[:, :, 1:L + 1] * w[:, 1:2] + xp[:, :, 2:L + 2] * w[:, 2:3]
             + xp[:, :, 3:L + 3] * w[:, 3:4])
        return silu(y + b[:, None])
    }"""
    x, w, bias = randn(b, d, l), randn(d, 4, seed=1), randn(d, seed=2)
    fn, out = run_checked(src, x, w, bias)
    assert len(fn.kernels) == 1
    ref = F.silu(F.conv1d(x.double(), w.double()[:, None, :], bias.double(), padding=3, groups=d)[..., :l])
    assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("n, d", [(1, 1), (17, 5), (113, 33)])
def test_pad_and_its_slices_are_differentiable(n, d):
    """The gradient of a pad is the incoming gradient read back inside the pad (a gather's
    gradient: a scatter-add), and Mamba's conv1d's through its shifted slices too."""
    src = """
    kernel f(x: f32[N, D], w: f32[E]) -> f32[N, E] {
        return pad(sin(x), (2, 1), axis=-1, value=0.5) * w + full(w, 1.5)
    }"""
    report = testing.check_grads(tiledsl.compile(src), randn(n, d), randn(d + 3, seed=1), generator=gen(0))
    assert report.ok, report
    conv = """
    kernel causal_conv1d(x: f32[B, D, L], w: f32[D, 4]) -> f32[B, D, L] {
        xp = pad(x, (3, 0), axis=-1)
        return (xp[:, :, 0:L] * w[:, 0:1] + xp[:, :, 1:L + 1] * w[:, 1:2] + xp[:, :, 2:L + 2] * w[:, 2:3]
                + xp[:, :, 3:L + 3] * w[:, 3:4])
    }"""
    report = testing.check_grads(tiledsl.compile(conv), randn(2, d, n), randn(d, 4, seed=2), generator=gen(1))
    assert report.ok, report
