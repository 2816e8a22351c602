"""Chunked prefill over a paged KV cache, as vLLM writes it: the queries of several
sequences packed along one token axis (`cu_query_lens` the cumulative query lengths), each
token's keys and values gathered through its sequence's row of the block table, causal from
the end of the sequence's context. Checked against a float64 torch implementation of
vLLM's reference (`ref_paged_attn`) and the oracle."""

import pytest
import torch

import tiledsl
from helpers import run_checked
from tiledsl import testing

# seq: the sequence a token belongs to (how many sequences end at or before it); ctx: the
# keys of its sequence before its query chunk; a token at position t - cu_query_lens[seq]
# of its chunk sees keys j <= ctx + that position
CHUNKED_PREFILL = """
kernel chunked_prefill(q: f16[T, H, D], k_cache: f16[NB, P, H, D], v_cache: f16[NB, P, H, D],
                       block_tables: i32[S, L], cu_query_lens: i32[S1], seq_lens: i32[S],
                       scale: f32) -> f16[T, H, D] {
    t = index(q[:, 0, 0], 0)
    seq = sum(cast(cu_query_lens[None, 1:] <= t[:, None], i32), axis=-1)
    k = transpose(reshape(k_cache[block_tables[seq]], [T, L * P, H, D]), 1, 2)
    v = transpose(reshape(v_cache[block_tables[seq]], [T, L * P, H, D]), 1, 2)
    s = q[:, :, None, :] @ k.T * scale
    q_pos = t - cu_query_lens[seq]
    ctx = seq_lens[seq] - (cu_query_lens[seq + 1] - cu_query_lens[seq])
    s = where(index(s, -1) <= (ctx + q_pos)[:, None, None, None], s, -inf)
    return (softmax(s) @ v)[:, :, 0, :]
}
"""

# the same with grouped query heads: a token's G query heads of a key/value head are the
# rows of one score tile
CHUNKED_PREFILL_GQA = """
kernel chunked_prefill_gqa(q: f16[T, HK, G, D], k_cache: f16[NB, P, HK, D], v_cache: f16[NB, P, HK, D],
                           block_tables: i32[S, L], cu_query_lens: i32[S1], seq_lens: i32[S],
                           scale: f32) -> f16[T, HK, G, D] {
    t = index(q[:, 0, 0, 0], 0)
    seq = sum(cast(cu_query_lens[None, 1:] <= t[:, None], i32), axis=-1)
    k = transpose(reshape(k_cache[block_tables[seq]], [T, L * P, HK, D]), 1, 2)
    v = transpose(reshape(v_cache[block_tables[seq]], [T, L * P, HK, D]), 1, 2)
    s = q @ k.T * scale
    ctx = seq_lens[seq] - (cu_query_lens[seq + 1] - cu_query_lens[seq])
    s = where(index(s, -1) <= (ctx + t - cu_query_lens[seq])[:, None, None, None], s, -inf)
    return softmax(s) @ v
}
"""


def ref_paged_attn(q, k_cache, v_cache, query_lens, kv_lens, block_tables, scale):
    """vLLM's tests/kernels/attention/test_flash_attn.py `ref_paged_attn`, in float64: per
    sequence, its queries, the first kv_len keys of its blocks (repeated for grouped query
    heads), a mask keeping key j of query row i while j <= i + kv_len - query_len."""
    _, p, hk, d = k_cache.shape
    outs, start = [], 0
    for i, (q_len, kv_len) in enumerate(zip(query_lens, kv_lens, strict=True)):
        qs = q[start:start + q_len].double().reshape(q_len, -1, d) * scale
        blocks = block_tables[i, :(kv_len + p - 1) // p].long()
        k, v = (c[blocks].double().reshape(-1, hk, d)[:kv_len] for c in (k_cache, v_cache))
        k, v = (x.repeat_interleave(qs.shape[1] // hk, 1) for x in (k, v))
        attn = torch.einsum("qhd,khd->hqk", qs, k)
        masked = torch.triu(torch.ones(q_len, kv_len), diagonal=kv_len - q_len + 1).bool()
        attn.masked_fill_(masked, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(attn, -1), v))
        start += q_len
    return torch.cat(outs).reshape(q.shape)


def batch(query_lens, kv_lens, p, l, heads, d, seed):
    """Packed queries, a cache larger than the sequences use with its blocks handed out at
    random, the block table, the cumulative query lengths and the sequence lengths."""
    g = torch.Generator().manual_seed(seed)
    t, s = sum(query_lens), len(query_lens)
    nb = s * l + 3
    q = torch.randn(t, *heads, d, generator=g).to(torch.float16)
    hk = heads[0]
    k_cache, v_cache = (torch.randn(nb, p, hk, d, generator=g).to(torch.float16) for _ in range(2))
    table = torch.randperm(nb, generator=g)[:s * l].reshape(s, l).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu, torch.tensor(kv_lens, dtype=torch.int32), d ** -0.5


# (query lens, kv lens, block size, blocks per sequence): a decode token beside prefill
# chunks with and without context, one token of one key, blocks of one row, a chunk that
# is a whole sequence of 53 keys
CASES = [([1, 17, 5], [37, 17, 53], 16, 4), ([1], [1], 1, 1), ([3, 1], [3, 20], 17, 2),
         ([53, 1, 17], [53, 17, 37], 16, 4)]


@pytest.mark.parametrize("query_lens, kv_lens, p, l", CASES)
def test_chunked_prefill_gathers_each_tokens_keys_through_its_sequence_in_one_attention_kernel(
        query_lens, kv_lens, p, l):
    args = batch(query_lens, kv_lens, p, l, (2,), 32, seed=sum(query_lens) * 100 + p)
    fn, out = run_checked(CHUNKED_PREFILL, *args)
    # the token's sequence is a row sum over the cumulative lengths; the attention kernel
    # computes it again at its score tile for the mask, beside the gathers of k and v
    assert [k.template for k in fn.kernels] == ["rows", "attention"]
    (attention,) = [k for k in fn.kernel_ops() if k.template == "attention"]
    assert attention.plan.v_chain
    q, k_cache, v_cache, table, _, _, scale = args
    golden = ref_paged_attn(q, k_cache, v_cache, query_lens, kv_lens, table, scale)
    assert torch.allclose(out.double(), golden, atol=2e-3)


@pytest.mark.parametrize("query_lens, kv_lens, p, l", CASES[:3])
def test_chunked_prefill_with_grouped_query_heads(query_lens, kv_lens, p, l):
    args = batch(query_lens, kv_lens, p, l, (2, 3), 16, seed=sum(kv_lens) + p)
    fn, out = run_checked(CHUNKED_PREFILL_GQA, *args)
    assert [k.template for k in fn.kernels] == ["rows", "attention"]
    q, k_cache, v_cache, table, _, _, scale = args
    golden = ref_paged_attn(q, k_cache, v_cache, query_lens, kv_lens, table, scale)
    assert torch.allclose(out.double(), golden, atol=2e-3)


def test_a_score_op_reading_a_value_only_a_prologue_computes_fails_verification(monkeypatch):
    """The plan's check: a score op reads values of the score tile, never a value of an
    operand's prologue, which exists on that operand's tile only (the emitter had no value
    for it and crashed)."""
    from tiledsl.passes.fusion import attention

    monkeypatch.setattr(attention, "_shared_prologue", lambda *args: set())
    with pytest.raises(tiledsl.TileDSLError, match="which the score tile does not compute"):
        tiledsl.compile(CHUNKED_PREFILL, verify=True)


def test_chunked_prefill_gradients_through_the_gathers():
    """Its backward (the cache's gradients scattered back through the block table) against
    float64 autograd of the reference."""
    fn = tiledsl.compile(CHUNKED_PREFILL.replace("f16", "f32"))
    q, k_cache, v_cache, *rest = batch([1, 17, 5], [37, 17, 53], 16, 4, (2,), 16, seed=3)
    report = testing.check_grads(fn, q.float(), k_cache.float(), v_cache.float(), *rest)
    assert report.ok, report
    assert "attention_backward" in [k.template for k in fn.backward.kernels]
