"""Sampling warpers as model code writes them, each one row program: the row sorted, the
mask computed along the sorted row (softmax, cumsum, positions), the filled row stored back
at the sort's positions. Canonicalize moves the gather and the fill across the permutation
(`SortedValues`, `GatherAtPermutation`, `ElementwiseOfPermutedWrite`); fuse-rows takes the
put at the sort's positions (`legality._row_put`)."""

from __future__ import annotations

import math

import pytest
import torch

import tiledsl
from helpers import SIZES, randn, run_checked
from tiledsl.backends.triton import aot

TOP_P = """
kernel top_p(scores: f32[M, V], top_p: f32) -> f32[M, V] {
    sorted_logits, sorted_indices = sort(scores, axis=-1)
    cumulative_probs = cumsum(softmax(sorted_logits, axis=-1), axis=-1)
    sorted_indices_to_remove = cumulative_probs <= 1.0 - top_p
    sorted_indices_to_remove[..., -1:] = false
    indices_to_remove = scatter(sorted_indices_to_remove, sorted_indices, sorted_indices_to_remove, axis=1)
    return where(indices_to_remove, -inf, scores)
}"""

MIN_P = """
kernel min_p(scores: f32[M, V], min_p: f32) -> f32[M, V] {
    probs = softmax(scores, axis=-1)
    top_probs = max(probs, axis=-1, keepdims=true)
    tokens_to_remove = probs < min_p * top_probs
    sorted_indices = argsort(scores, axis=-1, descending=true)
    sorted_indices_to_remove = gather(tokens_to_remove, sorted_indices, axis=-1)
    sorted_indices_to_remove[..., :1] = false
    indices_to_remove = scatter(sorted_indices_to_remove, sorted_indices, sorted_indices_to_remove, axis=1)
    return where(indices_to_remove, -inf, scores)
}"""


def top_p_reference(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TopPLogitsWarper.__call__ (min_tokens_to_keep = 1) in float64, and each element's
    cumulative probability in sorted order, at its vocabulary position."""
    x = scores.double()
    sorted_logits, sorted_indices = torch.sort(x, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative_probs <= (1 - top_p)
    remove[..., -1:] = False
    indices_to_remove = remove.scatter(1, sorted_indices, remove)
    cum = cumulative_probs.scatter(1, sorted_indices, cumulative_probs)
    return scores.masked_fill(indices_to_remove, -math.inf), cum


@pytest.mark.parametrize("m, v", [(13, n) for n in SIZES] + [(2, 20000)])
def test_top_p_as_hugging_face_writes_it_is_one_row_program(m, v):
    # the sorted row's cumulative softmax compared with 1 - top_p: past 16384 elements the
    # row is sorted in the workspace and its softmax scaled by the unsorted row's statistics
    scores = randn(m, v, seed=v, scale=3.0)
    fn = tiledsl.compile(TOP_P)
    assert [k.template for k in fn.kernels] == ["rows"]
    out = fn(scores, 0.9)
    want, cum = top_p_reference(scores, 0.9)
    # a token whose cumulative probability is within f32 rounding of the threshold may go
    # either way (f32 probabilities, 1e-7 relative, summed in f64): these inputs have none
    assert (cum - 0.1).abs().min() > 1e-6
    assert torch.equal(out, want)
    if v < 20000:
        run_checked(fn, scores, 0.9)


def min_p_reference(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """MinPLogitsWarper.__call__ (min_tokens_to_keep = 1) in float64."""
    probs = torch.softmax(scores.double(), -1)
    remove = probs < min_p * probs.max(-1, keepdim=True).values
    sorted_indices = torch.argsort(scores, dim=-1, descending=True)
    sorted_remove = torch.gather(remove, 1, sorted_indices)
    sorted_remove[..., :1] = False
    return scores.masked_fill(sorted_remove.scatter(1, sorted_indices, sorted_remove), -math.inf)


# the first kept written as a select of positions, not a subscript write
MIN_P_WHERE = MIN_P.replace("    sorted_indices_to_remove[..., :1] = false\n", "    sorted_indices_to_remove = "
                            "where(index(scores, -1) < 1, false, sorted_indices_to_remove)\n")


@pytest.mark.parametrize("src", [MIN_P, MIN_P_WHERE], ids=["setitem", "where"])
@pytest.mark.parametrize("m, v", [(13, n) for n in SIZES] + [(2, 20000)])
def test_min_p_as_hugging_face_writes_it_is_one_row_program(m, v, src):
    # `sorted_indices_to_remove[..., :min_tokens_to_keep] = False` as the warper writes it:
    # the mask computed in sorted order, the first kept (its position along the sort), the
    # fill stored at the sort's positions; past 16384 tokens the row sorted in memory
    assert src.count("false") == 1
    scores = randn(m, v, seed=v, scale=3.0)
    fn = tiledsl.compile(src)
    out = fn(scores, 0.1)
    assert torch.equal(out, min_p_reference(scores, 0.1))
    assert [k.template for k in fn.kernels] == ["rows"]
    if v < 20000:
        run_checked(fn, scores, 0.1)


@pytest.mark.parametrize("n", (17, 113, 5000))
def test_softmax_and_cumsum_of_a_topk_are_computed_along_the_selected_elements(n):
    # vLLM's top-k then top-p: the probabilities of the k kept and their running sum, in
    # the row program that selects them (a row of 5000 streams through the topk)
    src = """
kernel f(logits: f32[M, N]) -> (f32[M, 7], f32[M, 7], i64[M, 7]) {
    v, i = topk(logits, 7)
    probs = softmax(v, axis=-1)
    return probs, cumsum(probs, axis=-1), i
}"""
    logits = randn(5, n, seed=n, scale=2.0)
    fn, (probs, cum, i) = run_checked(src, logits)
    v, want_i = torch.topk(logits.double(), 7)
    want = torch.softmax(v, -1)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(probs.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cum.double(), want.cumsum(-1), rtol=1e-6, atol=1e-7)
    assert [kk.template for kk in fn.kernels] == ["rows"]


def test_a_reverse_scan_of_selected_elements_is_a_row_program_of_its_own():
    src = """
kernel f(x: f32[M, N]) -> f32[M, N] {
    s, i = sort(x, axis=-1)
    return cumsum(s, axis=-1, reverse=true)
}"""
    x = randn(3, 17, seed=2)
    fn, out = run_checked(src, x)
    want = torch.sort(x.double(), -1).values.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert len(fn.kernels) == 2
    assert ("cumsum runs backward along the elements a topk or sort selected (a row program of its own) "
            "[rule: tile]") in fn.explain()


def test_a_reduction_of_a_permuted_write_waits_for_the_row_program_that_writes_it():
    # the put is complete only when its row program ends: what reads it (the count of the
    # kept, the fill returned too, so not moved before the put) is another's
    src = """
kernel f(x: f32[M, N]) -> (f32[M, N], f32[M, 1]) {
    s, i = sort(x, axis=-1)
    keep = cumsum(softmax(s, axis=-1), axis=-1) > 0.2
    kept = where(scatter(keep, i, keep, axis=1), x, -inf)
    return kept, sum(where(kept == -inf, 0.0, 1.0), axis=-1, keepdims=true)
}"""
    x = randn(4, 113, seed=3)
    fn, (kept, count) = run_checked(src, x)
    s, i = torch.sort(x.double(), -1)
    keep = torch.softmax(s, -1).cumsum(-1) > 0.2
    want = torch.where(keep.scatter(1, i, keep), x, -math.inf)
    assert torch.equal(kept, want)
    assert torch.equal(count, torch.isfinite(want).sum(-1, keepdim=True).float())
    assert [k.template for k in fn.kernels] == ["rows", "rows"]
    assert ("[fuse-rows] refused: put (line 5) -> eq (line 6): eq reads a put, which the row program "
            "completes only when it ends [rule: op]") in fn.explain()


@pytest.mark.parametrize("src", [TOP_P, MIN_P], ids=["top_p", "min_p"])
def test_a_vocabulary_warper_builds_for_sm90_without_spills(src):
    """Llama-3's 128256 tokens: the row sorted in the workspace, then read back a chunk at a
    time, its mask computed (the cumsum carried across chunks) and the filled chunk stored
    at its positions."""
    (r,) = aot.inspect_program(tiledsl.compile(src), {"M": 64, "V": 128256})
    assert (r.config["LONG"], r.config["SORT_LOG"], r.config["BLOCK_R"]) == (True, 17, 4096), r
    assert r.spill_bytes == 0, r


VLLM_TOP_K_TOP_P = """
kernel apply_top_k_top_p(logits: f32[B, V], k: i64[B], p: f32[B]) -> f32[B, V] {
    logits_sort, logits_idx = sort(logits, axis=-1)
    top_k_mask = V - k
    top_k_mask = gather(logits_sort, top_k_mask[:, None], axis=1)
    top_k_mask = logits_sort < top_k_mask
    logits_sort = where(top_k_mask, -inf, logits_sort)
    probs_sort = softmax(logits_sort, axis=-1)
    probs_sum = cumsum(probs_sort, axis=-1)
    top_p_mask = probs_sum <= 1 - p[:, None]
    top_p_mask[:, -1] = false
    logits_sort = where(top_p_mask, -inf, logits_sort)
    return scatter(logits, logits_idx, logits_sort, axis=-1)
}"""


def vllm_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p, as written."""
    logits = logits.clone()
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    top_k_mask = logits_sort.size(1) - k.to(torch.long)
    top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


@pytest.mark.parametrize("b, v", [(1, 1), (5, 113), (3, 20000)])
def test_vllm_top_k_top_p_as_written(b, v):
    # per-request k and p; the k-th value gathered from the sorted row at a per-row position,
    # which the sort's row program cannot read (it gathers from its own selection), so: the
    # sort with the masks' positions, the masks and the softmax's cumsum over the stored
    # sorted row, the scatter back (3 kernels; vLLM's torch path is 11 ops)
    fn = tiledsl.compile(VLLM_TOP_K_TOP_P)
    logits = randn(b, v, seed=v, scale=3.0)
    k = torch.randint(1, v + 1, (b,), generator=torch.Generator().manual_seed(v))
    p = torch.rand(b, generator=torch.Generator().manual_seed(v + 1)) * 0.5 + 0.4
    out = fn(logits, k, p)
    assert torch.equal(out, vllm_top_k_top_p(logits.double(), k, p.double()).float())
    assert [kk.template for kk in fn.kernels] == ["rows", "rows", "indexed"]


@pytest.mark.parametrize("src, arg", [(TOP_P, 0.9), (MIN_P, 0.1)], ids=["top_p", "min_p"])
@pytest.mark.parametrize("v", [113, 20000])
def test_warpers_of_bf16_logits_round_as_torch_does(src, arg, v):
    # bf16 logits, as a model hands them: the softmax and its running sum in bf16, as the
    # warper computes them in torch; the one row program gives torch's tokens exactly
    fn = tiledsl.compile(src.replace("f32[M, V]", "bf16[M, V]"))
    scores = randn(2, v, seed=v, scale=3.0).to(torch.bfloat16)
    out = fn(scores, arg)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fn.reference(scores, arg))
    assert [k.template for k in fn.kernels] == ["rows"]
