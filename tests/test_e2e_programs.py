"""The example programs end to end, against the design section 5 oracle, with tail sizes.

Kernel counts are asserted too (what each fused kernel covers is in test_fusion.py).
"""

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing

EXAMPLES = Path(__file__).parent.parent / "examples"


def example(name: str) -> tiledsl.Program:
    return tiledsl.compile(EXAMPLES / f"{name}.tdsl")


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 33, 113), (113, 64, 17)])
def test_matmul_bias_relu(m, k, n):
    fn = example("matmul_bias_relu")
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == [("matmul", ["matmul", "add", "relu"])]
    run_checked(fn, randn(m, k, dtype=torch.float16), randn(n, k, dtype=torch.float16),
                randn(n, dtype=torch.float16))


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (5, 5000)])
def test_softmax_example(m, n):
    fn = example("softmax")
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == [("rows", ["div", "softmax"])]
    run_checked(fn, randn(m, n, scale=4), temperature=0.7)


@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (3, 4999)])
def test_rmsnorm(m, n):
    fn = example("rmsnorm")
    assert [k.template for k in fn.kernels] == ["rows"]
    run_checked(fn, randn(m, n, dtype=torch.float16), randn(n, dtype=torch.float16), eps=1e-6)


@pytest.mark.parametrize("b, h, m, n, d", [(1, 2, 1, 1, 32), (1, 2, 113, 203, 64), (2, 1, 17, 17, 59)])
def test_attention(b, h, m, n, d):
    fn = example("attention")
    assert [k.template for k in fn.kernels] == ["attention"]
    q, k, v = (randn(b, h, s, d, dtype=torch.float16) for s in (m, n, n))
    _, out = run_checked(fn, q, k, v, scale=d**-0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                             scale=d**-0.5)
    assert (out.float() - sdpa).abs().max() < 5e-3


def test_attention_with_fully_masked_rows_is_zero():
    # bottom-right aligned causal mask written with index arithmetic: with M > N
    # the first M - N rows see no key at all
    src = """
    kernel attn(q: f32[M, D], k: f32[N, D], v: f32[N, D]) -> f32[M, D] {
        s = q @ k.T
        s = where(index(s, 1) <= index(s, 0) - (M - N), s, -inf)
        return softmax(s) @ v
    }"""
    q, k, v = randn(40, 16), randn(17, 16), randn(17, 16)
    _, out = run_checked(src, q, k, v)
    assert (out[: 40 - 17] == 0).all() and not out.isnan().any()


def test_large_logits_stay_finite():
    fn = example("attention")
    q, k, v = (randn(1, 2, 113, 64, dtype=torch.float16, scale=s) for s in (30, 30, 1))
    _, out = run_checked(fn, q, k, v, scale=0.125)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("m, n", [(17, 203), (1, 1)])
def test_causal_softcap_attention(m, n):
    fn = example("causal_softcap_attention")
    q, k, v = (randn(1, 2, s, 64, dtype=torch.bfloat16) for s in (m, n, n))
    run_checked(fn, q, k, v, scale=0.125, cap=20.0)


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (113, 77, 17)])
def test_gemm_multiply_multiply(m, k, n):
    fn = example("gemm_multiply_multiply")
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == [("matmul", ["matmul", "mul", "mul"])]
    a, b = randn(m, k, dtype=torch.float16), randn(k, n, dtype=torch.float16)
    run_checked(fn, a, b, randn(m, n, dtype=torch.float16), randn(m, n, dtype=torch.float16))


@pytest.mark.parametrize("m, n", [(1, 1), (113, 203)])
def test_trig_score_mod_attention_is_one_kernel(m, n):
    fn = example("trig_score_mod_attention")
    assert [k.template for k in fn.kernels] == ["attention"]
    assert {"cos", "sin", "tan", "tanh"} <= {op.kind for op in fn.kernels[0].ops}
    q, k, v = (randn(1, 2, s, 64, dtype=torch.bfloat16) for s in (m, n, n))
    run_checked(fn, q, k, v, scale=0.125)


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (113, 80, 17), (65, 200, 130)])
def test_fp8_gemm_with_row_and_column_scales(m, k, n):
    """composable-kernel's multiply-multiply as it is used: f8 operands, f32 scales, one kernel.
    On the interpreter f8 dot operands are widened exactly, so the product matches the f64
    golden of the same f8 values."""
    fn = example("gemm_fp8_scaled")
    assert [(k.template, [op.kind for op in k.ops]) for k in fn.kernels] == \
        [("matmul", ["matmul", "mul", "mul", "cast"])]
    a, b = randn(m, k).to(torch.float8_e4m3fn), randn(k, n, scale=3).to(torch.float8_e4m3fn)
    _, out = run_checked(fn, a, b, randn(m, 1), randn(1, n))
    assert out.dtype is torch.bfloat16


def test_fp8_operand_kinds_mix_and_batch():
    a = randn(113, 80).to(torch.float8_e4m3fn)
    b = randn(2, 97, 80).to(torch.float8_e5m2)
    fn, _ = run_checked("kernel f(a: f8e4m3[M, K], b: f8e5m2[B, N, K]) -> f32[B, M, N] { return a @ b.T }", a, b)
    assert [k.template for k in fn.kernels] == ["matmul"]
    q, k, v = randn(2, 113, 64).to(torch.float8_e4m3fn), randn(2, 97, 64).to(torch.float8_e4m3fn), randn(2, 97, 64)
    fn, _ = run_checked("kernel f(q: f8e4m3[B, M, D], k: f8e4m3[B, N, D], v: f32[B, N, D]) -> f32[B, M, D] {"
                        " return softmax(q @ k.T * 0.125) @ v }", q, k, v)
    assert [k.template for k in fn.kernels] == ["attention"]


def test_row_and_column_scales():
    src = """
    kernel scaled(a: f16[M, K], b: f16[K, N], rs: f32[M, 1], cs: f32[1, N]) -> f16[M, N] {
        return (a @ b) * rs * cs
    }"""
    run_checked(src, randn(113, 64, dtype=torch.float16), randn(64, 17, dtype=torch.float16),
                randn(113, 1), randn(1, 17))


def test_layernorm_two_dependent_reductions():
    src = """
    kernel layernorm(x: f32[M, N], w: f32[N], b: f32[N], eps: f32) -> f32[M, N] {
        mu = mean(x, keepdims=true)
        xc = x - mu
        var = mean(xc * xc, keepdims=true)
        return xc * rsqrt(var + eps) * w + b
    }"""
    run_checked(src, randn(17, 113), randn(113), randn(113), eps=1e-5)


def test_multiple_outputs_and_an_intermediate_returned():
    src = """
    kernel two(a: f32[M, K], b: f32[K, N]) -> (f32[M, N], f32[M, N], f16[M]) {
        c = a @ b
        return c, relu(c), sum(c)
    }"""
    fn, (c, r, s) = run_checked(src, randn(17, 33), randn(33, 113))
    assert s.dtype == torch.float16


def test_c_plus_c_transposed_is_correct():
    run_checked("kernel f(a: f32[N, K], b: f32[K, N]) -> f32[N, N] { c = a @ b; return c + c.T }",
                randn(17, 33), randn(33, 17))


def test_new_sizes_reuse_the_compiled_program():
    fn = example("softmax")
    for m, n in [(3, 7), (17, 113), (2, 4097)]:
        run_checked(fn, randn(m, n), temperature=1.5)


# --- the language of real models (indexing, integer arithmetic, reshape) --------------------


@pytest.mark.parametrize("h, kh, d", [(1, 1, 2), (6, 2, 8), (4, 1, 64)])
def test_rope_for_q_and_k(h, kh, d):
    fn = example("rope")
    assert [k.template for k in fn.kernels] == ["merged"]  # one launch, its programs split by output
    q, k = randn(2, h, 17, d), randn(2, kh, 17, d)
    c, s = randn(17, d), randn(17, d)
    _, (qr, kr) = run_checked(fn, q, k, c, s)

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    assert torch.allclose(qr, q * c + rotate_half(q) * s, atol=1e-6)
    assert torch.allclose(kr, k * c + rotate_half(k) * s, atol=1e-6)


@pytest.mark.parametrize("n, v", [(1, 1), (17, 113), (5, 5000)])
def test_cross_entropy_with_ignore_index_is_one_row_kernel(n, v):
    x = randn(n, v, scale=3)
    y = torch.randint(0, v, (n,))
    y[::2] = -100
    for fn in (example("cross_entropy"), tiledsl.compile(EXAMPLES / "cross_entropy.tdsl", check_bounds=True)):
        _, out = run_checked(fn, x, y)
        expected = torch.nn.functional.cross_entropy(x.double(), y, ignore_index=-100, reduction="none")
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert [k.template for k in example("cross_entropy").kernels] == ["rows"]


def _sdpa(q, k, v, keep):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                            attn_mask=keep)


@pytest.mark.parametrize("m", [1, 17, 113])
def test_dilated_window_attention_is_one_kernel(m):
    fn = example("dilated_window_attention")
    assert [k.template for k in fn.kernels] == ["attention"]
    q, k, v = (randn(1, 2, m, 32, dtype=torch.bfloat16) for _ in range(3))
    _, out = run_checked(fn, q, k, v)
    d = torch.arange(m)[:, None] - torch.arange(m)[None, :]
    assert torch.allclose(out.double(), _sdpa(q, k, v, (d >= 0) & (d < 64) & (d % 3 == 0)), atol=2e-2)


@pytest.mark.parametrize("rows, width, radius", [(1, 1, 1), (5, 8, 1), (7, 13, 2)])
def test_neighborhood_attention_is_one_kernel(rows, width, radius):
    fn = example("neighborhood_attention")
    assert [k.template for k in fn.kernels] == ["attention"]
    n = rows * width
    q, k, v = (randn(2, 1, n, 16, dtype=torch.float16) for _ in range(3))
    _, out = run_checked(fn, q, k, v, width=width, radius=radius)
    i = torch.arange(n)
    near = (((i // width)[:, None] - (i // width)[None, :]).abs() <= radius) & \
        (((i % width)[:, None] - (i % width)[None, :]).abs() <= radius)
    assert torch.allclose(out.double(), _sdpa(q, k, v, near), atol=2e-3)


# --- issue 12's programs as examples -------------------------------------------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize("m, k, f", [(1, 1, 1), (17, 33, 40), (113, 64, 24)])
def test_swiglu_mlp_example(m, k, f):
    fn = example("swiglu_mlp")
    assert [kern.template for kern in fn.kernels] == ["matmul", "matmul"]
    run_checked(fn, randn(m, k, dtype=BF16), randn(f, k, dtype=BF16, scale=0.3),
                randn(f, k, dtype=BF16, scale=0.3), randn(k, f, dtype=BF16, scale=0.3))


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 33, 113), (113, 64, 17)])
def test_rmsnorm_projection_example(m, k, n):
    fn = example("rmsnorm_projection")
    assert [kern.template for kern in fn.kernels] == ["matmul"]
    run_checked(fn, randn(m, k, dtype=BF16), randn(k, dtype=BF16), randn(n, k, dtype=BF16, scale=0.2),
                eps=1e-6)


@pytest.mark.parametrize("m", [1, 17, 113])
def test_attention_sinks_example(m):
    fn = example("attention_sinks")
    assert [kern.template for kern in fn.kernels] == ["attention"]
    n = m + 7
    run_checked(fn, randn(1, 2, m, 32, dtype=BF16), randn(1, 2, n, 32, dtype=BF16),
                randn(1, 2, n, 32, dtype=BF16), randn(2, 1, 1, dtype=BF16))


@pytest.mark.parametrize("m", [1, 17, 113])
def test_diff_attention_example(m):
    fn = example("diff_attention")
    assert [kern.template for kern in fn.kernels] == ["attention", "attention"]
    h = [randn(1, 2, m if i % 2 == 0 and i < 4 else m + 3, 16, dtype=torch.float16) for i in range(5)]
    run_checked(fn, *h, lam=0.4)


# --- two-matmul chains with no softmax (issue 27) -------------------------------------------------


@pytest.mark.parametrize("t", [1, 17, 113])
def test_linear_attention_example(t):
    fn = example("linear_attention")
    assert [kern.template for kern in fn.kernels] == ["attention"]
    q, k = randn(2, 3, t, 32, dtype=BF16), randn(2, 3, t, 32, dtype=BF16)
    _, out = run_checked(fn, q, k, randn(2, 3, t, 48, dtype=BF16))
    assert out.shape == (2, 3, t, 48)
    grads = testing.check_grads(fn, q, k, randn(2, 3, t, 48, dtype=BF16))
    assert grads.ok, grads
    assert [kern.template for kern in fn.backward.kernels] == ["attention_backward"] * 2


@pytest.mark.parametrize("t", [1, 17, 113])
def test_retention_example(t):
    fn = example("retention")
    assert [kern.template for kern in fn.kernels] == ["attention"]
    log_gamma = torch.log(1 - 2.0 ** (-5 - torch.arange(3.0)))  # RetNet's per-head decays
    args = [randn(2, 3, t, 32, dtype=torch.float16) for _ in range(2)] + [randn(2, 3, t, 40, dtype=torch.float16),
                                                                        log_gamma]
    run_checked(fn, *args)
    grads = testing.check_grads(fn, *args)
    assert grads.ok, grads
    assert [kern.template for kern in fn.backward.kernels] == ["attention_backward"] * 2


@pytest.mark.parametrize("chunks, length", [(1, 1), (3, 17), (2, 64)])
def test_mamba2_chunk_example(chunks, length):
    fn = example("mamba2_chunk")
    assert [kern.template for kern in fn.kernels] == ["rows", "attention"]
    a = -torch.rand(2, 3, chunks, length, generator=torch.Generator().manual_seed(length)) * 0.5
    args = (randn(2, 3, chunks, length, 16, dtype=BF16), randn(2, 3, chunks, length, 16, dtype=BF16),
            randn(2, 3, chunks, length, 24, dtype=BF16), a)
    run_checked(fn, *args)
    grads = testing.check_grads(fn, *args)
    assert grads.ok, grads
    # the scan's recompute, FlashAttention-2's two walks (the decay's gradient summed per
    # tile along both axes), the reversed scan of the gate's gradient
    assert [kern.template for kern in fn.backward.kernels] == ["rows", "attention_backward",
                                                               "attention_backward", "rows"]


# --- recompute and merge (issue 27) ---------------------------------------------------------------


@pytest.mark.parametrize("b, s, h, kh, d", [(1, 1, 1, 1, 16), (2, 17, 3, 1, 64), (1, 113, 3, 3, 16),
                                             (2, 113, 6, 2, 32), (2, 17, 1, 1, 64)])
def test_qk_norm_rope_attention_example(b, s, h, kh, d):
    fn = example("qk_norm_rope_attention")
    # the norms and rotations of q and k (H and KH heads) in one launch, cos and sin computed
    # from the positions in it, the rotation's partner element (j +- D / 2) computed again from
    # q there and the row's one statistic; then attention
    assert [kern.template for kern in fn.kernels] == ["merged", "attention"]
    pos = torch.arange(s, dtype=torch.int32) * 2 + 5
    args = (randn(b, s, h, d, dtype=BF16), randn(b, s, kh, d, dtype=BF16), randn(b, s, kh, d, dtype=BF16),
            randn(d, dtype=BF16), randn(d, dtype=BF16), pos)
    _, out = run_checked(fn, *args, eps=1e-6)
    assert out.shape == (b, h, s, d)
    # the stored rotated q and k, against torch written as the model writes it, in float64
    q, k, v, wq, wk = (t.double() for t in args[:5])
    inv_freq = 10000.0 ** (-2.0 * (torch.arange(d) % (d // 2)).double() / d)
    ang = pos.double()[:, None] * inv_freq
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]

    def norm_rope(x, w):
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    qr = norm_rope(q, wq).to(BF16).double().transpose(1, 2)
    kr = norm_rope(k, wk).to(BF16).double().transpose(1, 2).repeat_interleave(h // kh, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(qr, kr, v.transpose(1, 2).repeat_interleave(h // kh, 1),
                                                             is_causal=True, scale=d**-0.5)
    assert (out.double() - sdpa).abs().max() < 2e-2
    # its gradient passes the gathers of concat's pieces as reads at the inverse map: no
    # scatter-add into a zero-filled buffer (4 indexed kernels before)
    assert "indexed" not in [kern.template for kern in fn.backward.kernels]


@pytest.mark.parametrize("n, c, h, w", [(1, 1, 1, 1), (3, 5, 7, 11), (5, 3, 29, 31)])
def test_batch_norm_example(n, c, h, w):
    """Training batch norm: the statistics over axes 0, 2 and 3 and the output in one row
    program, one program per channel (the last size: N * H * W = 4495 loops over blocks);
    its derived backward is one kernel too."""
    fn = example("batch_norm")
    assert [kern.template for kern in fn.kernels] == ["rows"]
    args = (randn(n, c, h, w, scale=3), randn(c, seed=1), randn(c, seed=2))
    _, (y, mu, var) = run_checked(fn, *args, eps=1e-5)
    x = args[0].double()
    var64, mu64 = torch.var_mean(x, dim=(0, 2, 3), unbiased=False, keepdim=True)
    expected = (x - mu64) / torch.sqrt(var64 + 1e-5) * args[1].double()[:, None, None] + args[2].double()[:, None, None]
    assert torch.allclose(y.double(), expected, atol=1e-4)
    assert torch.allclose(mu.double(), mu64, atol=1e-5) and torch.allclose(var.double(), var64, atol=1e-4)
    grads = testing.check_grads(fn, *args, eps=1e-5)
    assert grads.ok, grads
    assert [kern.template for kern in fn.backward.kernels] == ["rows"]


@pytest.mark.parametrize("t", [4, 17, 113])
def test_depthwise_causal_conv1d_by_shifted_slices_is_one_kernel(t):
    """Mamba's short convolution as model code shifts it: each tap a concat of zeros and a
    slice, read through its index inside the one kernel (nothing shifted is stored)."""
    fn = tiledsl.compile("""
kernel causal_conv1d(x: f32[B, C, T], w: f32[C, 4], bias: f32[C]) -> f32[B, C, T] {
    x1 = concat(x[..., :1] * 0.0, x[..., :T - 1], axis=-1)
    x2 = concat(x[..., :2] * 0.0, x[..., :T - 2], axis=-1)
    x3 = concat(x[..., :3] * 0.0, x[..., :T - 3], axis=-1)
    y = x * w[:, 3:4] + x1 * w[:, 2:3] + x2 * w[:, 1:2] + x3 * w[:, 0:1] + bias[:, None]
    return silu(y)
}""")
    assert [kern.template for kern in fn.kernels] == ["pointwise"]
    x, w, bias = randn(2, 3, t), randn(3, 4), randn(3)
    _, out = run_checked(fn, x, w, bias)
    conv = torch.nn.functional.conv1d(x.double(), w.double()[:, None, :], bias.double(), padding=3, groups=3)
    assert torch.allclose(out.double(), torch.nn.functional.silu(conv[..., :t]), atol=1e-5)
