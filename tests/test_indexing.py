"""Indexing: views (integers, slices with dim expressions, None, ...), gathers (advanced
indexing, gather()) and concat, checked against torch in float64, with kernel counts
and the exact text of their diagnostics."""

import math

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import TileDSLError
from tiledsl.dims import Lin, evaluate, parse


def kernels(fn, template=None):
    return [k for k in fn.kernels if template is None or k.template == template]


# --- dim expressions ------------------------------------------------------------------------


def test_dim_expressions_are_canonical():
    d, two = Lin.of("D"), Lin.of(2)
    assert (d - d // two).dim() == "D - (D // 2)"
    assert (d - d // two + d // two).dim() == "D"
    assert (d // two).dim() == "D // 2"
    assert (Lin.of("H") * Lin.of("M")).scale(2).dim() == "2 * H * M"
    assert (d.scale(4) // two).dim() == "2 * D"
    assert (Lin.of(7) // Lin.of(2)).dim() == 3
    for text in ("D - (D // 2)", "(D + 1) // 2", "2 * H * M", "-D + 3", "D - 4 * (D // 4)"):
        assert parse(text).dim() == text
        assert evaluate(text, {"D": 7, "H": 2, "M": 3}) == eval(text, {"D": 7, "H": 2, "M": 3})


def test_dim_expressions_never_evaluate_arbitrary_text():
    with pytest.raises(ValueError):
        parse("__import__('os')")


# --- views ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n, d", [(1, 2), (17, 13), (113, 64)])
def test_slices_are_views_with_dim_expression_shapes(n, d):
    src = """
    kernel f(x: f32[N, D]) -> (f32[N, D // 2], f32[N, D - D // 2], f32[D], f32[N, 1, (D + 1) // 2]) {
        return x[..., :D // 2] * 2.0, x[:, D // 2:], x[-1] + x[0], x[:, None, ::2]
    }"""
    x = randn(n, d)
    fn, (a, b, c, e) = run_checked(src, x)
    assert torch.equal(a, x[..., :d // 2] * 2)
    assert torch.equal(b, x[:, d // 2:])
    assert torch.equal(c, x[-1] + x[0])
    assert torch.equal(e, x[:, None, ::2])
    assert "slice %x {items = [:N, :D // 2]}" in fn.ir()
    assert all(k.template == "pointwise" for k in fn.kernels)


def test_literal_slices_clamp_like_python():
    x = randn(17, 5)
    fn, out = run_checked("kernel f(x: f32[17, 5]) -> f32[12, 2] { return x[5:100, -2:] }", x)
    assert torch.equal(out, x[5:100, -2:])


def test_a_slice_past_its_axis_is_refused_at_the_call():
    fn = tiledsl.compile("kernel f(x: f32[N, D]) -> f32[N, 64] { return x[:, :64] }")
    assert torch.equal(fn(x := randn(3, 70)), x[:, :64])
    with pytest.raises(TileDSLError) as err:
        fn(randn(3, 50))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:52: error: slice :64 ends past the axis (size D); at these sizes "
        "(D=50, N=3) it is not (D - 64 = -14)")


def test_slices_of_matmul_operands_read_in_place():
    src = """
    kernel f(q: f32[M, D], k: f32[N, D]) -> f32[M, N] {
        return q[:, :D // 2] @ k[:, 1:D // 2 + 1].T
    }"""
    q, k = randn(17, 16), randn(33, 17)
    fn, out = run_checked(src, q, k[:, :16])
    assert len(fn.kernels) == 1
    assert torch.allclose(out, q[:, :8] @ k[:, 1:9].T, atol=1e-5)


# --- gathers --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, v, k", [(1, 1, 1), (17, 13, 5), (113, 33, 40)])
def test_gather_matches_torch_gather(n, v, k):
    src = "kernel f(x: f32[N, V], i: i64[N, K]) -> f32[N, K] { return gather(x, i, axis=1) }"
    x = randn(n, v)
    i = torch.randint(0, v, (n, k))
    fn, out = run_checked(src, x, i)
    assert torch.equal(out, torch.gather(x, 1, i))


def test_out_of_range_indices_read_zero_and_negative_ones_count_from_the_end():
    fn = tiledsl.compile("kernel f(x: f32[N], i: i32[K]) -> f32[K] { return x[i] }")
    x = randn(7)
    i = torch.tensor([0, 6, 7, -1, -7, -8, 100, -100], dtype=torch.int32)
    expected = torch.tensor([x[0], x[6], 0.0, x[6], x[0], 0.0, 0.0, 0.0])
    assert torch.equal(fn(x, i), expected)
    assert torch.equal(fn.reference(x, i), expected)


@pytest.mark.parametrize("n", [1, 17, 113])
def test_cross_entropy_with_gather_and_an_ignore_index_is_one_row_kernel(n):
    src = """
    kernel cross_entropy(x: f32[N, V], y: i64[N]) -> f32[N] {
        loss = logsumexp(x, axis=-1) - gather(x, y, axis=-1)
        return where(y == -100, 0.0, loss)
    }"""
    x = randn(n, 113, scale=3)
    y = torch.randint(0, 113, (n,))
    y[::3] = -100
    fn, out = run_checked(src, x, y)
    assert [k.template for k in fn.kernels] == ["rows"]
    expected = torch.nn.functional.cross_entropy(x.double(), y, ignore_index=-100, reduction="none")
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_advanced_indexing_follows_numpy_placement():
    src = """
    kernel f(t: f32[T, H, D], i: i32[K], j: i32[K]) -> (f32[K, H, D], f32[T, K], f32[K, H]) {
        return t[i], t[:, :, 0][:, j], t[i, :, j]
    }"""
    t, i, j = randn(9, 5, 4), torch.randint(-9, 9, (17,), dtype=torch.int32), torch.randint(0, 4, (17,), dtype=torch.int32)
    fn, (a, b, c) = run_checked(src, t, i, j)
    assert torch.equal(a, t[i.long()])
    assert torch.equal(b, t[:, :, 0][:, j.long()])
    assert torch.equal(c, t[i.long(), :, j.long()])


def test_embedding_lookup_in_a_gemm_epilogue():
    src = """
    kernel f(a: f32[M, K], b: f32[K, N], table: f32[T, N], ids: i32[M]) -> f32[M, N] {
        return a @ b + table[ids]
    }"""
    a, b, t = randn(17, 33), randn(33, 20), randn(7, 20)
    ids = torch.randint(0, 7, (17,), dtype=torch.int32)
    fn, out = run_checked(src, a, b, t, ids)
    assert [k.template for k in fn.kernels] == ["matmul"]
    assert torch.allclose(out, a @ b + t[ids.long()], atol=1e-4)


# --- concat ---------------------------------------------------------------------------------

ROPE = """
kernel rope(q: f32[B, M, D], c: f32[M, D], s: f32[M, D]) -> f32[B, M, D] {
    return q * c + concat(-q[..., D // 2:], q[..., :D // 2], axis=-1) * s
}"""


@pytest.mark.parametrize("d", [2, 8, 64])
def test_rope_with_concat_is_one_kernel(d):
    q, c, s = randn(3, 17, d), randn(17, d), randn(17, d)
    fn, out = run_checked(ROPE, q, c, s)
    assert len(fn.kernels) == 1
    rotated = torch.cat((-q[..., d // 2:], q[..., :d // 2]), dim=-1)
    assert torch.allclose(out, q * c + rotated * s, atol=1e-6)


def test_concat_of_three_pieces_along_a_middle_axis():
    src = """
    kernel f(a: f32[N, 1, D], b: f32[N, K, D], c: f32[N, 3, D]) -> f32[N, K + 4, D] {
        return concat(a, exp(b), c * 2.0, axis=1)
    }"""
    a, b, c = randn(17, 1, 5), randn(17, 13, 5), randn(17, 3, 5)
    fn, out = run_checked(src, a, b, c)
    assert len(fn.kernels) == 1
    assert torch.allclose(out, torch.cat((a, b.exp(), c * 2), dim=1))


# --- attention ------------------------------------------------------------------------------

DOC_ATTENTION = """
kernel doc_attention(q: f16[H, M, D], k: f16[H, N, D], v: f16[H, N, D], doc: i32[M]) -> f16[H, M, D] {
    s = q @ k.T * rsqrt(D)
    s = where(causal(s) & (doc[index(s, -2)] == doc[index(s, -1)]), s, -inf)
    return softmax(s) @ v
}"""


@pytest.mark.parametrize("m", [1, 17, 113])
def test_document_masked_causal_attention_is_one_kernel(m):
    q, k, v = (randn(2, m, 32, dtype=torch.float16) for _ in range(3))
    doc = torch.sort(torch.randint(0, 4, (m,), dtype=torch.int32)).values
    fn, out = run_checked(DOC_ATTENTION, q, k, v, doc)
    assert [k.template for k in fn.kernels] == ["attention"]
    i = torch.arange(m)
    mask = (i[:, None] >= i[None, :]) & (doc[:, None] == doc[None, :])
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                attn_mask=mask)
    assert torch.allclose(out.double(), expected, atol=2e-3)


T5_BIAS = """
kernel t5(q: f32[H, M, D], k: f32[H, N, D], v: f32[H, N, D], table: f32[NB, H]) -> f32[H, M, D] {
    s = q @ k.T
    n = maximum(index(s, -2) - index(s, -1), 0)
    exact = NB // 2
    large = exact + cast(log(cast(maximum(n, 1), f32) / exact) / log(128.0 / exact) * (NB - exact), i32)
    bucket = where(n < exact, n, minimum(large, NB - 1))
    return softmax(s + table[bucket, index(s, 0)]) @ v
}"""


def test_t5_bucketed_relative_bias_is_one_attention_kernel():
    h, m, nb = 3, 113, 32
    q, k, v = randn(h, m, 16), randn(h, m, 16), randn(h, m, 16)
    table = randn(nb, h)
    fn, out = run_checked(T5_BIAS, q, k, v, table)
    assert [k.template for k in fn.kernels] == ["attention"]
    i = torch.arange(m)
    n = (i[:, None] - i[None, :]).clamp(min=0)
    exact = nb // 2
    large = exact + (torch.log(n.clamp(min=1).float() / exact) / math.log(128 / exact)
                     * (nb - exact)).to(torch.int64)
    bucket = torch.where(n < exact, n, large.clamp(max=nb - 1))
    bias = table[bucket].permute(2, 0, 1)  # [H, M, N]
    expected = torch.softmax(q.double() @ k.double().transpose(1, 2) + bias.double(), -1) @ v.double()
    assert torch.allclose(out.double(), expected, atol=1e-4)


# --- diagnostics ----------------------------------------------------------------------------

K = "kernel f(x: f32[N, D], i: i32[N], w: f32[N], b: bool[N]) -> f32[N] {\n    %s\n}"


@pytest.mark.parametrize("body, first", [
    ("return x[w]",
     "<string>:2:14: error: indexing needs an integer value, got f32; cast(i, i32) if it holds "
     "whole numbers"),
    ("return x[b, 0]",
     "<string>:2:14: error: indexing needs an integer value, got bool: a mask selects a "
     "data-dependent number of elements, which tiledsl shapes cannot express; use where(mask, x, 0)"),
    ("return x[0, 1, 2]", "<string>:2:12: error: too many indices: 3 for a value of rank 2"),
    ("return x[..., ...]", "<string>:2:19: error: an index can have only one '...'"),
    ("return x[:, ::-1]", "<string>:2:19: error: a slice step must be a positive integer literal"),
    ("return x[i, None]",
     "<string>:2:12: error: None (a new axis) cannot be mixed with tensor indices; add the axis in a "
     "second subscript, e.g. x[idx][:, None]"),
    ("return x[:, 3:1][:, 0]", "<string>:2:17: error: slice 3:1 stops before it starts"),
    ("return x[:, w[0]:]",
     "<string>:2:17: error: slice bounds are integer expressions of dims and literals (like D // 2 or "
     "N - 1); 'w[0]' is not one"),
    ("return gather(x, x, axis=1)[:, 0]",
     "<string>:2:12: error: indexing needs an integer value, got f32; cast(i, i32) if it holds whole "
     "numbers"),
    ("return concat(x, w, axis=0)",
     "<string>:2:22: error: concat needs values of one rank (1 or more), got f32[N]"),
])
def test_indexing_diagnostics(body, first):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(K % body)
    assert str(err.value).splitlines()[0] == first


def test_a_scalar_cannot_be_indexed():
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile("kernel f(s: f32) -> f32[1] { return (s * 2.0)[None] }")
    assert str(err.value).splitlines()[0] == (
        "<string>:1:37: error: a 0-d value (f32) cannot be indexed; it broadcasts as it is")


def test_parameters_cannot_declare_dim_expressions():
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile("kernel f(x: f32[N - 1]) -> f32[N - 1] { return x }")
    assert str(err.value).splitlines()[0] == (
        "<string>:1:17: error: parameter 'x' declares the dim N - 1: a parameter's dims are symbols "
        "or integers (dim expressions may appear in return types)")
