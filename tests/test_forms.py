"""Form invariance: equivalent forms of the programs we fuse take the kernels the canonical
form takes (issue 27). Each variant is written the way model code writes it (a softmax by
hand, reductions without keepdims re-expanded, attention normalised after `@ v`,
probabilities from a logsumexp, additive masks, transposed products, a gather of a cast,
...), compiled with the default pipeline, checked for its kernel count, and run against
the float64 oracle at awkward sizes."""

import pytest
import torch

import tiledsl
from tiledsl import testing

A = "q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]"
O = "f16[B, H, M, D]"
def attn(body, params=A, ret=O, extra=""):
    return f"kernel f({params}{extra}) -> {ret} {{\n{body}\n}}"
VARIANTS = {
 # --- attention: canonical 1 kernel
 "attn/canonical": (1, attn("s = q @ k.T * rsqrt(D)\n return softmax(s) @ v")),
 "attn/handwritten_softmax": (1, attn("s = q @ k.T * rsqrt(D)\n e = exp(s - max(s, axis=-1, keepdims=true))\n return (e / sum(e, axis=-1, keepdims=true)) @ v")),
 "attn/no_keepdims_reexpanded": (1, attn("s = q @ k.T * rsqrt(D)\n m = max(s, axis=-1)\n e = exp(s - m[..., None])\n z = sum(e, axis=-1)\n return (e / z[..., None]) @ v")),
 "attn/normalise_after_pv": (1, attn("s = q @ k.T * rsqrt(D)\n e = exp(s - max(s, axis=-1, keepdims=true))\n return (e @ v) / sum(e, axis=-1, keepdims=true)")),
 "attn/probs_from_lse": (1, attn("s = q @ k.T * rsqrt(D)\n p = exp(s - logsumexp(s, axis=-1, keepdims=true))\n return p @ v")),
 "attn/probs_from_lse_returned": (1, attn("s = q @ k.T * rsqrt(D)\n l = logsumexp(s, axis=-1, keepdims=true)\n return exp(s - l) @ v, l", ret="(f16[B, H, M, D], f16[B, H, M, 1])")),
 "attn/additive_causal": (1, attn("s = q @ k.T * rsqrt(D)\n s = s + where(causal(s), 0.0, -inf)\n return softmax(s) @ v")),
 "attn/additive_mask_param": (1, attn("s = q @ k.T * rsqrt(D) + mask\n return softmax(s) @ v", extra=", mask: f16[M, N]")),
 "attn/bool_mask_param": (1, attn("s = q @ k.T * rsqrt(D)\n return softmax(where(mask, s, -inf)) @ v", extra=", mask: bool[B, 1, M, N]")),
 "attn/transpose_fn": (1, attn("return softmax(q @ transpose(k, 2, 3) * rsqrt(D)) @ v")),
 "attn/pre_transposed_k": (1, "kernel f(q: f16[B, H, M, D], kt: f16[B, H, D, N], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n return softmax(q @ kt * rsqrt(D)) @ v\n}"),
 "attn/scale_q_first": (1, attn("return softmax((q * rsqrt(D)) @ k.T) @ v")),
 "attn/scale_k": (1, attn("return softmax(q @ (k * rsqrt(D)).T) @ v")),
 "attn/transposed_output": (1, attn("p = softmax(q @ k.T * rsqrt(D))\n return (v.T @ p.T).T")),
 "attn/bshd_layout": (1, "kernel f(q: f16[B, M, H, D], k: f16[B, N, H, D], v: f16[B, N, H, D]) -> f16[B, M, H, D] {\n qt = transpose(q, 1, 2); kt = transpose(k, 1, 2); vt = transpose(v, 1, 2)\n return transpose(softmax(qt @ kt.T * rsqrt(D)) @ vt, 1, 2)\n}"),
 "attn/softmax_f32_then_cast": (1, attn("s = cast(q @ k.T, f32) * rsqrt(D)\n p = softmax(s)\n return cast(p, f16) @ v")),
 "attn/lse_f32_output": (1, attn("s = q @ k.T * rsqrt(D)\n return softmax(s) @ v, cast(logsumexp(s, axis=-1), f32)", ret="(f16[B, H, M, D], f32[B, H, M])")),
 "attn/sinks_maximum": (1, attn("s = q @ k.T * rsqrt(D)\n m = maximum(max(s, axis=-1, keepdims=true), sink)\n e = exp(s - m)\n return (e / (sum(e, axis=-1, keepdims=true) + exp(sink - m))) @ v", extra=", sink: f16[H, 1, 1]")),
 "attn/gqa_k_broadcast_view": (1, "kernel f(q: f16[B, KH, G, M, D], k: f16[B, KH, N, D], v: f16[B, KH, N, D]) -> f16[B, KH, G, M, D] {\n s = q @ k[:, :, None].T * rsqrt(D)\n return softmax(s) @ v[:, :, None]\n}"),
 "attn/gqa_reshape_q": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, KH, N, D], v: f16[B, KH, N, D]) -> f16[B, H, M, D] {\n qg = reshape(q, [B, KH, H // KH, M, D])\n return reshape(softmax(qg @ k[:, :, None].T * rsqrt(D)) @ v[:, :, None], [B, H, M, D])\n}"),
 "attn/gqa_flat_rows": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, KH, N, D], v: f16[B, KH, N, D]) -> f16[B, H, M, D] {\n qg = reshape(q, [B, KH, H // KH * M, D])\n o = softmax(qg @ k.T * rsqrt(D)) @ v\n return reshape(o, [B, H, M, D])\n}"),
 "attn/handwritten_logsumexp_returned": (1, attn("s = q @ k.T * rsqrt(D)\n m = max(s, axis=-1, keepdims=true)\n l = m + log(sum(exp(s - m), axis=-1, keepdims=true))\n return softmax(s) @ v, l", ret="(f16[B, H, M, D], f16[B, H, M, 1])")),
 "attn/mask_after_scale_fill": (1, attn("s = where(causal(q @ k.T), q @ k.T, -inf) * rsqrt(D)\n return softmax(s) @ v")),
 # --- softmax / rows
 "rows/softmax": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n return softmax(x)\n}"),
 "rows/softmax_hand": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n e = exp(x - max(x, axis=-1, keepdims=true))\n return e / sum(e, axis=-1, keepdims=true)\n}"),
 "rows/softmax_hand_nokeep": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n e = exp(x - max(x, axis=-1)[:, None])\n return e / sum(e, axis=-1)[:, None]\n}"),
 "rows/logsoftmax_hand": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n return x - logsumexp(x, axis=-1, keepdims=true)\n}"),
 "rows/logsoftmax_hand2": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n m = max(x, axis=-1, keepdims=true)\n return x - m - log(sum(exp(x - m), axis=-1, keepdims=true))\n}"),
 "rows/rmsnorm": (1, "kernel f(x: f16[M, N], w: f16[N], eps: f32) -> f16[M, N] {\n return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + eps) * w\n}"),
 "rows/rmsnorm_f32": (1, "kernel f(x: f16[M, N], w: f16[N], eps: f32) -> f16[M, N] {\n xf = cast(x, f32)\n return cast(xf * rsqrt(mean(xf ** 2, axis=-1, keepdims=true) + eps), f16) * w\n}"),
 "rows/rmsnorm_div_sqrt": (1, "kernel f(x: f16[M, N], w: f16[N], eps: f32) -> f16[M, N] {\n return w * (x / sqrt(sum(x * x, axis=-1, keepdims=true) / N + eps))\n}"),
 "rows/rmsnorm_pow": (1, "kernel f(x: f32[M, N], w: f32[N], eps: f32) -> f32[M, N] {\n return x * (mean(x * x, axis=-1, keepdims=true) + eps) ** -0.5 * w\n}"),
 "rows/layernorm": (1, "kernel f(x: f32[M, N], w: f32[N], b: f32[N]) -> f32[M, N] {\n mu = mean(x, axis=-1, keepdims=true)\n var = mean((x - mu) ** 2, axis=-1, keepdims=true)\n return (x - mu) * rsqrt(var + 1e-5) * w + b\n}"),
 "rows/layernorm_e2": (1, "kernel f(x: f32[M, N], w: f32[N], b: f32[N]) -> f32[M, N] {\n mu = mean(x, axis=-1, keepdims=true)\n var = mean(x * x, axis=-1, keepdims=true) - mu * mu\n return (x - mu) / sqrt(var + 1e-5) * w + b\n}"),
 "rows/layernorm_nokeep": (1, "kernel f(x: f32[M, N], w: f32[N], b: f32[N]) -> f32[M, N] {\n mu = mean(x, axis=-1)\n xc = x - mu[:, None]\n var = mean(xc * xc, axis=-1)\n return xc * rsqrt(var + 1e-5)[:, None] * w + b\n}"),
 "rows/ce_gather": (1, "kernel f(x: f16[M, V], y: i64[M]) -> f32[M] {\n return logsumexp(cast(x, f32), axis=-1) - gather(cast(x, f32), y)\n}"),
 "rows/ce_gather_of_cast": (1, "kernel f(x: f16[M, V], y: i64[M]) -> f32[M] {\n xf = cast(x, f32)\n return logsumexp(xf, axis=-1) - gather(xf, y)\n}"),
 "rows/ce_cast_of_gather": (1, "kernel f(x: f16[M, V], y: i64[M]) -> f32[M] {\n return logsumexp(cast(x, f32), axis=-1) - cast(gather(x, y), f32)\n}"),
 "rows/ce_log_softmax": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n return -gather(x - logsumexp(x, axis=-1, keepdims=true), y)\n}"),
 "rows/ce_mean_loss": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[] {\n return mean(logsumexp(x, axis=-1) - gather(x, y), axis=0)\n}"),
 "rows/nested_mean": (1, "kernel f(x: f32[B, M, N]) -> f32[B] {\n return mean(mean(x, axis=-1), axis=-1)\n}"),
 "rows/tuple_mean": (1, "kernel f(x: f32[B, M, N]) -> f32[B] {\n return mean(x, axis=(1, 2))\n}"),
 # --- gemm epilogues: canonical 1
 "gemm/mm": (1, "kernel f(a: f16[M, K], b: f16[K, N], d: f16[M, N], e: f16[M, N]) -> f16[M, N] {\n return (a @ b) * d * e\n}"),
 "gemm/mm_rev": (1, "kernel f(a: f16[M, K], b: f16[K, N], d: f16[M, N], e: f16[M, N]) -> f16[M, N] {\n return e * (d * (a @ b))\n}"),
 "gemm/mm_f32acc": (1, "kernel f(a: f16[M, K], b: f16[K, N], d: f16[M, N]) -> f16[M, N] {\n return cast(cast(a @ b, f32) * cast(d, f32), f16)\n}"),
 "gemm/bias_relu_bt": (1, "kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] {\n return relu(x @ w.T + b)\n}"),
 "gemm/bias_relu_transpose_fn": (1, "kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] {\n return maximum(x @ transpose(w, 0, 1) + b[None, :], 0.0)\n}"),
 "gemm/transposed_product": (1, "kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] {\n return relu((w @ x.T).T + b)\n}"),
 "gemm/swiglu": (2, "kernel f(x: bf16[M, K], w1: bf16[F, K], w3: bf16[F, K], w2: bf16[K, F]) -> bf16[M, K] {\n return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T\n}"),
 "gemm/swiglu_reversed": (2, "kernel f(x: bf16[M, K], w1: bf16[F, K], w3: bf16[F, K], w2: bf16[K, F]) -> bf16[M, K] {\n return ((x @ w3.T) * (x @ w1.T) * sigmoid(x @ w1.T)) @ w2.T\n}"),
 # --- more forms of the same programs
 "attn/div_sqrt": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T / sqrt(D)\n return softmax(s) @ v\n}"),
 "attn/scale_const": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = (q @ k.T) * 0.125\n return softmax(s, axis=-1) @ v\n}"),
 "attn/softmax_axis3": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n return softmax(q @ k.T * rsqrt(D), axis=3) @ v\n}"),
 "attn/hand_nokeep": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n e = exp(s - max(s, axis=-1)[..., None])\n return (e / sum(e, axis=-1)[..., None]) @ v\n}"),
 "attn/hand_f32": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = cast(q @ k.T, f32) * rsqrt(D)\n e = exp(s - max(s, axis=-1, keepdims=true))\n p = e / sum(e, axis=-1, keepdims=true)\n return cast(p, f16) @ v\n}"),
 "attn/normalise_after_pv_nokeep": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n e = exp(s - max(s, axis=-1, keepdims=true))\n return (e @ v) / sum(e, axis=-1)[..., None]\n}"),
 "attn/recip_mul": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n e = exp(s - max(s, axis=-1, keepdims=true))\n return (e * (1.0 / sum(e, axis=-1, keepdims=true))) @ v\n}"),
 "attn/causal_where_index": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = where(index(s, 2) >= index(s, 3), s, -inf)\n return softmax(s) @ v\n}"),
 "attn/causal_additive_index": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = s + where(index(s, -2) >= index(s, -1), 0.0, -inf)\n return softmax(s) @ v\n}"),
 "attn/causal_fn_after_softmax_scale": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = where(causal(q @ k.T), q @ k.T, -inf)\n return softmax(s * rsqrt(D)) @ v\n}"),
 "attn/lse_exp2": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n return exp(s - logsumexp(s, axis=-1)[..., None]) @ v\n}"),
 "attn/k_transposed_param": (1, "kernel f(q: f16[B, H, M, D], kt: f16[B, H, D, N], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n return softmax(q @ kt * rsqrt(D)) @ v\n}"),
 "attn/vt_param": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], vt: f16[B, H, D, N]) -> f16[B, H, M, D] {\n return softmax(q @ k.T * rsqrt(D)) @ vt.T\n}"),
 "attn/bshd_both": (1, "kernel f(q: f16[B, M, H, D], k: f16[B, N, H, D], v: f16[B, N, H, D]) -> f16[B, M, H, D] {\n qt = transpose(q, 1, 2)\n kt = transpose(k, 1, 2)\n vt = transpose(v, 1, 2)\n return transpose(softmax(qt @ kt.T * rsqrt(D)) @ vt, 1, 2)\n}"),
 "attn/3d": (1, "kernel f(q: f16[BH, M, D], k: f16[BH, N, D], v: f16[BH, N, D]) -> f16[BH, M, D] {\n return softmax(q @ k.T * rsqrt(D)) @ v\n}"),
 "attn/scores_f32_lse_out": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> (f16[B, H, M, D], f32[B, H, M]) {\n s = cast(q @ k.T, f32) * rsqrt(D)\n return (cast(softmax(s), f16) @ v, logsumexp(s, axis=-1))\n}"),
 "attn/softcap": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = 30.0 * tanh(s / 30.0)\n return softmax(s) @ v\n}"),
 "attn/alibi": (1, "kernel f(q: f16[B, H, M, D], k: f16[B, H, N, D], v: f16[B, H, N, D], slope: f32[H]) -> f16[B, H, M, D] {\n s = q @ k.T * rsqrt(D)\n s = s + slope[:, None, None] * cast(index(s, -1) - index(s, -2), f32)\n return softmax(s) @ v\n}"),
 "rows/softmax_unstable": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n e = exp(x)\n return e / sum(e, axis=-1, keepdims=true)\n}"),
 "rows/softmax_axis1": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n return softmax(x, axis=1)\n}"),
 "rows/logsoftmax_lse_nokeep": (1, "kernel f(x: f32[M, N]) -> f32[M, N] {\n return x - logsumexp(x, axis=-1)[:, None]\n}"),
 "rows/lse_hand": (1, "kernel f(x: f32[M, N]) -> f32[M] {\n m = max(x, axis=-1)\n return m + log(sum(exp(x - m[:, None]), axis=-1))\n}"),
 "rows/lse_hand_keep": (1, "kernel f(x: f32[M, N]) -> f32[M, 1] {\n m = max(x, axis=-1, keepdims=true)\n return m + log(sum(exp(x - m), axis=-1, keepdims=true))\n}"),
 "rows/rmsnorm_sqrt_div": (1, "kernel f(x: f16[M, N], w: f16[N]) -> f16[M, N] {\n return w * (x / sqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6))\n}"),
 "rows/rmsnorm_sum_div_n": (1, "kernel f(x: f16[M, N], w: f16[N]) -> f16[M, N] {\n return x * rsqrt(sum(x * x, axis=-1, keepdims=true) / N + 1e-6) * w\n}"),
 "rows/rmsnorm_f32_cast_back": (1, "kernel f(x: bf16[M, N], w: bf16[N]) -> bf16[M, N] {\n h = cast(x, f32)\n h = h * rsqrt(mean(h * h, axis=-1, keepdims=true) + 1e-6)\n return cast(h, bf16) * w\n}"),
 "rows/rmsnorm_nokeep": (1, "kernel f(x: f16[M, N], w: f16[N]) -> f16[M, N] {\n return x * rsqrt(mean(x * x, axis=-1) + 1e-6)[:, None] * w\n}"),
 "rows/layernorm_var_e2": (1, "kernel f(x: f32[M, N], w: f32[N], b: f32[N]) -> f32[M, N] {\n mu = mean(x, axis=-1, keepdims=true)\n var = mean(x * x, axis=-1, keepdims=true) - mu * mu\n return (x - mu) / sqrt(var + 1e-5) * w + b\n}"),
 "rows/layernorm_3d": (1, "kernel f(x: f32[B, M, N], w: f32[N], b: f32[N]) -> f32[B, M, N] {\n mu = mean(x, axis=-1, keepdims=true)\n xc = x - mu\n return xc * rsqrt(mean(xc * xc, axis=-1, keepdims=true) + 1e-5) * w + b\n}"),
 "rows/ce_logsoftmax_mean": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[] {\n return mean(-gather(x - logsumexp(x, axis=-1, keepdims=true), y), axis=0)\n}"),
 "rows/ce_softmax_log": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n return -log(gather(softmax(x, axis=-1), y))\n}"),
 "rows/ce_index_syntax": (1, "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n lp = x - logsumexp(x, axis=-1, keepdims=true)\n return -lp[index(y, 0), y]\n}"),
 "rows/ce_transposed": (1, "kernel f(x: f32[V, M], y: i64[M]) -> f32[M] {\n lp = x - logsumexp(x, axis=0, keepdims=true)\n return -lp[y, index(y, 0)]\n}"),
 "rows/nested_sum_keep": (1, "kernel f(x: f32[B, M, N]) -> f32[B, 1, 1] {\n return sum(sum(x, axis=-1, keepdims=true), axis=-2, keepdims=true)\n}"),
 "rows/mean_over_reshape": (1, "kernel f(x: f32[B, M, N]) -> f32[B] {\n return mean(reshape(x, [B, M * N]), axis=-1)\n}"),
 "rows/groupnorm_view": (1, "kernel f(x: f32[B, C, L]) -> f32[B, C, L] {\n g = reshape(x, [B, 4, C // 4 * L])\n mu = mean(g, axis=-1, keepdims=true)\n var = mean((g - mu) * (g - mu), axis=-1, keepdims=true)\n return reshape((g - mu) * rsqrt(var + 1e-5), [B, C, L])\n}"),
 "gemm/bias_first": (1, "kernel f(x: f16[M, K], w: f16[K, N], b: f16[N]) -> f16[M, N] {\n return b + x @ w\n}"),
 "gemm/bias_2d_row": (1, "kernel f(x: f16[M, K], w: f16[K, N], b: f16[1, N]) -> f16[M, N] {\n return relu(x @ w + b)\n}"),
 "gemm/silu_hand": (1, "kernel f(x: f16[M, K], w: f16[K, N]) -> f16[M, N] {\n h = x @ w\n return h / (1.0 + exp(-h))\n}"),
 "gemm/gelu_tanh": (1, "kernel f(x: f16[M, K], w: f16[K, N]) -> f16[M, N] {\n h = cast(x @ w, f32)\n return cast(0.5 * h * (1.0 + tanh(0.7978845608 * (h + 0.044715 * h * h * h))), f16)\n}"),
 "gemm/scale_ab": (1, "kernel f(a: f8e4m3[M, K], b: f8e4m3[K, N], sa: f32[M, 1], sb: f32[1, N]) -> bf16[M, N] {\n return cast(cast(a @ b, f32) * sa * sb, bf16)\n}"),
 "gemm/residual": (1, "kernel f(x: f16[M, K], w: f16[K, N], r: f16[M, N]) -> f16[M, N] {\n return r + x @ w\n}"),
 "gemm/batched_bias": (1, "kernel f(x: f16[B, M, K], w: f16[K, N], b: f16[N]) -> f16[B, M, N] {\n return x @ w + b\n}"),
 "gemm/dual_swiglu_one_epilogue": (1, "kernel f(x: f16[M, K], w1: f16[K, N], w3: f16[K, N]) -> f16[M, N] {\n return silu(x @ w1) * (x @ w3)\n}"),
}

DIMS = dict(B=2, H=3, KH=1, G=3, M=17, N=33, D=16, V=37, K=19, F=23, BH=3, C=8, L=13)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_equivalent_forms_fuse_alike(name):
    want, src = VARIANTS[name]
    fn = tiledsl.compile(src)
    assert len(fn.kernels) == want, f"{name}: {[k.template for k in fn.kernels]}\n{fn.explain()}"
    g = torch.Generator().manual_seed(len(name))
    dims = {d: DIMS[d] for d in testing.needed_dims(fn)}
    args = testing.random_inputs(fn, dims, generator=g)
    if "y" in args:  # labels inside the vocabulary
        args["y"] = torch.randint(0, dims["V"], args["y"].shape, generator=g)
    report = testing.check(fn, **args)
    assert report.ok, f"{name}: {report}"


def test_a_gather_of_a_cast_of_f8_keeps_the_cast_first():
    """f8 values are read only by a cast: `gather(cast(x, f32), y)` of f8 x is not rewritten
    to a gather of x (an internal error, an ill-typed take, when the rewrite did not ask)."""
    fn = tiledsl.compile("kernel f(x: f8e4m3[M, V], y: i64[M]) -> f32[M] { return gather(cast(x, f32), y) }")
    assert [k.template for k in fn.kernels] == ["pointwise", "pointwise"]
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(17, 37, generator=g) * 4).to(torch.float8_e4m3fn)
    y = torch.randint(0, 37, (17,), generator=g)
    report = testing.check(fn, x, y)
    assert report.ok, report
    assert torch.equal(fn(x, y), x.float()[torch.arange(17), y])


GATHER_ALONG_ROW = {
    "log_softmax": "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n"
                   " return -gather(x - logsumexp(x, axis=-1, keepdims=true), y)\n}",
    "softmax": "kernel f(x: f32[M, V], y: i64[M]) -> f32[M] {\n return -log(gather(softmax(x, axis=-1), y))\n}",
    "batched_f16": "kernel f(x: f16[B, M, V], y: i32[B, M]) -> f32[B, M] {\n l = cast(x, f32)\n"
                   " return -gather(l - logsumexp(l, axis=2, keepdims=true), y)\n}",
}


@pytest.mark.parametrize("form", sorted(GATHER_ALONG_ROW))
@pytest.mark.parametrize("m, v", [(1, 1), (17, 113), (3, 4099)])
def test_a_gather_along_the_row_of_a_row_value_is_one_row_kernel(form, m, v):
    """`gather(x - lse, y)` selects the element inside the row program: one kernel, and the
    labels keep a gather's meaning (negative from the end, 0 out of range)."""
    fn = tiledsl.compile(GATHER_ALONG_ROW[form])
    assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
    g = torch.Generator().manual_seed(m * v)
    shape = (2, m, v) if form == "batched_f16" else (m, v)
    x = torch.randn(shape, generator=g).to(torch.float16 if form == "batched_f16" else torch.float32)
    y = torch.randint(-v - 2, v + 2, shape[:-1], generator=g)
    y = y.to(torch.int32 if form == "batched_f16" else torch.int64)
    report = testing.check(fn, x, y)
    assert report.ok, report
    if form != "batched_f16":
        assert len(fn.backward.kernels) == 1, fn.backward.explain()
        report = testing.check_grads(fn, x.requires_grad_(), y, generator=g)
        assert report.ok, report
