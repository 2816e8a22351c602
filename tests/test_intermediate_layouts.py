"""Intermediates' layouts are the compiler's (issue "The compiler owns its intermediates"):
a reshape of transposes of a value the program computes never raises a layout error. The
kernel computing the value stores it in the order the transposes view it (the head merge
after attention, as every torch attention block feeds its output projection), or, where it
cannot, the reshape copies; views of a score tile (Swin's window mask) keep attention fused."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked

HEAD_MERGE = """kernel block(x: f32[B, N, C], wqkv: f32[C, E], wo: f32[C, C]) -> f32[B, N, C] {
    qkv = reshape(x @ wqkv, [B, N, 3, 4, C // 4])
    q = transpose(qkv[:, :, 0], 1, 2)
    k = transpose(qkv[:, :, 1], 1, 2)
    v = transpose(qkv[:, :, 2], 1, 2)
    p = softmax((q @ transpose(k, -2, -1)) * 0.25, axis=-1)
    o = reshape(transpose(p @ v, 1, 2), [B, N, C])
    return o @ wo
}"""


def head_merge64(x, wqkv, wo):
    b, n, c = x.shape
    qkv = (x @ wqkv).reshape(b, n, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return (p @ v).transpose(1, 2).reshape(b, n, c) @ wo


@pytest.mark.parametrize("b, n, c", [(1, 1, 4), (2, 17, 32), (3, 113, 8)])
def test_the_head_merge_after_attention_is_a_view_of_what_attention_stores(b, n, c):
    x, wqkv, wo = randn(b, n, c), randn(c, 3 * c, scale=0.3), randn(c, c, scale=0.3)
    fn, out = run_checked(HEAD_MERGE, x, wqkv, wo)
    assert [k.template for k in fn.kernels] == ["matmul", "attention", "matmul"]
    want = head_merge64(x.double(), wqkv.double(), wo.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)
    (line,) = [ln.strip() for ln in fn.explain().splitlines() if "stored as" in ln]
    assert line == "out: f32[B, 4, N, C // 4] stored as [B, N, 4, C // 4] -> transpose(k1)"


def test_the_head_merge_trains_through_the_op():
    """The backward reads the stored layout too: gradients of all three weights and x
    against float64 autograd."""
    fn = tiledsl.compile(HEAD_MERGE)
    x, wqkv, wo = randn(2, 17, 16), randn(16, 48, scale=0.3), randn(16, 16, scale=0.3)
    ours = [t.clone().requires_grad_() for t in (x, wqkv, wo)]
    ref = [t.double().requires_grad_() for t in (x, wqkv, wo)]
    fn(*ours).square().sum().backward()
    head_merge64(*ref).square().sum().backward()
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=0, atol=2e-3 * r.grad.abs().max().item())


SWIN = """kernel swin(x: f32[B_, N, C], wqkv: f32[C, E], bqkv: f32[E], table: f32[T, H], rel: i64[N, N],
                 mask: f32[W, N, N], wp: f32[C, C], bp: f32[C]) -> f32[B_, N, C] {
    qkv = transpose(reshape(x @ wqkv + bqkv, [B_, N, 3, H, C // H]), 1, 3)
    q = qkv[:, :, 0] * 0.25
    k = qkv[:, :, 1]
    v = qkv[:, :, 2]
    attn = q @ transpose(k, -2, -1)
    bias = transpose(transpose(reshape(table[reshape(rel, [-1])], [N, N, -1]), 0, 2), 1, 2)
    attn = attn + bias[None]
    attn = reshape(attn, [B_ // W, W, H, N, N]) + mask[:, None][None]
    attn = reshape(attn, [-1, H, N, N])
    p = softmax(attn, axis=-1)
    o = reshape(transpose(p @ v, 1, 2), [B_, N, C])
    return o @ wp + bp
}"""


def swin64(x, wqkv, bqkv, table, rel, mask, wp, bp, heads):
    """Swin's WindowAttention.forward, as its authors write it."""
    b_, n, c = x.shape
    nw = mask.shape[0]
    qkv = (x @ wqkv + bqkv).reshape(b_, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * 0.25) @ k.transpose(-2, -1)
    bias = table[rel.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
    attn = attn + bias.unsqueeze(0)
    attn = attn.view(b_ // nw, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, heads, n, n).softmax(-1)
    return (attn @ v).transpose(1, 2).reshape(b_, n, c) @ wp + bp


@pytest.mark.parametrize("windows, nw, n, heads", [(1, 1, 1, 1), (2, 3, 17, 4), (1, 4, 49, 3)])
def test_swin_window_attention_with_relative_bias_and_shift_mask_is_three_kernels(windows, nw, n, heads):
    c, t = 8 * heads, 25
    x, wqkv, bqkv = randn(windows * nw, n, c), randn(c, 3 * c, scale=0.3), randn(3 * c)
    table, rel = randn(t, heads), torch.randint(0, t, (n, n), generator=torch.Generator().manual_seed(3))
    mask = torch.where(randn(nw, n, n) > 0.5, -100.0, 0.0)
    wp, bp = randn(c, c, scale=0.3), randn(c)
    args = (x, wqkv, bqkv, table, rel, mask, wp, bp)
    fn, out = run_checked(SWIN, *args)
    assert [k.template for k in fn.kernels] == ["matmul", "attention", "matmul"]
    want = swin64(*(a.double() if a.is_floating_point() else a for a in args), heads)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)


def test_a_reshape_to_split_windows_and_back_to_minus_one_gives_the_batch_dim_back():
    """`[B_ // W, W, ...]` is checked against `[B_, ...]` at the call, so W divides B_: the
    -1 of the reshape back is B_ (not `(B_ // W) * W`), and the scores add to the bias."""
    fn = tiledsl.compile("""kernel f(s: f32[B, H, N], m: f32[W, N]) -> f32[B, H, N] {
        t = reshape(s, [B // W, W, H, N]) + m[:, None]
        return reshape(t, [-1, H, N]) + s
    }""")
    s, m = randn(6, 2, 17), randn(3, 17)
    fn2, out = run_checked(fn, s, m)
    want = (s.double().view(2, 3, 2, 17) + m.double()[:, None]).view(-1, 2, 17) + s.double()
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn(randn(5, 2, 17), m)
    assert "changes the number of elements" in str(err.value).splitlines()[0]


def test_transposes_that_do_not_commute_are_stored_in_their_composed_order():
    """transpose(transpose(y, 0, 1), 1, 2) views y's axes (1, 2, 0): the matmul stores y in
    that order, and the reshape merging the last two is a view."""
    fn = tiledsl.compile("""kernel f(a: f32[P, Q, K], b: f32[K, R]) -> f32[Q, R * P] {
        y = a @ b
        return reshape(transpose(transpose(y, 0, 1), 1, 2), [Q, -1]) * 2.0
    }""")
    a, b = randn(3, 5, 7), randn(7, 4)
    _, out = run_checked(fn, a, b)
    want = ((a.double() @ b.double()).permute(1, 2, 0).reshape(5, -1)) * 2.0
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    assert "stored as [Q, R, P]" in fn.explain()


def test_a_reshape_of_a_transposed_flat_stored_intermediate_copies_instead_of_failing():
    """A pointwise kernel stores at a flat index, so it cannot store transposed: the
    reshape merging the transposed dims copies (torch's reshape) rather than refusing."""
    fn = tiledsl.compile("""kernel f(x: f32[M, N], y: f32[N, M]) -> f32[N * M] {
        return sum(reshape(transpose(exp(x), 0, 1), [-1])[None, :] * reshape(y, [1, -1]), axis=0)
    }""")
    x, y = randn(17, 5), randn(5, 17)
    _, out = run_checked(fn, x, y)
    torch.testing.assert_close(out.double(), x.double().exp().T.reshape(-1) * y.double().reshape(-1),
                               rtol=0, atol=1e-5)


def test_a_floor_division_the_call_never_checks_is_not_taken_as_exact():
    """`x[:, :D // 2]` viewed as [N, D // 2] checks nothing at the call (the counts are equal
    as written), so D // 2 * 2 stays D // 2 * 2: with D = 17 the -1 is 16, not D."""
    fn = tiledsl.compile("""kernel f(x: f32[N, D]) -> f32[N, D // 2 * 2] {
        t = reshape(x[:, :D // 2], [N, D // 2])
        return reshape(concat(t, t * 2.0, axis=-1), [N, -1])
    }""")
    x = randn(3, 17)
    _, out = run_checked(fn, x)
    h = x.double()[:, :8]
    torch.testing.assert_close(out.double(), torch.cat([h, h * 2], -1), rtol=0, atol=1e-6)


GQA_BACK = """kernel gqa(q: f32[B, S, H, D], k: f32[B, S, HK, D], v: f32[B, S, HK, D]) -> f32[B, S, H, D] {
    s = reshape(transpose(q, 1, 2), [B, HK, H // HK, S, D]) @ transpose(transpose(k, 1, 2)[:, :, None], -1, -2)
    o = softmax(s * rsqrt(D), axis=-1) @ transpose(v, 1, 2)[:, :, None]
    return transpose(reshape(o, [B, H, S, D]), 1, 2)
}"""


@pytest.mark.parametrize("s", [1, 17, 113])
def test_a_returned_view_chain_of_attention_is_what_attention_stores(s):
    # Qwen3's attention output, [B, KV heads, group, S, D] after repeat_kv's grouping, merged
    # back to heads and transposed to [B, S, H, D]: attention stores it in that order, so
    # the returned value is a fresh contiguous tensor with no copy kernel
    q, k, v = randn(2, s, 4, 16), randn(2, s, 2, 16, seed=1), randn(2, s, 2, 16, seed=2)
    fn, out = run_checked(GQA_BACK, q, k, v)
    assert [kk.template for kk in fn.kernels] == ["attention"]
    assert out.is_contiguous()
    kr, vr = (t.double().transpose(1, 2).repeat_interleave(2, 1) for t in (k, v))
    want = torch.softmax(q.double().transpose(1, 2) @ kr.transpose(-1, -2) / 4.0, -1) @ vr
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=0, atol=1e-5)
    (line,) = [ln.strip() for ln in fn.explain().splitlines() if "stored as" in ln]
    assert line.startswith("out: f32[B, HK, H // HK, S, D] stored as [B, S, HK, H // HK, D] -> ")


def test_a_returned_view_chain_of_a_flat_kernel_is_copied():
    # a pointwise kernel stores at a flat index: the returned view is copied by a kernel
    fn, out = run_checked("kernel f(x: f32[A, B, C]) -> f32[B * C, A] "
                          "{ return transpose(reshape(x * 2.0, [A, B * C]), 0, 1) }", randn(3, 5, 7))
    assert [kk.template for kk in fn.kernels] == ["pointwise", "pointwise"]
    assert out.is_contiguous()


def test_returned_views_of_one_result_never_alias():
    # a reshape of a kernel result is returned as a view of it only when no other output is
    # that result or a view of it
    fn = tiledsl.compile("kernel f(x: f32[A, B]) -> (f32[A * B], f32[B, A], f32[A, B]) "
                         "{ y = x * 2.0 \n return reshape(y, [A * B]), reshape(y, [B, A]), y }")
    x = randn(3, 5)
    outs = fn(x)
    assert len({o.data_ptr() for o in outs}) == 3
    assert torch.equal(outs[0], (x * 2).reshape(-1)) and torch.equal(outs[1], (x * 2).reshape(5, 3))
    assert [k.template for k in fn.kernels] == ["pointwise", "pointwise", "pointwise"]
