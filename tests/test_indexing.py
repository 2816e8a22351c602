"""Indexing: views (integers, slices with dim expressions, None, ...), gathers (advanced
indexing, gather()) and concat, checked against torch in float64, with kernel counts
and the exact text of their diagnostics."""

import math
from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import TileDSLError, testing
from tiledsl.dims import Lin, evaluate, parse

EXAMPLES = Path(__file__).parent.parent / "examples"


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


EVEN_ODD = """
kernel f(x: f32[R, D]) -> f32[(R + 1) // 2, D] {
    return x[0::2, :] + x[1::2, :]
}"""


@pytest.mark.parametrize("r, d", [(2, 1), (18, 17), (114, 113)])
def test_dims_only_sizes_make_equal_meet_as_one(r, d):
    """(R + 1) // 2 and R // 2 are equal at even R: one kernel, checked at the call."""
    x = randn(r, d)
    fn, out = run_checked(EVEN_ODD, x)
    assert len(fn.kernels) == 1
    assert torch.equal(out, x[0::2] + x[1::2])


def test_dims_only_sizes_make_equal_are_checked_at_the_call():
    fn = tiledsl.compile(EVEN_ODD)
    with pytest.raises(TileDSLError) as err:
        fn(randn(17, 3))
    assert str(err.value).splitlines()[0] == (
        "<string>:3:25: error: shapes [(R + 1) // 2, D] and [R // 2, D] must agree in dim 0 "
        "((R + 1) // 2 in one, R // 2 in the other); at these sizes (D=3, R=17) it is not "
        "(-((R + 1) // 2) + (R // 2) = -1)")
    ret = tiledsl.compile("kernel f(x: f32[R, D]) -> f32[(R + 1) // 2, D] { return x[1::2, :] * 2.0 }")
    x = randn(6, 5)
    assert torch.equal(ret(x), x[1::2] * 2.0)
    with pytest.raises(TileDSLError) as err:
        ret(randn(7, 5))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:57: error: the returned value has shape [R // 2, D] but the kernel declares "
        "[(R + 1) // 2, D]; at these sizes (D=5, R=7) it is not (-((R + 1) // 2) + (R // 2) = -1)")


def test_a_matmuls_inner_dims_only_sizes_make_equal_are_checked_at_the_call():
    fn = tiledsl.compile("kernel f(x: f32[M, D], w: f32[K, N]) -> f32[M, N] { return x[:, :D // 2] @ w }")
    x, w = randn(17, 9), randn(4, 5)
    out = fn(x, w)
    assert len(fn.kernels) == 1 and torch.allclose(out, x[:, :4] @ w, atol=1e-5)
    with pytest.raises(TileDSLError) as err:
        fn(randn(17, 10), w)
    assert str(err.value).splitlines()[0] == (
        "<string>:1:76: error: matmul inner dims must agree: D // 2 and K; at these sizes (D=10, K=4, M=17, "
        "N=5) it is not (K - (D // 2) = -1)")


@pytest.mark.parametrize("src, message", [
    ("kernel f(x: f32[R, D], y: f32[N, D]) -> f32[R, D] { return x + y }",
     "shapes [R, D] and [N, D] cannot be broadcast: dim 0 is R in one and N in the other"),
    ("kernel f(x: f32[R, D]) -> f32[R - 1, D] { return x[1:, :] + x[:, :] }",
     "shapes [R - 1, D] and [R, D] cannot be broadcast: dim 0 is R - 1 in one and R in the other"),
    ("kernel f(x: f32[R, D]) -> f32[R, D] { return x[1:, :] }",
     "the returned value has shape [R - 1, D] but the kernel declares [R, D]"),
])
def test_dims_that_differ_at_every_size_are_refused(src, message):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(src)
    assert str(err.value).splitlines()[0].split(" error: ")[1] == message


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


@pytest.mark.parametrize("n", [1, 17, 113])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_one_element_of_a_vector_a_row_program_computes_is_selected_at_a_0d_index(n, dt):
    """`softmax(y)[i]`: the gather becomes the row program's sum selecting the element, which
    compares the positions with the index itself, 0-d, broadcast as it is. The index was
    viewed as [1], and a view of a scalar expression, computed where it is read, reads no
    tensor (an internal error: 'const' reached the Triton backend outside a kernel). Fuzz
    finding 0:8159, minimized to the concat of a product and its tanh (a gather of p at 0)."""
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
    src = f"kernel f(y: {dt}[N], i: i32) -> {dt}[N] {{ return y * softmax(y)[i] + cumsum(y)[-1 - i] }}"
    for i in sorted({0, n // 2, n - 1, -1, -n}):
        fn, _ = run_checked(src, randn(n, dtype=tdt), i)
    assert [k.template for k in fn.kernels] == ["rows"]
    src = f"""kernel f(y: {dt}[N]) -> {dt}[N] {{
    p = prod(1.0 + 0.1 * tanh(y), axis=-1, keepdims=true)
    return y + min(concat(p[..., None], tanh(p)[..., None], axis=-1), axis=-1)
}}"""
    run_checked(src, randn(n, dtype=tdt))


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


@pytest.mark.parametrize("n", [1, 17, 113])
def test_concat_of_expanded_pieces(n):
    """An expanded piece is its operand read at the concat's indices (it used to be rebuilt
    at its own shape over an operand read at the concat's full width: a RankError)."""
    src = """
    kernel f(a: f32[N, D], b: f32[N, 1], c: f32[K]) -> f32[N, D + 3 + K] {
        return concat(a, expand(b, [N, 3]), expand(c * 2.0, [N, -1]), axis=-1)
    }"""
    a, b, c = randn(n, 5), randn(n, 1), randn(7)
    fn, out = run_checked(src, a, b, c)
    assert len(fn.kernels) == 1
    expected = torch.cat((a.double(), b.double().expand(n, 3), (c.double() * 2).expand(n, 7)), dim=-1)
    assert torch.allclose(out.double(), expected, atol=1e-6)


# --- attention ------------------------------------------------------------------------------

DOC_ATTENTION = (EXAMPLES / "document_mask_attention.tdsl").read_text()


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


T5_BIAS = (EXAMPLES / "t5_bias_attention.tdsl").read_text()


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


# --- reshape, squeeze ------------------------------------------------------------------------


@pytest.mark.parametrize("n, d", [(1, 2), (17, 14), (113, 64)])
def test_reshape_splits_and_merges_dims_as_views(n, d):
    src = """
    kernel f(x: f32[N, D]) -> (f32[N, 2, D // 2], f32[N * D], f32[D // 2, 2 * N]) {
        return reshape(x, [N, 2, -1]) * 2.0, reshape(x, [-1]), reshape(x, (D // 2, 2 * N))
    }"""
    x = randn(n, d)
    fn, (a, b, c) = run_checked(src, x)
    assert fn.ir().count("= reshape %x {copy = false}") == 3
    assert torch.equal(a, x.view(n, 2, d // 2) * 2)
    assert torch.equal(b, x.reshape(-1)) and torch.equal(c, x.reshape(d // 2, 2 * n))


GQA = (EXAMPLES / "gqa_attention.tdsl").read_text()


@pytest.mark.parametrize("h, kh, s", [(6, 2, 17), (4, 4, 1), (8, 1, 113)])
def test_gqa_with_reshape_into_head_groups_is_one_attention_kernel(h, kh, s):
    q = randn(2, h, s, 32, dtype=torch.float16)
    k, v = (randn(2, kh, s, 32, dtype=torch.float16) for _ in range(2))
    fn, out = run_checked(GQA, q, k, v)
    assert [k.template for k in fn.kernels] == ["attention"]  # both reshapes are views
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert torch.allclose(out.double(), expected, atol=2e-3)


PAGED_DECODE = (EXAMPLES / "paged_decode.tdsl").read_text()


@pytest.mark.parametrize("b, h, p, l, d", [(1, 1, 1, 1, 16), (3, 2, 17, 3, 64), (3, 1, 16, 3, 16),
                                           (1, 2, 17, 1, 16), (3, 2, 1, 3, 64), (1, 1, 16, 3, 64)])
def test_paged_decode_loads_k_and_v_through_the_block_table_in_one_attention_kernel(b, h, p, l, d):
    g = torch.Generator().manual_seed(b * 1000 + p * 10 + l + d)
    nb = b * l + 5  # a cache larger than the sequences use, its blocks handed out at random
    q = randn(b, h, d, dtype=torch.float16)
    k_cache, v_cache = (randn(nb, p, h, d, dtype=torch.float16) for _ in range(2))
    table = torch.randperm(nb, generator=g)[:b * l].reshape(b, l).to(torch.int32)
    lens = torch.randint(1, l * p + 1, (b,), generator=g, dtype=torch.int32)
    lens[0], lens[-1] = 1, l * p  # one key, and every key of every block
    fn, out = run_checked(PAGED_DECODE, q, k_cache, v_cache, table, lens)
    (kernel,) = fn.kernel_ops()  # the gathers are loads of the attention kernel's k and v tiles
    assert kernel.template == "attention" and kernel.plan.v_chain
    # it stores the output alone, never the gathered keys or values
    assert [kernel.region.value_type(o).shape for o in kernel.region.outputs] == [("B", "H", 1, "D")]
    # torch, sequence by sequence: the keys and values of its blocks, its first lens[i] keys
    for i in range(b):
        keys, values = (c[table[i].long()].reshape(l * p, h, d).transpose(0, 1)[:, :lens[i]].double()
                        for c in (k_cache, v_cache))
        att = torch.softmax(q[i, :, None].double() @ keys.transpose(1, 2) / math.sqrt(d), -1) @ values
        assert torch.allclose(out[i].double(), att[:, 0], atol=2e-3)


SHARED_KV = """
kernel shared_kv(q: f32[B, H, M, D], kv_cache: f32[NB, P, H, D], block_table: i32[B, L]) -> f32[B, H, M, D] {
    kv = transpose(kv_cache[block_table], 1, 3)
    kv = reshape(transpose(kv, 2, 3), [B, H, L * P, D])
    return softmax(q @ kv.T * rsqrt(D)) @ kv
}"""

FLIPPED_KV = """
kernel flipped_kv(q: f32[M, D], w: f32[N, D]) -> f32[M, D] {
    kv = w[N - 1 - index(w, 0), index(w, 1)]
    return softmax(q @ kv.T) @ kv
}"""


@pytest.mark.parametrize("b, h, m, p, l, d", [(1, 1, 1, 1, 1, 16), (3, 2, 17, 17, 3, 32), (2, 1, 5, 16, 2, 16)])
def test_one_gather_read_as_both_keys_and_values_is_loaded_through_its_index_for_both(b, h, m, p, l, d):
    """One gathered tensor is k and v (a cache holding both, a flipped sequence): the
    attention kernel loads both tiles through the index, and stores no gather."""
    g = torch.Generator().manual_seed(b * 100 + m + p)
    nb = b * l + 3
    q, cache = randn(b, h, m, d), randn(nb, p, h, d)
    table = torch.randperm(nb, generator=g)[:b * l].reshape(b, l).to(torch.int32)
    fn, out = run_checked(SHARED_KV, q, cache, table)
    (kernel,) = fn.kernel_ops()
    assert kernel.template == "attention" and kernel.plan.v_chain
    for i in range(b):
        kv = cache[table[i].long()].reshape(l * p, h, d).transpose(0, 1).double()
        att = torch.softmax(q[i].double() @ kv.transpose(1, 2) / math.sqrt(d), -1) @ kv
        assert torch.allclose(out[i].double(), att, atol=1e-5)
    q, w = randn(m, d), randn(l * p, d)
    fn, out = run_checked(FLIPPED_KV, q, w)
    (kernel,) = fn.kernel_ops()
    assert kernel.template == "attention" and kernel.plan.v_chain
    kv = w.flip(0).double()
    assert torch.allclose(out.double(), torch.softmax(q.double() @ kv.T, -1) @ kv, atol=1e-5)


def test_queries_gathered_at_a_selection_are_loaded_through_it_by_the_attention_kernel():
    src = """
    kernel f(xs: f32[NS, H, D], sel: i32[M], k: f32[H, N, D], v: f32[H, N, D]) -> f32[H, M, D] {
        q = transpose(xs[sel], 0, 1)
        return softmax(q @ k.T) @ v
    }"""
    xs, k, v = randn(40, 3, 16), randn(3, 33, 16), randn(3, 33, 16)
    sel = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:17].to(torch.int32)
    fn, out = run_checked(src, xs, sel, k, v)
    assert [k.template for k in fn.kernels] == ["attention"]
    q = xs[sel.long()].transpose(0, 1).double()
    assert torch.allclose(out.double(), torch.softmax(q @ k.double().transpose(1, 2), -1) @ v.double(),
                          atol=1e-5)


def test_paged_decode_backward_of_its_one_query_row():
    """The example returns row 0 of the attention output (a view taking part of an axis): its
    gradient is an index map of the output's, the cache's a scatter-add through the table."""
    b, h, p, l, d = 2, 2, 17, 3, 16
    g = torch.Generator().manual_seed(7)
    args = (randn(b, h, d, dtype=torch.float16), randn(b * l + 1, p, h, d, dtype=torch.float16),
            randn(b * l + 1, p, h, d, dtype=torch.float16),
            torch.randperm(b * l + 1, generator=g)[:b * l].reshape(b, l).to(torch.int32),
            torch.tensor([1, l * p], dtype=torch.int32))
    report = testing.check_grads(tiledsl.compile(PAGED_DECODE), *args)
    assert report.ok, str(report)


def test_paged_decode_backward_of_every_row():
    b, h, p, l, d = 2, 2, 17, 3, 16
    g = torch.Generator().manual_seed(7)
    args = (randn(b, h, d, dtype=torch.float16), randn(b * l + 1, p, h, d, dtype=torch.float16),
            randn(b * l + 1, p, h, d, dtype=torch.float16),
            torch.randperm(b * l + 1, generator=g)[:b * l].reshape(b, l).to(torch.int32),
            torch.tensor([1, l * p], dtype=torch.int32))
    every_row = PAGED_DECODE.replace("-> f16[B, H, D]", "-> f16[B, H, 1, D]").replace(
        "(softmax(s) @ v)[:, :, 0, :]", "softmax(s) @ v")
    report = testing.check_grads(tiledsl.compile(every_row), *args)
    assert report.ok, str(report)


def test_group_norm_statistics_over_a_merged_axis():
    src = """
    kernel gn(x: f32[N, C, W], g: f32[C]) -> f32[N, C, W] {
        xg = reshape(x, [N, 4, -1])
        d = xg - mean(xg, axis=-1, keepdims=true)
        y = d * rsqrt(mean(d * d, axis=-1, keepdims=true) + 1e-5)
        return reshape(y, [N, C, W]) * g[:, None]
    }"""
    for n, c, w in [(1, 8, 1), (3, 8, 17), (2, 12, 113)]:
        x, g = randn(n, c, w), randn(c)
        fn, out = run_checked(src, x, g)
        assert "C * W // 4" in fn.ir("graph")
        expected = torch.nn.functional.group_norm(x.double(), 4, eps=1e-5) * g.double()[:, None]
        assert torch.allclose(out.double(), expected, atol=1e-5)


def test_a_reshape_that_needs_a_copy_names_the_dims_unless_asked_to_copy():
    fn = tiledsl.compile("kernel f(x: f32[N, C, W]) -> f32[N, C * W] { return reshape(x, [N, -1]) }")
    x = randn(3, 8, 17)
    with pytest.raises(TileDSLError) as err:
        fn(x.transpose(0, 1).contiguous().transpose(0, 1))  # C outermost in memory
    assert str(err.value).splitlines()[0] == (
        "<string>:1:53: error: this reshape merges dims C and W of [N, C, W], which are not adjacent "
        "in memory at this call (strides 51 and 1, W = 17); reshape never copies unless asked: "
        "reshape(x, [...], copy=true)")
    assert torch.equal(fn(x), x.reshape(3, -1))
    copying = tiledsl.compile("kernel f(x: f32[N, D]) -> f32[D * N] { return reshape(x.T, [-1], copy=true) }")
    fn, out = run_checked(copying, x[0])
    assert torch.equal(out, x[0].T.reshape(-1))


def test_a_reshape_whose_counts_differ_at_the_call_is_refused_there():
    fn = tiledsl.compile("kernel f(x: f32[N, D]) -> f32[N, 2, D // 2] { return reshape(x, [N, 2, -1]) }")
    with pytest.raises(TileDSLError) as err:
        fn(randn(3, 5))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:65: error: reshape from [N, D] to [N, 2, D // 2] changes the number of elements; "
        "at these sizes (D=5, N=3) it is not (2 * (D // 2) * N - D * N = -3)")


def test_a_returned_reshape_of_a_kernel_result_is_not_copied():
    fn, out = run_checked("kernel f(x: f32[N, D]) -> f32[D, N] { return reshape(exp(x), [D, N]) }",
                          x := randn(17, 6))
    assert len(fn.kernels) == 1
    assert torch.allclose(out, x.exp().reshape(6, 17))


def test_squeeze_drops_size_one_axes():
    x = randn(17, 1, 5, 1)
    fn, out = run_checked("kernel f(x: f32[N, 1, D, 1]) -> f32[N, D] { return squeeze(x, (1, -1)) * 2.0 }", x)
    assert torch.equal(out, x[:, 0, :, 0] * 2)
    assert len(fn.kernels) == 1


R = "kernel f(x: f32[N, D], s: i32, m: f32[N, M, D]) -> f32[N, D] {\n    %s\n}"


@pytest.mark.parametrize("body, first", [
    ("return reshape(x, [N, -1, -1])", "<string>:2:31: error: only one dim of a reshape can be -1"),
    ("return reshape(x, [N, 0])", "<string>:2:27: error: a reshape dim must be at least 1, got 0"),
    ("return reshape(x, [N, s])",
     "<string>:2:27: error: reshape dims are integer expressions of dims and literals (like D // 2 "
     "or N - 1); 's' is not one"),
    ("return reshape(x, N)",
     "<string>:2:23: error: the shape of 'reshape' must be a list of dims, like [B, H // 2, 2]"),
    ("return reshape(x, [N, D, 2])",
     "<string>:2:23: error: reshape from [N, D] to [N, D, 2] changes the number of elements"),
    ("return reshape(s * 2, [1])", "<string>:2:12: error: a 0-d value (i32) cannot be reshaped; it "
     "broadcasts as it is"),
    ("y = [N, D]; return x",
     "<string>:2:9: error: a list is only allowed as a shape, e.g. reshape(x, [B, H // 2, 2])"),
    ("return squeeze(m, 1)",
     "<string>:2:23: error: squeeze needs axis 1 to have size 1; it has size M (to take index 0 of "
     "it, write x[:, 0])"),
    ("return squeeze(x, 2)", "<string>:2:23: error: axis 2 is out of range for a value of rank 2 "
     "(valid: -2 to 1)"),
])
def test_reshape_and_squeeze_diagnostics(body, first):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(R % body)
    assert str(err.value).splitlines()[0] == first


# --- check_bounds ----------------------------------------------------------------------------

CHECKED = """
kernel f(x: f32[N, V], y: i64[N], t: f32[T, H], b: i32[M]) -> (f32[N], f32[M, H]) {
    return gather(x, y), t[b] * 2.0
}"""


def test_check_bounds_raises_at_the_indexing_naming_the_tensor():
    fn = tiledsl.compile(CHECKED, check_bounds=True)
    x, t = randn(5, 7), randn(4, 3)
    y = torch.tensor([0, 6, -7, 3, 1])
    b = torch.tensor([3, -4, 0, 1, 2, 1], dtype=torch.int32)
    a, c = fn(x, y, t, b)  # in range, negative ones included: the same results as unchecked
    assert torch.equal(a, x.gather(1, (y % 7)[:, None])[:, 0]) and torch.equal(c, t[b.long()] * 2)
    for call in (fn, fn.reference):
        with pytest.raises(TileDSLError) as err:
            call(x, torch.tensor([0, 7, -8, 3, 1]), t, b)
        assert str(err.value).splitlines()[0] == (
            "<string>:3:12: error: index out of range: 2 index values for axis 1 of 'x' (size V = 7 "
            "at this call) are outside [-7, 7)")
    b[4] = 4
    with pytest.raises(TileDSLError) as err:
        fn(x, y, t, b)
    assert str(err.value).splitlines()[0] == (
        "<string>:3:26: error: index out of range: 1 index value for axis 0 of 't' (size T = 4 at "
        "this call) is outside [-4, 4)")
    unchecked = tiledsl.compile(CHECKED)
    assert torch.equal(unchecked(x, y, t, b)[1][4], torch.zeros(3))  # reads 0 unchecked
    assert sum(len(k.ops) for k in unchecked.kernels) < sum(len(k.ops) for k in fn.kernels)  # the counts


def test_check_bounds_covers_indices_computed_inside_attention():
    src = DOC_ATTENTION.replace("doc: i32[M]", "doc: i32[L]")
    assert src != DOC_ATTENTION
    fn = tiledsl.compile(src, check_bounds=True)
    q, k, v = (randn(2, 17, 32, dtype=torch.float16) for _ in range(3))
    doc = torch.sort(torch.randint(0, 3, (17,), dtype=torch.int32)).values
    out = fn(q, k, v, doc)
    assert torch.equal(out, tiledsl.compile(src)(q, k, v, doc))
    with pytest.raises(TileDSLError) as err:
        fn(q, k, v, doc[:15])  # shorter than the queries and keys it is read at
    assert str(err.value).splitlines()[0] == (
        "<string>:7:28: error: index out of range: 68 index values for axis 0 of 'doc' (size L = 15 "
        "at this call) are outside [-15, 15)")


def test_a_row_program_does_not_gather_from_what_it_computes():
    # the gather reads its source through a pointer: a softmax the row program computes is
    # stored first (an internal error before; found by scripts/fuzz_programs.py, seed 29)
    fn = tiledsl.compile("""
    kernel f(x: bf16[M, N], s: f32, k: i32[M, N]) -> bf16[M, N] {
        t1 = minimum(softmax(x, axis=0), s)
        return 1e-3 * gather(t1, abs(k) % N, axis=-1)
    }""")
    assert [k.template for k in fn.kernels] == ["rows", "pointwise"]
    assert "[fuse-rows] refused: minimum (line 3) -> take (line 4): it gathers from minimum (line 3) at " \
           "computed indices [rule: other-index]" in [str(r) for r in fn.remarks]
    k = torch.randint(-50, 50, (33, 17), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    run_checked(fn, randn(33, 17, dtype=torch.bfloat16, seed=2), 0.3, k)


@pytest.mark.parametrize("r", [2, 18, 114])
def test_concat_of_strided_halves_checks_their_sizes_at_the_call(r):
    # GPT-J's rotate_every_two: x[..., 1::2] and x[..., ::2] have R // 2 and (R + 1) // 2
    # elements, equal for an even R only, which the call checks
    src = """kernel f(x: f32[S, R]) -> f32[S, R] {
    return reshape(concat(-x[..., 1::2, None], x[..., ::2, None], axis=-1), [S, R])
}"""
    x = randn(5, r, seed=r)
    fn, out = run_checked(src, x)
    assert torch.equal(out, torch.stack((-x[:, 1::2], x[:, ::2]), -1).flatten(-2))
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn(randn(5, r + 1))
    assert err.value.message == (
        "concat along axis 2 needs equal sizes in the other dims; dim 1 is (R + 1) // 2 here and R // 2 in "
        f"the first value; at these sizes (R={r + 1}, S=5) it is not (-((R + 1) // 2) + (R // 2) = -1)")


@pytest.mark.parametrize("r", [2, 18, 64])
def test_gptj_rotate_every_two_rope_is_one_kernel(r):
    # GPT-J's apply_rotary_pos_emb: sin and cos repeat_interleave'd (a concat along a new axis,
    # merged) and rotate_every_two (stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)): each
    # reshape of those index maps is read through, computed at the reader's index
    src = """kernel f(q: f32[S, D], table: f32[P, R], pos: i32[S]) -> f32[S, D] {
    sincos = table[pos]
    sin = reshape(concat(sincos[:, :R // 2, None], sincos[:, :R // 2, None], axis=-1), [S, R])
    cos = reshape(concat(sincos[:, R // 2:, None], sincos[:, R // 2:, None], axis=-1), [S, R])
    rot = q[:, :R]
    rot2 = reshape(concat(-rot[..., 1::2, None], rot[..., ::2, None], axis=-1), [S, R])
    return concat(rot * cos + rot2 * sin, q[:, R:], axis=-1)
}"""
    s, d, p = 37, r + 6, 50
    q, table = randn(s, d, seed=r), randn(p, r, seed=r + 1)
    pos = torch.randint(0, p, (s,), generator=torch.Generator().manual_seed(r)).int()
    fn, out = run_checked(src, q, table, pos)
    sc = table[pos.long()]
    sin, cos = (torch.repeat_interleave(t, 2, -1) for t in sc.split(r // 2, -1))
    rot = q[:, :r]
    rot2 = torch.stack((-rot[:, 1::2], rot[:, ::2]), -1).flatten(-2)
    torch.testing.assert_close(out, torch.cat([rot * cos + rot2 * sin, q[:, r:]], -1), rtol=0, atol=1e-6)
    assert [k.template for k in fn.kernels] == ["pointwise"]
