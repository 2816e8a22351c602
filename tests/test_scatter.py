"""scatter, scatter_add and index_add (torch's, out of place) and the gradients of gathers,
which are scatter-adds: against float64 torch on awkward sizes, with repeated indices,
along each axis; kernel counts; diagnostics; sm_90 builds without spills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import SIZES, gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
F16 = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def grads_ok(fn, *args, seed=0):
    report = testing.check_grads(fn, *args, generator=gen(seed))
    assert report.ok, f"{fn.name}: {report}"


def indices(high, *shape, seed=0, low=0):
    return torch.randint(low, high, shape, generator=gen(seed))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_scatter_add_with_repeated_indices(n, axis, dt):
    x, s = randn(7, n, dtype=F16[dt]), randn(13, n, dtype=F16[dt]) if axis == 0 else randn(7, 2 * n + 1, dtype=F16[dt])
    bound = 7 if axis == 0 else n
    idx = indices(bound, *s.shape, seed=n)
    src = f"kernel f(x: {dt}[N, D], idx: i64[M, K], s: {dt}[M, K]) -> {dt}[N, D] {{ return scatter_add(x, idx, s, {axis}) }}"
    fn, out = run_checked(src, x, idx, s)
    torch.testing.assert_close(out.double(), x.double().scatter_add(axis, idx, s.double()),
                               rtol=1e-5 if dt == "f32" else 1e-2, atol=1e-5 if dt == "f32" else 2e-2)
    # f32 adds into a copy of x (one kernel); f16's go to f32, added to x and rounded after
    assert [k.template for k in fn.kernels] == (["indexed"] if dt == "f32" else ["indexed", "pointwise"])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_index_add_along_each_axis(n, axis):
    x = randn(5, n, 3)
    a = axis % 3
    k = 2 * x.shape[a] + 1
    shape = list(x.shape)
    shape[a] = k
    s, idx = randn(*shape), indices(x.shape[a], k, seed=n)
    fn, out = run_checked(f"kernel f(x: f32[A, B, C], idx: i64[K], s: f32[P, Q, R]) -> f32[A, B, C] "
                          f"{{ return index_add(x, {axis}, idx, s) }}".replace(
                              "s: f32[P, Q, R]", "s: f32[" + ", ".join(
                                  "K" if d == a else "ABC"[d] for d in range(3)) + "]"), x, idx, s)
    torch.testing.assert_close(out.double(), x.double().index_add(a, idx, s.double()), rtol=1e-5, atol=1e-5)
    assert [k.template for k in fn.kernels] == ["indexed"]  # the adds into a copy of x


@pytest.mark.parametrize("n", SIZES)
def test_scatter_with_unique_indices_writes_src(n):
    x, s = randn(n, 6), randn(n, 6)
    idx = torch.stack([torch.randperm(n, generator=gen(c)) for c in range(6)], 1)
    fn, out = run_checked("kernel f(x: f32[N, D], idx: i64[N, D], s: f32[N, D]) -> f32[N, D] "
                          "{ return scatter(x, idx, s * 2.0, 0) }", x, idx, s)
    x0 = x.clone()
    assert torch.equal(out, x.scatter(0, idx, s * 2.0))
    assert torch.equal(x, x0), "the scatter wrote into its caller's x"
    # one indexed kernel, storing s * 2 at the indices into a copy of x (no mask, no merge)
    assert [k.template for k in fn.kernels] == ["indexed"]
    # fewer indices than rows: the rows not written keep x; a scalar src is broadcast
    idx = idx[: max(n // 2, 1)]
    fn, out = run_checked("kernel f(x: f32[N, D], idx: i64[M, D]) -> f32[N, D] "
                          "{ return scatter(x, idx, 1.5, 0) }", x, idx)
    assert torch.equal(out, x.scatter(0, idx, 1.5))


def test_scatter_with_repeated_indices_writes_one_of_them():
    """Which write wins is unspecified, as torch's: each element is x's or one written there."""
    x, s = randn(5, 17), randn(40, 17)
    idx = indices(5, 40, 17, seed=3)
    out = tiledsl.compile("kernel f(x: f32[N, D], idx: i64[M, D], s: f32[M, D]) -> f32[N, D] "
                          "{ return scatter(x, idx, s, 0) }")(x, idx, s)
    for i in range(5):
        for j in range(17):
            written = s[:, j][idx[:, j] == i]
            assert out[i, j] in written if len(written) else out[i, j] == x[i, j]


def test_out_of_range_indices_write_nothing_and_check_bounds_says_where():
    """As gathers read 0 there: a negative index counts from the end, one outside [-n, n)
    writes nothing; with check_bounds=True the call raises at the scatter."""
    src = "kernel f(x: f32[N, D], idx: i64[M], s: f32[M, D]) -> f32[N, D] {\n    return index_add(x, 0, idx, s)\n}"
    x, s = randn(7, 17), randn(5, 17)
    idx = torch.tensor([0, -1, 7, -8, 3])
    out = tiledsl.compile(src)(x, idx, s)
    ref = x.clone()
    ref[0] += s[0]
    ref[6] += s[1]
    ref[3] += s[4]
    torch.testing.assert_close(out, ref)
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(src, check_bounds=True)(x, idx, s)
    assert err.value.message == ("index out of range: 2 index values for axis 0 of 'x' (size N = 7 at "
                                 "this call) are outside [-7, 7)")


@pytest.mark.parametrize("n", SIZES)
def test_scatter_add_and_index_add_gradients(n):
    fn = tiledsl.compile("kernel f(x: f32[N, D], idx: i64[M, D], s: f32[M, D]) -> f32[N, D] "
                         "{ return scatter_add(x, idx, s * s, 0) }")
    grads_ok(fn, randn(7, n), indices(7, 13, n, seed=n), randn(13, n))
    fn = tiledsl.compile("kernel f(x: f32[N, D], idx: i64[M], s: f32[M, D]) -> f32[N, D] "
                         "{ return exp(index_add(x, 0, idx, s)) }")
    grads_ok(fn, randn(7, n), indices(7, 2 * n + 1, seed=n), randn(2 * n + 1, n))
    fn = tiledsl.compile("kernel f(x: bf16[N, D], idx: i64[M, D], s: bf16[M, D]) -> bf16[N, D] "
                         "{ return scatter(x, idx, s, 1) }")
    idx = torch.stack([torch.randperm(n, generator=gen(r)) for r in range(3)])
    grads_ok(fn, randn(3, n, dtype=torch.bfloat16), idx, randn(3, n, dtype=torch.bfloat16))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_a_scatter_add_of_a_scatter_add_at_the_same_indices(n, dt):
    """Fuzz finding 0:13094: the second put writes values computed from the first one's
    result, so it cannot join its kernel; the index expressions both read were taken into
    the first kernel as though it would, and stored there as if they were puts (an internal
    error: zip() argument 2 is longer than argument 1). They stay outside both, stored once."""
    src = f"""kernel f(x: {dt}[M, N], k: i32[M, N]) -> {dt}[M, N] {{
    i = abs(k) % M
    return scatter_add(x, i, scatter_add(x, i, x, 0) * 0.5, 0)
}}"""
    x, k = randn(n, 2 * n + 1, dtype=F16[dt]), indices(3 * n + 2, n, 2 * n + 1, seed=n, low=-3 * n - 2)
    fn, _ = run_checked(src, x, k.int())
    # f32 adds into a copy of x; f16 adds go to f32, added to x after
    after = ["pointwise"] if dt != "f32" else []
    assert [k.template for k in fn.kernels] == ["pointwise", "pointwise", "indexed", "indexed", *after]
    # a parameter's indices: the positions along the other axis are the shared producer
    fn, _ = run_checked(src.replace("abs(k) % M", "k"), x, k.abs().remainder(n).int())
    assert [k.template for k in fn.kernels] == ["pointwise", "indexed", "indexed", *after]
    if dt == "f32":
        grads_ok(fn, x, k.abs().remainder(n).int())
    # the index expressions read by a put a kernel formed before (a) and by one that cannot
    # join it (after b): they stay outside the second too
    src = f"""kernel f(x: {dt}[M, N], k: i32[M, N], j: i32[M, N]) -> ({dt}[M, N], {dt}[M, N]) {{
    i = abs(k) % M
    a = scatter_add(x, i, x, 0)
    b = scatter_add(x, j, x * 2.0, 0)
    return a, scatter_add(x, i, b * 0.5, 0)
}}"""
    fn, _ = run_checked(src, x, k.int(), indices(n, n, 2 * n + 1, seed=n + 1).int())
    assert [k.template for k in fn.kernels].count("indexed") == 3


def test_a_scatter_into_one_element_adds_every_lane():
    """Fuzzer, fills stream, program 204: the gradient of a pad of a [1, 1] mean read back at
    one element is a put whose indices are all constants: each lane adds through a pointer
    of its own (one scalar pointer with a block mask was refused by Triton)."""
    fn = tiledsl.compile("""kernel f(z: f32[M, 1]) -> f32[1, 1] {
        return pad(mean(z, axis=(0, -1), keepdims=true), (1, 0))[:, :1] * 2.0
    }""")
    grads_ok(fn, randn(17, 1))
    src = ("kernel f(x: f32[M, N], i: i64[1]) -> f32[1] "
           "{ return index_add(zeros(cast(i, f32)), 0, i * 0, sum(x, axis=None, keepdims=true)[0]) }")
    x = randn(17, 5)
    fn, out = run_checked(src, x, torch.tensor([0]))
    assert torch.allclose(out, x.sum()[None], atol=1e-5)


@pytest.mark.parametrize("n", SIZES)
def test_embedding_gradient_is_one_indexed_kernel(n):
    fn = tiledsl.compile("kernel emb(w: f32[V, D], tokens: i64[T]) -> f32[T, D] { return w[tokens, :] * 2.0 }")
    grads_ok(fn, randn(11, n), indices(11, 2 * n + 1, seed=n))
    assert [k.template for k in fn.backward.kernels] == ["indexed"]


@pytest.mark.parametrize("n", SIZES)
def test_cross_entropy_gradient_with_a_gathered_target(n):
    src = (EXAMPLES / "cross_entropy.tdsl").read_text()
    fn = tiledsl.compile(src)
    logits, labels = randn(n, 37), indices(37, n, seed=n)
    labels[0] = -100
    args = [logits, labels.to(torch.int64)]
    grads_ok(fn, *args)
    # the gather's gradient is a one-hot term (class == label) in the softmax's row program
    assert [k.template for k in fn.backward.kernels] == ["rows"]


@pytest.mark.parametrize("t, b", [(1, 1), (17, 3), (113, 17)])
def test_embedding_bag_example(t, b):
    fn = tiledsl.compile((EXAMPLES / "embedding_bag.tdsl").read_text())
    v, d = 23, 17
    tokens = indices(v, t, seed=t)
    offsets = torch.sort(indices(t, b, seed=b)).values
    offsets[0] = 0
    w, psw = randn(v, d), randn(t)
    fn2, out = run_checked(fn, tokens, offsets, w, psw)
    ref = torch.nn.functional.embedding_bag(tokens, w.double(), offsets, mode="sum",
                                            per_sample_weights=psw.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # the bag ids (a row program), then the gather, product and adds in one kernel
    assert [k.template for k in fn.kernels] == ["rows", "indexed"]
    grads_ok(fn, tokens, offsets, w, psw)
    assert [k.template for k in fn.backward.kernels].count("indexed") == 1


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_scatter_kernels_build_for_sm90_without_spills(dt):
    for call in ("scatter_add(x, idx, s, 0)", "scatter(x, idx, s, 0)", "index_add(x, 0, idx[:, 0], s)"):
        fn = tiledsl.compile(f"kernel f(x: {dt}[N, D], idx: i64[M, D], s: {dt}[M, D]) -> {dt}[N, D] "
                             f"{{ return {call} }}")
        reports = aot.inspect_program(fn, {"N": 4096, "D": 4096, "M": 4096})
        assert [r for r in reports if r.spill_bytes] == []
        # scatter stores into a copy of x, and f32's adds add into one; f16's go to f32, added
        # to x after
        assert len(reports) == (1 if call.startswith("scatter(") or dt == "f32" else 2)


@pytest.mark.parametrize("src, message", [
    ("kernel f(x: f32[N, D], i: i64[M], s: f32[M, D]) -> f32[N, D] { return scatter_add(x, i, s, 0) }",
     "'scatter_add' needs an index of x's rank 2, got rank 1"),
    ("kernel f(x: f32[N, D], i: f32[M, D], s: f32[M, D]) -> f32[N, D] { return scatter(x, i, s, 0) }",
     "indexing needs an integer value, got f32; cast(i, i32) if it holds whole numbers"),
    ("kernel f(x: f32[N, D], i: i64[M, D], s: f32[M, 3]) -> f32[N, D] { return scatter(x, i, s, 0) }",
     "'scatter' needs src of the index's shape [M, D], got [M, 3]"),
    ("kernel f(x: f32[N, D], i: i64[M, D], s: f32[M, D]) -> f32[N, D] { return scatter(x, i, s, 2) }",
     "axis 2 is out of range for a value of rank 2 (valid: -2 to 1)"),
    ("kernel f(x: f32[N, D], i: i64[M, 2], s: f32[M, D]) -> f32[N, D] { return index_add(x, 0, i, s) }",
     "'index_add' needs a 1-d index, got i64[M, 2]"),
    ("kernel f(x: f32[N, D], i: i64[M], s: f32[M, 3]) -> f32[N, D] { return index_add(x, 0, i, s) }",
     "'index_add' needs src of x's sizes but along axis 0; dim 1 is 3 here and D in x"),
    ("kernel f(x: f32[N, D], i: i64[K], s: f32[M, D]) -> f32[N, D] { return index_add(x, 0, i, s) }",
     "'index_add' needs src of the index's length K along axis 0, got M"),
    ("kernel f(x: f32[N, D], i: i64[M], s: f32[M]) -> f32[N, D] { return index_add(x, 0, i, s) }",
     "'index_add' needs src of x's rank 2, got f32[M]"),
    ("kernel f(x: f32, i: i64[M], s: f32[M]) -> f32 { return index_add(x, 0, i, s) }",
     "'index_add' needs a value of rank 1 or more, got f32"),
])
def test_bad_scatters_are_located_errors(src, message):
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(src)
    assert err.value.message == message
