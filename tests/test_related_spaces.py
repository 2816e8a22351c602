"""Kernels over related iteration spaces joined: an elementwise op reading a value computed
over a smaller space, broadcast along some of its dims (through transposes and size-1
views), is a row program over its space whose rows compute that value once each
(`fuse_rows.broadcast_axes`; the views are members read along the dims their layouts name,
`legality.view_dims`). Attention-state merges as vLLM and FlashInfer write them."""

from __future__ import annotations

import pytest
import torch

from helpers import randn, run_checked

# vLLM's merge_attn_states reference (vllm/attention/ops/triton_merge_attn_states.py's torch
# form): lse [H, T] per head and token, outputs [T, H, D]
MERGE = """
kernel merge_attn_states(prefix_output: {t}[T, H, D], prefix_lse: f32[H, T],
                         suffix_output: {t}[T, H, D], suffix_lse: f32[H, T]) -> ({t}[T, H, D], f32[H, T]) {{
    p_lse = where(prefix_lse == inf, -inf, prefix_lse)
    s_lse = where(suffix_lse == inf, -inf, suffix_lse)
    max_lse = maximum(p_lse, s_lse)
    p_lse = p_lse - max_lse
    s_lse = s_lse - max_lse
    p_lse_exp = exp(p_lse)
    s_lse_exp = exp(s_lse)
    out_se = p_lse_exp + s_lse_exp
    output_lse = log(out_se) + max_lse
    p_scale = p_lse_exp / out_se
    s_scale = s_lse_exp / out_se
    p_scale = transpose(p_scale, 0, 1)[:, :, None]
    s_scale = transpose(s_scale, 0, 1)[:, :, None]
    output = prefix_output * p_scale + suffix_output * s_scale
    return cast(output, {t}), output_lse
}}"""


def merge_reference(po, pl, so, sl):
    pl, sl = pl.double(), sl.double()
    pl = torch.where(pl == torch.inf, -torch.inf, pl)
    sl = torch.where(sl == torch.inf, -torch.inf, sl)
    m = torch.maximum(pl, sl)
    pe, se = torch.exp(pl - m), torch.exp(sl - m)
    total = pe + se
    out = po.double() * (pe / total).T[:, :, None] + so.double() * (se / total).T[:, :, None]
    return out, torch.log(total) + m


@pytest.mark.parametrize("t, h, d", [(1, 1, 1), (17, 3, 16), (113, 5, 40)])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_vllm_merge_attn_states_is_one_kernel(t, h, d, dt):
    # the hand-written kernel: a program per (token, head) combines the two lse once and
    # scales the head's D outputs; here a row program over [T, H, D] with rows (T, H), the
    # [H, T] chain read per row along dims (1, 0) and output_lse stored per row
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
    po, so = randn(t, h, d, seed=1, dtype=dtype), randn(t, h, d, seed=2, dtype=dtype)
    pl, sl = randn(h, t, seed=3, scale=3.0), randn(h, t, seed=4, scale=3.0)
    pl[0, 0] = torch.inf  # an empty prefix (vLLM's inf lse): the suffix alone
    fn, (out, lse) = run_checked(MERGE.format(t=dt), po, pl, so, sl)
    want, want_lse = merge_reference(po, pl, so, sl)
    torch.testing.assert_close(out.double(), want, rtol=1e-5 if dt == "f32" else 1e-2, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert [k.template for k in fn.kernels] == ["rows"]
    report = fn.explain()
    assert "transpose (line 15), slice (line 15)" in report
    # the [T, H, D] outputs read and written once, the lse read and written once
    per_element = {"f32": 12, "bf16": 6}[dt]
    assert f"modeled HBM traffic: {per_element}·D·H·T + 12·H·T B fused" in report


@pytest.mark.parametrize("s, h, d", [(1, 1, 1), (17, 3, 16), (113, 5, 40)])
def test_flashinfer_merge_state_is_one_kernel(s, h, d):
    # flashinfer's merge_state reference: states [S, H] beside values [S, H, D], no transpose
    src = """
kernel merge_state(v_a: f32[S, H, D], s_a: f32[S, H], v_b: f32[S, H, D], s_b: f32[S, H])
        -> (f32[S, H, D], f32[S, H]) {
    s_max = maximum(s_a, s_b)
    a = exp(s_a - s_max)
    b = exp(s_b - s_max)
    v = (v_a * a[..., None] + v_b * b[..., None]) / (a + b)[..., None]
    return v, s_max + log(a + b)
}"""
    va, vb = randn(s, h, d, seed=1), randn(s, h, d, seed=2)
    sa, sb = randn(s, h, seed=3, scale=3.0), randn(s, h, seed=4, scale=3.0)
    fn, (v, lse) = run_checked(src, va, sa, vb, sb)
    m = torch.maximum(sa, sb).double()
    a, b = torch.exp(sa.double() - m), torch.exp(sb.double() - m)
    want = (va.double() * a[..., None] + vb.double() * b[..., None]) / (a + b)[..., None]
    torch.testing.assert_close(v.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), m + torch.log(a + b), rtol=1e-6, atol=1e-6)
    assert [k.template for k in fn.kernels] == ["rows"]


def test_a_view_merging_dims_is_not_read_through_by_a_row_program():
    # a reshape merging [H, T] into one dim is no transpose or size-1 view: the chain stays a
    # kernel of its own, the reader reads it stored
    src = """
kernel f(x: f32[H, T], y: f32[HT, D]) -> f32[HT, D] {
    e = exp(x - max(x, axis=1, keepdims=true)) * 3.0 + sin(x) * cos(x) + tanh(x)
    return y * reshape(e, [HT, 1])
}"""
    fn, out = run_checked(src, randn(3, 5, seed=1), randn(15, 7, seed=2))
    x, y = randn(3, 5, seed=1).double(), randn(15, 7, seed=2).double()
    e = torch.exp(x - x.max(1, keepdim=True).values) * 3.0 + torch.sin(x) * torch.cos(x) + torch.tanh(x)
    torch.testing.assert_close(out.double(), y * e.reshape(15, 1), rtol=1e-6, atol=1e-6)
    assert len(fn.kernels) == 2


QK_NORM_ROPE = """
kernel qk_norm_rope(q: bf16[B, S, H, D], w: bf16[D], cos: bf16[B, S, D], sin: bf16[B, S, D], eps: f32) -> bf16[B, H, S, D] {
    qf = cast(q, f32)
    qn = transpose(w * cast(qf * rsqrt(mean(qf * qf, axis=-1, keepdims=true) + eps), bf16), 1, 2)
    c = cos[:, None]
    s = sin[:, None]
    return qn * c + concat(-qn[..., D // 2:], qn[..., :D // 2], axis=-1) * s
}"""


@pytest.mark.parametrize("b, s, h, d", [(1, 1, 1, 2), (2, 17, 3, 16), (1, 113, 5, 64)])
def test_qk_norm_then_rope_after_the_head_transpose_is_one_row_program(b, s, h, d):
    # Qwen3's q_norm, `.transpose(1, 2)`, then rotate-half RoPE, as its attention writes them:
    # the halves of the transposed, normalised q are read through at the rows' own positions
    # (q gathered transposed along D, the statistic through a transposed view), and the
    # [B, H, S, D] RoPE runs along (0, 2, 1, 3) of the norm's [B, S, H, D] row program
    q = randn(b, s, h, d, dtype=torch.bfloat16, seed=1, scale=3.0)
    w = randn(d, dtype=torch.bfloat16, seed=2) * 0.2 + 1
    cos, sin = randn(b, s, d, dtype=torch.bfloat16, seed=3), randn(b, s, d, dtype=torch.bfloat16, seed=4)
    fn, out = run_checked(QK_NORM_ROPE, q, w, cos, sin, 1e-6)
    qf = q.double()
    qn = (w.double() * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6))).transpose(1, 2)
    half = d // 2
    want = qn * cos.double()[:, None] + torch.cat([-qn[..., half:], qn[..., :half]], -1) * sin.double()[:, None]
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)
    assert [k.template for k in fn.kernels] == ["rows"]
