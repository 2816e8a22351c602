"""Selection: topk, sort and argsort (torch's meaning, equal elements in order), computed by
the rows template from one sort of (value, position) keys; rows longer than a chunk stream
through topk; the MoE router example is one row kernel after its GEMM."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

TOPK = """
kernel f(x: f32[M, N]) -> (f32[M, {k}], i64[M, {k}], f32[M, {k}], i64[M, {k}]) {{
    v, i = topk(x, {k})
    w, j = topk(x, {k}, largest=false)
    return v, i, w, j
}}"""

SORT = """
kernel f(x: f32[M, N]) -> (f32[M, N], i64[M, N], i64[M, N]) {
    v, i = sort(x, descending=true)
    return v, i, argsort(x)
}"""


def with_ties(m: int, n: int, seed: int) -> torch.Tensor:
    """Random values drawn from few distinct ones, so rows hold many equal elements."""
    return torch.randint(-3, 4, (m, n), generator=gen(seed)).float() * 0.5


def stable(x: torch.Tensor, k: int, largest: bool):
    out = torch.sort(x.double(), dim=-1, descending=largest, stable=True)
    return out.values[:, :k], out.indices[:, :k]


@pytest.mark.parametrize("m", [1, 17, 113])
@pytest.mark.parametrize("n", [1, 5, 100, 1000])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_is_torchs_with_equal_elements_in_order(m, n, ties):
    x = with_ties(m, n, seed=m + n) if ties else randn(m, n, seed=m * n)
    for k, spelled in ((1, "1"), (n, "N")):
        _, (v, i, w, j) = run_checked(TOPK.format(k=spelled), x, sm90=False)
        for (got_v, got_i), largest in (((v, i), True), ((w, j), False)):
            want_v, want_i = stable(x, k, largest)
            assert torch.equal(got_v.double(), want_v) and torch.equal(got_i, want_i)
            assert got_i.dtype == torch.int64
        if not ties:  # torch.topk itself where no two elements are equal
            assert torch.equal(i, torch.topk(x, k).indices)


@pytest.mark.parametrize("m, n", [(1, 1), (17, 5), (113, 100), (3, 1000)])
def test_sort_and_argsort_are_torchs_stable_sort(m, n):
    x = with_ties(m, n, seed=n)
    _, (v, i, a) = run_checked(SORT, x, sm90=False)
    want = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(v, want.values) and torch.equal(i, want.indices)
    assert torch.equal(a, torch.sort(x, dim=-1, stable=True).indices)


@pytest.mark.parametrize("m, n", [(1, 1), (17, 33)])
def test_a_sort_of_values_computed_from_positions_sorts_them(m, n):
    """Values of positions alone read by a sort are its operand along the row, not lanes of the
    selection (an internal error, 'a selected value reads a selection'; found by
    scripts/fuzz_programs.py, seed 7101:265)."""
    fn, out = run_checked("""kernel f(x: f16[M, N], s: f32) -> (f16[M, N], f16[M, N]) {
        t = index(x, 1) * -0.01 + index(x, 0) * 0.1
        t[..., :1] = s
        return t, sort(abs(t), axis=-1, descending=false)
    }""", randn(m, n, dtype=torch.float16), 0.7)
    t = torch.arange(n)[None, :] * -0.01 + torch.arange(m)[:, None] * 0.1
    t[:, :1] = 0.7
    assert torch.equal(out[1], t.half().abs().sort(-1).values)


def test_nan_is_larger_than_any_number_and_inf_orders_as_torch():
    x = randn(3, 9, seed=5)
    x[0, [1, 4]] = math.nan
    x[1, 2], x[1, 6], x[2, 0] = -math.inf, math.inf, -0.0
    _, (v, i, a) = run_checked(SORT, x, sm90=False)
    want = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(i, want.indices) and torch.equal(a, torch.sort(x, dim=-1, stable=True).indices)
    torch.testing.assert_close(v, want.values, equal_nan=True)
    assert torch.isnan(v[0, :2]).all() and i[0, :2].tolist() == [1, 4]


@pytest.mark.parametrize("n", [32000, 128256])
def test_topk_streams_a_vocabulary_row_through_chunks(n):
    src = """
    kernel f(x: f32[M, N]) -> (f32[M, 50], i64[M, 50]) {
        v, i = topk(softmax(x, -1), 50)
        return v, i
    }"""
    x = randn(2, n, seed=n, scale=4.0)
    fn, (v, i) = run_checked(src, x, sm90=False)
    assert [k.template for k in fn.kernels] == ["rows"]
    (launch,) = fn.launches
    assert launch.kernel.launch_config(dict(launch.dims), "interpreter").constexprs["ONE_PASS"] is False
    want = torch.topk(torch.softmax(x.double(), -1), 50)
    assert torch.equal(i, want.indices)
    torch.testing.assert_close(v.double(), want.values, rtol=1e-5, atol=1e-9)


def test_k_is_a_dim_expression():
    src = """
    kernel f(x: f32[M, N]) -> f32[M, N // 4] {
        return topk(x * 2.0, N // 4)
    }"""
    x = randn(17, 100, seed=3)
    _, v = run_checked(src, x, sm90=False)
    assert torch.equal(v, torch.topk(x * 2, 25).values)


@pytest.mark.parametrize("m, n", [(1, 16385), (2, 20000)])
def test_a_sort_longer_than_registers_hold_sorts_the_row_in_memory(m, n):
    """Past 16384 elements the row's keys are sorted in the kernel's workspace (a bitonic
    network of chunks): equal values keep their order, in both directions, and a sort and
    an argsort of one row each have their own workspace row."""
    fn = tiledsl.compile(SORT)
    x = with_ties(m, n, seed=4)
    _, (v, i, a) = run_checked(fn, x, sm90=False)
    want_v, want_i = stable(x, n, largest=True)
    assert torch.equal(v.double(), want_v) and torch.equal(i, want_i)
    assert torch.equal(a, stable(x, n, largest=False)[1])


def test_a_topk_of_more_than_registers_hold_keeps_the_first_k_of_the_sorted_row():
    fn = tiledsl.compile("""
    kernel f(x: f32[M, N], y: f32[K]) -> (f32[M, K], i64[M, K]) {
        v, i = topk(x * 0.5, K, largest=false)
        return v * 2.0, i
    }""")
    x = with_ties(1, 17000, seed=5)
    _, (v, i) = run_checked(fn, x, randn(16390, seed=1), sm90=False)
    want_v, want_i = stable(x * 0.5, 16390, largest=False)
    assert torch.equal(v.double(), want_v * 2) and torch.equal(i, want_i)


def test_a_reduction_of_a_selection_that_may_pass_registers_reads_it_stored():
    """A sort whose k may pass 16384 is sorted in memory: a reduction of its values is a
    row program of its own, reading them stored, at any length."""
    fn = tiledsl.compile("""
    kernel f(x: f32[M, N]) -> f32[M, N] {
        v, i = sort(x, descending=true)
        return v / sum(v, axis=-1, keepdims=true)
    }""")
    for n in (17, 16385):
        x = randn(2, n, seed=1)
        _, out = run_checked(fn, x, sm90=False)
        v = torch.sort(x.double(), -1, descending=True).values
        torch.testing.assert_close(out.double(), v / v.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert [k.template for k in fn.kernels] == ["rows", "rows"]
    assert ("[fuse-rows] refused: topk (line 3) -> sum (line 4): sum reduces the elements a topk selected, which "
            "a row longer than 16384 sorts in memory (a row program of its own reads them) [rule: tile]"
            ) in fn.explain()


def test_a_vocabulary_sort_builds_for_sm90_without_spills():
    """Llama-3's 128256 tokens: rows of 2**17 workspace words, chunks of 4096 keys a
    program of 8 warps sorts in registers."""
    (r,) = aot.inspect_program(tiledsl.compile("""
    kernel f(x: f32[B, V]) -> f32[B, V] {
        v, i = sort(x, descending=true)
        return v * 2.0
    }"""), {"B": 64, "V": 128256})
    assert (r.config["LONG"], r.config["SORT_LOG"], r.config["BLOCK_R"]) == (True, 17, 4096), r
    assert r.spill_bytes == 0, r


def test_k_past_the_row_is_refused_where_it_is_written():
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(TOPK.format(k="N + 1"))
    assert err.value.message == "k = N + 1 of 'topk' is outside 1 to N (the length of axis 1)"


@pytest.mark.parametrize("m, n", [(1, 1), (17, 5), (5, 100)])
def test_the_values_are_differentiable_the_gradient_goes_to_the_selected_positions(m, n):
    fn = tiledsl.compile("""
    kernel f(x: f32[M, N], y: f32[M, N]) -> f32[M, N] {
        v, i = topk(x * y, N)
        w, j = sort(x)
        return v + sum(w * w, -1, keepdims=true) * 0.25
    }""")
    report = testing.check_grads(fn, randn(m, n, seed=1), randn(m, n, seed=2), generator=gen(0))
    assert report.ok, report


@pytest.mark.parametrize("t, d, e", [(1, 1, 8), (17, 32, 8), (113, 16, 64)])
def test_moe_router_is_one_row_kernel_after_its_gemm(t, d, e):
    fn = tiledsl.compile((EXAMPLES / "moe_router.tdsl").read_text())
    x, w = randn(t, d, seed=1), randn(d, e, seed=2)
    _, (weights, experts) = run_checked(fn, x, w)
    assert [k.template for k in fn.kernels] == ["matmul", "rows"]
    probs = torch.softmax(x.double() @ w.double(), -1)
    top = torch.topk(probs, 2)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(weights.double(), top.values / top.values.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert testing.check_grads(fn, x, w, generator=gen(0)).ok


def test_softmax_topk_renormalise_is_one_row_kernel():
    fn = tiledsl.compile("""
    kernel f(logits: f32[T, E]) -> (f32[T, 2], i64[T, 2]) {
        w, i = topk(softmax(logits, -1), 2)
        return w / sum(w, -1, keepdims=true), i
    }""")
    run_checked(fn, randn(17, 8, seed=1), sm90=False)
    assert [k.template for k in fn.kernels] == ["rows"]


@pytest.mark.parametrize("e, one_pass", [(8, True), (256, True), (32000, False), (128256, False)])
def test_softmax_top2_builds_for_sm90_without_spills(e, one_pass):
    src = """
    kernel f(logits: f32[T, E]) -> (f32[T, 2], i64[T, 2]) {
        w, i = topk(softmax(logits, -1), 2)
        return w / sum(w, -1, keepdims=true), i
    }"""
    (r,) = aot.inspect_program(tiledsl.compile(src), {"T": 4096, "E": e})
    assert r.config["ONE_PASS"] is one_pass and r.spill_bytes == 0, r


@pytest.mark.parametrize("n", [1, 17, 113])
def test_a_subscript_of_a_pair_picks_a_result_as_torch_does(n):
    # DeepSeek-V3's router writes `x.topk(2, dim=-1)[0]`: torch returns a tuple, so [0] is
    # the values and [1] the indices, not a row of the values; max and min return one along
    # an axis only
    src = """
kernel f(x: f32[M, N]) -> (f32[M, 1], i64[M, 1], i64[M, N], i64[M], f32[M], f32[N]) {
    return (topk(x, 1)[0], topk(x, 1, axis=-1)[1], sort(x)[1], max(x, axis=-1)[1], max(x, axis=-1)[0],
            topk(x, 1, axis=0)[0][0])
}"""
    x = randn(5, n, seed=n)
    fn, (v, i, s, am, m, row) = run_checked(src, x)
    assert torch.equal(v, x.topk(1, dim=-1)[0]) and torch.equal(i, x.topk(1, dim=-1)[1])
    assert torch.equal(s, torch.sort(x, stable=True)[1]) and torch.equal(am, x.max(dim=-1)[1])
    assert torch.equal(m, x.max(dim=-1)[0]) and torch.equal(row, x.topk(1, dim=0)[0][0])
    # max over every element is one value, no pair: [0] indexes it
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile("kernel f(x: f32[M, N]) -> f32 { return max(x, axis=None)[0] }")
    assert err.value.message == "a 0-d value (f32) cannot be indexed; it broadcasts as it is"


@pytest.mark.parametrize("n", [1, 17, 113])
def test_positions_return_as_i32(n):
    # vLLM's topk_softmax hands its expert ids on as int32 (Mixtral's router as written):
    # positions along an axis shorter than 2**31 narrow exactly
    src = "kernel f(x: f32[M, N]) -> (i32[M, 2], i32[M]) { return topk(x, 2)[1], argmax(x, axis=-1) }"
    x = randn(7, n + 1, seed=n)
    fn, (i, am) = run_checked(src, x)
    assert i.dtype == torch.int32 and torch.equal(i.long(), x.topk(2, dim=-1)[1])
    assert am.dtype == torch.int32 and torch.equal(am.long(), x.argmax(-1))
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile("kernel f(x: f32[M, N]) -> i16[M, 2] { return topk(x, 2)[1] }")
    assert err.value.message == ("the returned value is i64 but the kernel declares i16; convert it "
                                 "explicitly with cast(..., i16)")


@pytest.mark.parametrize("v", [5, 17, 113])
def test_hf_top_k_warper(v):
    # TopKLogitsWarper.__call__ as Hugging Face writes it: the k-th largest score picked from
    # torch's pair (`torch.topk(scores, top_k)[0][..., -1, None]`), the scores below it
    # filled with -inf (masked_fill: where). One row program: the top 5 streamed, the 5th
    # picked from them per row (a sum selecting its position), the fill written after
    src = """
kernel top_k(scores: f32[B, V]) -> f32[B, V] {
    indices_to_remove = scores < topk(scores, 5)[0][..., -1, None]
    return where(indices_to_remove, -inf, scores)
}"""
    scores = randn(7, v, seed=v, scale=3.0)
    fn, out = run_checked(src, scores)
    assert torch.equal(out, scores.masked_fill(scores < torch.topk(scores, 5)[0][..., -1, None], -math.inf))
    assert [k.template for k in fn.kernels] == ["rows"]


@pytest.mark.parametrize("v", [17, 113, 5000])
def test_gpt_fast_top_k_sampling_filter(v):
    # gpt-fast's logits_to_probs: `v, _ = torch.topk(logits, top_k); pivot = v.select(-1, -1)
    # .unsqueeze(-1); logits = torch.where(logits < pivot, -inf, logits)`, then the softmax of
    # the temperature-scaled logits: one row program (a row of 5000 streams through the topk)
    src = """
kernel logits_to_probs(logits: f32[B, V], temperature: f32) -> f32[B, V] {
    logits = logits / maximum(temperature, 1e-5)
    v, _ = topk(logits, 7)
    pivot = v[..., -1][..., None]
    logits = where(logits < pivot, -inf, logits)
    return softmax(logits, axis=-1)
}"""
    logits = randn(3, v, seed=v, scale=3.0)
    fn, out = run_checked(src, logits, 0.8)
    x = logits.double() / 0.8
    pivot = torch.topk(x, 7).values[..., -1:]
    torch.testing.assert_close(out.double(), torch.softmax(torch.where(x < pivot, -math.inf, x), -1),
                               rtol=1e-5, atol=1e-7)
    assert [k.template for k in fn.kernels] == ["rows"]
