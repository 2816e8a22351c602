"""Out-of-place scatters as one kernel (`put_into`): scatter and index_copy store into a copy
of x, with no mask of the written elements and no merge kernel, and scatter_add and index_add
of an f32 x add into one, so what reads the result (a KV cache's attention) is the next kernel; a scatter at a permutation (argsort's positions)
writes every element and needs no x; values gathered at a permutation and scattered back are
the values. Against float64 torch on awkward sizes, with exact kernel counts, gradients and
diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

import tiledsl
from helpers import SIZES, gen, randn, run_checked
from tiledsl import testing

DECODE = """
kernel decode(q: {t}[B, H, 1, D], k_new: {t}[B, H, 1, D], v_new: {t}[B, H, 1, D],
              k_cache: {t}[B, H, T, D], v_cache: {t}[B, H, T, D], pos: i64[1])
              -> ({t}[B, H, 1, D], {t}[B, H, T, D], {t}[B, H, T, D]) {{
    k = index_copy(k_cache, 2, pos, k_new)
    v = index_copy(v_cache, 2, pos, v_new)
    s = q @ k.T * rsqrt(D)
    s = where(index(s, -1) <= pos[0], s, -inf)
    return softmax(s, axis=-1) @ v, k, v
}}
"""


@pytest.mark.parametrize("t", SIZES)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_kv_cache_append_then_decode_attention_is_two_kernels(t, dt):
    # Hugging Face's StaticCache.update (k_out.index_copy_(2, cache_position, key_states)), then
    # eager attention over the cache at decode: the append is one indexed kernel storing into
    # a copy of each cache, the attention reads the copies
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
    b, h, d = 2, 3, 16
    q, kn, vn = (randn(b, h, 1, d, dtype=dtype, seed=s) for s in (1, 2, 3))
    kc, vc = randn(b, h, t, d, dtype=dtype, seed=4), randn(b, h, t, d, dtype=dtype, seed=5)
    pos = torch.tensor([t // 2])
    kc0, vc0 = kc.clone(), vc.clone()
    fn, (o, k, v) = run_checked(DECODE.format(t=dt), q, kn, vn, kc, vc, pos)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "the append wrote into the caller's cache"
    assert torch.equal(k, kc.index_copy(2, pos, kn)) and torch.equal(v, vc.index_copy(2, pos, vn))
    kr, vr = k.double(), v.double()
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(d)
    s = torch.where(torch.arange(t) <= t // 2, s, -math.inf)
    ref = torch.softmax(s, -1) @ vr
    torch.testing.assert_close(o.double(), ref, rtol=1e-5 if dt == "f32" else 2e-2,
                               atol=1e-5 if dt == "f32" else 2e-2)
    assert [k.template for k in fn.kernels] == ["indexed", "attention"]
    text = fn.explain()
    assert f"{dt}[B, H, T, D] starting as a copy of k_cache -> " in text
    assert f"{dt}[B, H, T, D] starting as a copy of v_cache -> " in text


@pytest.mark.parametrize("n", SIZES)
def test_index_copy_along_each_axis(n):
    for axis in (0, 1):
        x = randn(7, n, seed=axis)
        length = x.shape[axis]
        idx = torch.randperm(length, generator=gen(n))[: max(length // 2, 1)]
        shape = list(x.shape)
        shape[axis] = len(idx)
        src = randn(*shape, seed=n + axis)
        dims = ", ".join("K" if a == axis else "ND"[a] for a in range(2))
        fn, out = run_checked(f"kernel f(x: f32[N, D], idx: i64[K], s: f32[{dims}]) -> f32[N, D] "
                              f"{{ return index_copy(x, {axis}, idx, s * 2.0) + 1.0 }}", x, idx, src)
        assert torch.equal(out, x.index_copy(axis, idx, src * 2.0) + 1.0)
        # the copy with its writes, then the add reading it
        assert [k.template for k in fn.kernels] == ["indexed", "pointwise"]


def test_scatter_of_a_computed_x_keeps_x_stored_once():
    # x is computed (x * 3): its kernel stores it, the scatter starts from a copy of it, and
    # the caller's value is returned as computed too
    src = """
kernel f(x: f32[N, D], idx: i64[M, D], s: f32[M, D]) -> (f32[N, D], f32[N, D]) {
    y = x * 3.0
    return scatter(y, idx, s, 0), y
}
"""
    x, s = randn(17, 5), randn(9, 5, seed=1)
    idx = torch.stack([torch.randperm(17, generator=gen(c))[:9] for c in range(5)], 1)
    fn, (out, y) = run_checked(src, x, idx, s)
    assert torch.equal(out, (x * 3.0).scatter(0, idx, s)) and torch.equal(y, x * 3.0)
    assert [k.template for k in fn.kernels] == ["pointwise", "indexed"]


@pytest.mark.parametrize("n", SIZES)
def test_gradients_through_scatter_index_copy_and_scatter_add(n):
    for call in ("scatter(x, idx, s * 2.0, 0)", "index_copy(x, 0, idx[:, 0], s * 2.0)",
                 "scatter_add(x, idx, s * 2.0, 0)"):
        fn = tiledsl.compile(f"kernel f(x: f32[N, D], idx: i64[M, D], s: f32[M, D]) -> f32[N, D] "
                             f"{{ return {call} * x }}")
        m = max(n // 2, 1)
        idx = torch.stack([torch.randperm(n, generator=gen(c))[:m] for c in range(4)], 1)
        if call.startswith("index_copy"):
            idx = idx[:, :1].expand(m, 4).contiguous()
        report = testing.check_grads(fn, randn(n, 4), idx, randn(m, 4, seed=2), generator=gen(n))
        assert report.ok, f"{call}: {report}"


@pytest.mark.parametrize("v", SIZES)
def test_scatter_of_a_gather_at_a_permutation_is_the_value(v):
    src = """
kernel f(scores: f32[M, V], t: f32[M, V]) -> f32[M, V] {
    i = argsort(scores, axis=-1)
    return scatter(t, i, gather(t, i, axis=-1), axis=-1) * 2.0
}
"""
    scores, t = randn(5, v, seed=v), randn(5, v, seed=v + 1)
    fn, out = run_checked(src, scores, t)
    assert torch.equal(out, t * 2.0)
    assert [k.template for k in fn.kernels] == ["pointwise"]
    assert "argtopk" not in fn.explain()


@pytest.mark.parametrize("src, message", [
    ("kernel f(x: f32[N, D], i: i64[M, 2], s: f32[M, D]) -> f32[N, D] { return index_copy(x, 0, i, s) }",
     "'index_copy' needs a 1-d index, got i64[M, 2]"),
    ("kernel f(x: f32[N, D], i: i64[M], s: f32[M, 3]) -> f32[N, D] { return index_copy(x, 0, i, s) }",
     "'index_copy' needs src of x's sizes but along axis 0; dim 1 is 3 here and D in x"),
    ("kernel f(x: f32, i: i64[M], s: f32[M]) -> f32 { return index_copy(x, 0, i, s) }",
     "'index_copy' needs a value of rank 1 or more, got f32"),
    ("kernel f(x: f32[N, D], i: f32[M], s: f32[M, D]) -> f32[N, D] { return index_copy(x, 0, i, s) }",
     "indexing needs an integer value, got f32; cast(i, i32) if it holds whole numbers"),
])
def test_bad_index_copies_are_located_errors(src, message):
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(src)
    assert err.value.message == message


@pytest.mark.parametrize("n", SIZES)
def test_the_gradients_of_two_gathers_of_one_weight_add_into_one_buffer(n):
    # tied embeddings read twice (the input embedding and a second lookup): the backward's two
    # scatter-adds over one space add atomically into one result, one kernel
    fn = tiledsl.compile("kernel f(w: f32[V, D], a: i64[T], b: i64[T]) -> f32[T, D] "
                         "{ return w[a, :] * 2.0 + w[b, :] }")
    a, b = torch.randint(0, 11, (n,), generator=gen(n)), torch.randint(0, 11, (n,), generator=gen(n + 1))
    report = testing.check_grads(fn, randn(11, 17, seed=n), a, b, generator=gen(n))
    assert report.ok, f"{report}"
    assert [k.template for k in fn.backward.kernels] == ["indexed"]


def test_a_put_into_no_fusion_pass_took_is_lowered_over_its_written_values():
    # any pipeline is valid: lower-kernels gives a put_into the space of what it writes
    fn = tiledsl.compile("kernel f(x: f32[N, D], idx: i64[M, D], s: f32[M, D]) -> f32[N, D] "
                         "{ return scatter(x, idx, s, 0) }", pipeline="canonicalize,cse,dce,lower-kernels")
    x, s = randn(17, 5), randn(9, 5, seed=1)
    idx = torch.stack([torch.randperm(17, generator=gen(c))[:9] for c in range(5)], 1)
    fn, out = run_checked(fn, x, idx, s)
    assert torch.equal(out, x.scatter(0, idx, s))
    assert "plan indexed {space = [M, D]" in fn.ir()


@pytest.mark.parametrize("n", SIZES)
def test_index_add_and_index_copy_take_either_order(n):
    # torch's (x, axis, index, src), or the scatters' (x, index, src, axis=) as DLRM's
    # translation writes it: an axis is an integer literal
    x, s = randn(n, 6, seed=n), randn(4, 6, seed=n + 1)
    idx = torch.randint(0, n, (4,), generator=gen(n))
    for call in ("index_add(x, idx, s, axis=0)", "index_add(x, 0, idx, s)"):
        fn, out = run_checked(f"kernel f(x: f32[N, D], idx: i64[K], s: f32[K, D]) -> f32[N, D] "
                              f"{{ return {call} }}", x, idx, s)
        torch.testing.assert_close(out.double(), x.double().index_add(0, idx, s.double()), rtol=1e-6, atol=1e-6)
    perm = torch.randperm(n, generator=gen(n))[:1]
    fn, out = run_checked("kernel f(x: f32[N, D], idx: i64[K], s: f32[K, D]) -> f32[N, D] "
                          "{ return index_copy(x, idx, s, axis=0) }", x, perm, s[:1])
    assert torch.equal(out, x.index_copy(0, perm, s[:1]))
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile("kernel f(x: f32[N, D], idx: i64[K], s: f32[K, D]) -> f32[N, D] "
                        "{ return index_add(x, idx, s) }")
    assert err.value.message == "'index_add' is missing the argument 'axis'"


PAGED_APPEND = """
kernel append_then_decode(q: f32[B, H, D], k_new: f32[B, H, D], v_new: f32[B, H, D],
                          k_cache: f32[NB, P, H, D], v_cache: f32[NB, P, H, D], slot_mapping: i64[B],
                          block_table: i32[B, L], lens: i32[B])
                          -> (f32[B, H, D], f32[NB, P, H, D], f32[NB, P, H, D]) {
    k_cache = reshape(index_copy(reshape(k_cache, [NB * P, H, D]), 0, slot_mapping, k_new), [NB, P, H, D])
    v_cache = reshape(index_copy(reshape(v_cache, [NB * P, H, D]), 0, slot_mapping, v_new), [NB, P, H, D])
    k = reshape(transpose(transpose(k_cache[block_table], 1, 3), 2, 3), [B, H, L * P, D])
    v = reshape(transpose(transpose(v_cache[block_table], 1, 3), 2, 3), [B, H, L * P, D])
    s = q[:, :, None, :] @ k.T * rsqrt(D)
    s = where(index(s, -1) < lens[:, None, None, None], s, -inf)
    return (softmax(s) @ v)[:, :, 0, :], k_cache, v_cache
}
"""


@pytest.mark.parametrize("p", [1, 4, 16])
def test_a_paged_cache_append_then_paged_decode_is_two_kernels(p):
    # vLLM's reshape_and_cache (each new token's k and v written at its slot of the paged
    # cache, the cache viewed flat: key_cache.view(-1, H, D).index_copy_(0, slot_mapping, key))
    # then PagedAttention over the block table: the appends are one indexed kernel, the
    # attention reads the caches they return (returned as views of what it stores)
    b, h, d, nb, blocks = 3, 2, 16, 9, 3
    q, kn, vn = (randn(b, h, d, seed=s) for s in (1, 2, 3))
    kc, vc = randn(nb, p, h, d, seed=4), randn(nb, p, h, d, seed=5)
    table = torch.randperm(nb, generator=gen(p))[:b * blocks].reshape(b, blocks).int()
    lens = torch.tensor([1, 2 * p + 1, blocks * p]).clamp(max=blocks * p).int()
    slots = torch.stack([table[i, (lens[i] - 1) // p].long() * p + (lens[i] - 1) % p for i in range(b)])
    fn, (o, k2, v2) = run_checked(PAGED_APPEND, q, kn, vn, kc, vc, slots, table, lens)
    kr = kc.double().reshape(-1, h, d).index_copy(0, slots, kn.double()).reshape(nb, p, h, d)
    vr = vc.double().reshape(-1, h, d).index_copy(0, slots, vn.double()).reshape(nb, p, h, d)
    assert torch.equal(k2.double(), kr) and torch.equal(v2.double(), vr)
    for i in range(b):
        ks = kr[table[i].long()].reshape(blocks * p, h, d)[:lens[i]]
        vs = vr[table[i].long()].reshape(blocks * p, h, d)[:lens[i]]
        want = torch.einsum("hn,nhd->hd", torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), ks) / d ** 0.5,
                                                        -1), vs)
        torch.testing.assert_close(o[i].double(), want, rtol=0, atol=1e-5)
    assert [k.template for k in fn.kernels] == ["indexed", "attention"]


@pytest.mark.parametrize("n", SIZES)
def test_a_write_into_an_intermediate_nothing_else_reads_is_in_place(n):
    # `y = x * 2; y[idx] = v`: the scatter takes over the kernel's fresh y instead of copying
    # it; where y is also returned it copies (the returned y keeps its elements)
    src = """kernel f(x: f32[M, N], idx: i64[K], v: f32[K, N]) -> f32[M, N] {
    y = x * 2.0
    y[idx] = v
    return y + 1.0
}"""
    x, v = randn(n + 2, 5, seed=n), randn(2, 5, seed=n + 1)
    idx = torch.randperm(n + 2, generator=gen(n))[:2]
    x0 = x.clone()
    fn, out = run_checked(src, x, idx, v)
    want = x * 2.0
    want[idx] = v
    assert torch.equal(out, want + 1.0) and torch.equal(x, x0)
    assert [k.template for k in fn.kernels] == ["pointwise", "indexed", "pointwise"]
    assert "out: f32[M, N] written in place of k0 -> k2" in fn.explain()
    assert "in place}" in fn.ir()
    fn2, (out2, y) = run_checked(src.replace("-> f32[M, N]", "-> (f32[M, N], f32[M, N])").replace(
        "y = x * 2.0", "y = x * 2.0\n    z = y").replace("return y + 1.0", "return y + 1.0, z"), x, idx, v)
    assert torch.equal(out2, want + 1.0) and torch.equal(y, x * 2.0)
    assert "starting as a copy of k0" in fn2.explain()
    report = testing.check_grads(fn, x, idx, v, generator=gen(n))
    assert report.ok, f"{report}"


def test_the_kv_cache_decode_example_is_two_kernels():
    from pathlib import Path

    fn = tiledsl.compile(Path(__file__).resolve().parents[1] / "examples" / "kv_cache_decode.tdsl")
    b, h, t, d = 2, 3, 17, 16
    args = [randn(b, h, 1, d, dtype=torch.float16, seed=s) for s in (1, 2, 3)]
    args += [randn(b, h, t, d, dtype=torch.float16, seed=s) for s in (4, 5)]
    fn, (o, k, v) = run_checked(fn, *args, torch.tensor([9]))
    assert torch.equal(k, args[3].index_copy(2, torch.tensor([9]), args[1]))
    assert [kk.template for kk in fn.kernels] == ["indexed", "attention"]


@pytest.mark.parametrize("v", SIZES)
def test_hf_repetition_penalty_is_one_kernel(v):
    # RepetitionPenaltyLogitsProcessor.__call__ as Hugging Face writes it: the scores of the
    # tokens seen gathered, scaled by the penalty by their sign, scattered back
    src = """
kernel repetition_penalty(input_ids: i64[B, L], scores: f32[B, V], penalty: f32) -> f32[B, V] {
    score = gather(scores, input_ids, axis=1)
    score = where(score < 0, score * penalty, score / penalty)
    return scatter(scores, input_ids, score, axis=1)
}"""
    scores = randn(3, v + 7, seed=v)
    ids = torch.stack([torch.randperm(v + 7, generator=gen(v + c))[:5] for c in range(3)])
    fn, out = run_checked(src, ids, scores, 1.3)
    score = torch.gather(scores.double(), 1, ids)
    score = torch.where(score < 0, score * 1.3, score / 1.3)
    torch.testing.assert_close(out.double(), scores.double().scatter(1, ids, score), rtol=1e-6, atol=1e-7)
    # the gather, the penalty and the write into a copy of the scores: one indexed kernel
    assert [k.template for k in fn.kernels] == ["indexed"]
