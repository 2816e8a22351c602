"""Programs written as model code writes them (losses, normalisations, masks, MLPs), not as
our examples do: each fuses to the kernel count of a hand-written version (Liger-Kernel's
losses and norms, FlashAttention's masks), and agrees with the float64 oracle."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from tiledsl import testing

# name: (kernels, program); two kernels where a hand-written version has two too (a GEMM
# and a second product or a row loss over it, a mean over rows of a row loss)
PROGRAMS = {
    "kl_div": (1, "kernel f(x: f32[M, V], t: f32[M, V]) -> f32[M] {\n return sum(exp(t) * (t - x), axis=-1)\n}"),
    "jsd": (1, "kernel f(x: f32[M, V], t: f32[M, V]) -> f32[M] {\n m = 0.5 * (exp(x) + exp(t))\n lm = log(m)\n return 0.5 * sum(exp(x) * (x - lm) + exp(t) * (t - lm), axis=-1)\n}"),
    "label_smoothing_ce": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n lp = x - logsumexp(x, axis=-1, keepdims=true)\n return -0.9 * gather(lp, y) - 0.1 * mean(lp, axis=-1)\n}"),
    "z_loss_ce": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n lse = logsumexp(x, axis=-1)\n return lse - gather(x, y) + 1e-4 * lse * lse\n}"),
    "softcap_ce": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n z = 30.0 * tanh(x / 30.0)\n return logsumexp(z, axis=-1) - gather(z, y)\n}"),
    "softcap_ce_logsoftmax": (1, "kernel f(x: bf16[M, V], y: i64[M]) -> f32[M] {\n z = 30.0 * tanh(cast(x, f32) / 30.0)\n return -gather(z - logsumexp(z, axis=-1, keepdims=true), y)\n}"),
    "add_rmsnorm": (1, "kernel f(x: bf16[M, N], r: bf16[M, N], w: bf16[N]) -> (bf16[M, N], bf16[M, N]) {\n h = x + r\n hf = cast(h, f32)\n return (h, cast(hf * rsqrt(mean(hf * hf, axis=-1, keepdims=true) + 1e-6), bf16) * w)\n}"),
    "sliding_window": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n i = index(s, -2)\n j = index(s, -1)\n s = where((j <= i) & (i - j < 64), s, -inf)\n return softmax(s) @ v\n}"),
    "prefix_lm": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D], p: i32) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = where((index(s, -1) <= index(s, -2)) | (index(s, -1) < p), s, -inf)\n return softmax(s) @ v\n}"),
    "key_padding": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D], lens: i32[B]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = where(index(s, -1) < lens[:, None, None, None], s, -inf)\n return softmax(s) @ v\n}"),
    "mqa": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, N, D], v: f16[B, N, D]) -> f16[B, H, M, D] {\n return softmax(q @ k[:, None].T * rsqrt(D)) @ v[:, None]\n}"),
    "geglu": (1, "kernel f(a: f16[M, N], b: f16[M, N]) -> f16[M, N] {\n return gelu(a) * b\n}"),
    "swiglu_mlp": (2, "kernel f(x: bf16[M, K], wg: bf16[F, K], wu: bf16[F, K], wd: bf16[K, F]) -> bf16[M, K] {\n return (silu(x @ wg.T) * (x @ wu.T)) @ wd.T\n}"),
    "linear_ce": (2, "kernel f(h: bf16[M, K], w: bf16[V, K], y: i64[M]) -> f32[M] {\n z = cast(h @ w.T, f32)\n return logsumexp(z, axis=-1) - gather(z, y)\n}"),
    "dpo_logps": (1, "kernel f(x: f32[B, T, V], y: i64[B, T], m: f32[B, T]) -> f32[B] {\n lp = x - logsumexp(x, axis=-1, keepdims=true)\n return sum(gather(lp, y) * m, axis=-1)\n}"),
    "entropy": (1, "kernel f(x: f32[M, V]) -> f32[M] {\n p = softmax(x, axis=-1)\n return -sum(p * log(p + 1e-20), axis=-1)\n}"),
    "entropy_lse": (1, "kernel f(x: f32[M, V]) -> f32[M] {\n lse = logsumexp(x, axis=-1, keepdims=true)\n p = exp(x - lse)\n return -sum(p * (x - lse), axis=-1)\n}"),
    "focal": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n lp = x - logsumexp(x, axis=-1, keepdims=true)\n l = gather(lp, y)\n return -((1.0 - exp(l)) ** 2) * l\n}"),
    "layernorm_residual_dropless": (1, "kernel f(x: f16[M, N], r: f16[M, N], w: f16[N], b: f16[N]) -> f16[M, N] {\n h = cast(x + r, f32)\n mu = mean(h, axis=-1, keepdims=true)\n var = mean((h - mu) ** 2, axis=-1, keepdims=true)\n return cast((h - mu) * rsqrt(var + 1e-5), f16) * w + b\n}"),
    "attention_lse_training": (1, "kernel f(q: bf16[B, H, M, D], k: bf16[B, H, N, D], v: bf16[B, H, N, D]) -> (bf16[B, H, M, D], f32[B, H, M]) {\n s = cast(q @ k.T, f32) * rsqrt(D)\n s = where(causal(s), s, -inf)\n return (cast(softmax(s), bf16) @ v, logsumexp(s, axis=-1))\n}"),
    # weight-only quantized linears (gpt-fast's int8, bitsandbytes-style NF4 through a code
    # table): the unpacking is the GEMM's B prologue
    "int8_weight_only": (1, "kernel f(x: f16[M, K], w: i8[N, K], scales: f16[N]) -> f16[M, N] {\n return (x @ cast(w, f16).T) * scales\n}"),
    "nf4_linear": (1, "kernel f(x: f16[M, K], packed: u8[KP, N], code: f16[16], absmax: f16[G, N]) -> f16[M, N] {\n k = index(x[0][:, None], 0)\n n = index(packed[0][None, :], 1)\n q = (packed[k // 2, n] >> (4 * (k % 2))) & 0xF\n return x @ (code[q] * absmax[k // 64, n])\n}"),
    # minGRU's log-space parallel scan (Feng et al., "Were RNNs all we needed?")
    "mingru_log_scan": (1, "kernel f(log_coeffs: f32[B, T, D], log_values: f32[B, T, D]) -> f32[B, T, D] {\n a_star = cumsum(log_coeffs, axis=1)\n return exp(a_star + logcumsumexp(log_values - a_star, axis=1))\n}"),
    # open_clip's ClipLoss: logits per image and per text are one GEMM and its transpose (the
    # scale hoisted off both), the two cross-entropy means one launch: normalize x2, GEMM, loss
    "open_clip_loss": (4, "kernel f(img: f32[N, E], txt: f32[N, E], s: f32) -> f32[] {\n"
                          " i = img / maximum(sqrt(sum(img * img, axis=-1, keepdims=true)), 1e-12)\n"
                          " t = txt / maximum(sqrt(sum(txt * txt, axis=-1, keepdims=true)), 1e-12)\n"
                          " lpi = s * i @ t.T\n lpt = s * t @ i.T\n"
                          " labels = index(lpi, 0) == index(lpi, 1)\n"
                          " ci = logsumexp(lpi, axis=-1) - sum(where(labels, lpi, 0.0), axis=-1)\n"
                          " ct = logsumexp(lpt, axis=-1) - sum(where(labels, lpt, 0.0), axis=-1)\n"
                          " return (mean(ci, axis=0) + mean(ct, axis=0)) / 2.0\n}"),
    # an MoE layer's combine: each routed token's expert output, weighted, added into its row
    "moe_combine": (1, "kernel f(ye: f32[TK, D], token: i64[TK], weight: f32[TK], x: f32[T, D]) -> f32[T, D] {\n return index_add(zeros(x), 0, token, ye * weight[:, None])\n}"),
}

DIMS = dict(M=17, V=113, N=33, B=2, H=3, D=16, K=19, F=23, T=5, KP=10, G=1, TK=7, E=29)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_model_program_fuses_as_hand_written(name):
    want, src = PROGRAMS[name]
    fn = tiledsl.compile(src)
    assert len(fn.kernels) == want, fn.explain()
    g = torch.Generator().manual_seed(len(name))
    dims = {d: DIMS[d] for d in testing.needed_dims(fn)}
    args = testing.random_inputs(fn, dims, generator=g)
    if "y" in args:  # labels, some negative (from the end) and some out of range (0)
        args["y"] = torch.randint(-dims["V"] - 2, dims["V"] + 2, args["y"].shape, generator=g)
    if "lens" in args:
        args["lens"] = torch.randint(1, dims["N"] + 1, args["lens"].shape, generator=g, dtype=torch.int32)
    if "p" in args:
        args["p"] = 7
    report = testing.check(fn, **args)
    assert report.ok, report
