"""Two-matmul chains with any score function: `f(q @ k.T) @ v` with no softmax, one kernel.

Causal linear attention, retention's decay mask built from `index()`, a normaliser
`sum(f(s), -1)` kept beside the product, the intra-chunk part of Mamba-2's chunked
scan `(C @ B.T * L) @ X` with `L` from cumulative sums of a gate: each is one
`attention` kernel (the scores never stored), checked against the float64 oracle
at awkward sizes and compiled for sm_90 (helpers.run_checked). An MLP's two GEMMs
(a rank-2 weight on the right) stay two kernels.
"""

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing

TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}

LINEAR = """
kernel linear_attention(q: {dt}[B, H, M, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D]) -> {dt}[B, H, M, D] {{
    s = q @ k.T
    s = where(causal(s), s, 0.0)
    return s @ v
}}"""

RETENTION = """
kernel retention(q: {dt}[B, H, M, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D], gamma: f32) -> {dt}[B, H, M, D] {{
    s = q @ k.T * rsqrt(D)
    i = index(s, -2)
    j = index(s, -1)
    decay = where(i >= j, gamma ** cast(i - j, f32), 0.0)
    return cast(s * decay, {dt}) @ v
}}"""

NORMALISED = """
kernel normalised_linear_attention(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, E]) -> f32[B, H, M, E] {
    s = q @ k.T
    s = where(causal(s), s, 0.0)
    z = sum(s, axis=-1, keepdims=true)
    return (s @ v) / (z + 1e-3)
}"""

MAMBA2 = """
kernel ssd_intra_chunk(c: f32[B, H, T, S], b: f32[B, H, T, S], x: f32[B, H, T, P], a: f32[B, H, T]) -> f32[B, H, T, P] {
    cs = cumsum(a, axis=-1)
    s = c @ b.T
    decay = where(causal(s), exp(cs[..., :, None] - cs[..., None, :]), 0.0)
    return (s * decay) @ x
}"""


def templates(fn: tiledsl.Program) -> list[str]:
    return [k.template for k in fn.kernels]


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("m, n, d", [(1, 17, 16), (17, 17, 32), (113, 113, 64), (113, 203, 59)])
def test_causal_linear_attention(dt, m, n, d):
    fn = tiledsl.compile(LINEAR.format(dt=dt))
    assert templates(fn) == ["attention"]
    q, k, v = (randn(2, 3, r, d, dtype=TORCH[dt], scale=0.3) for r in (m, n, n))
    run_checked(fn, q, k, v)


@pytest.mark.parametrize("dt", ["f16", "f32"])
@pytest.mark.parametrize("m, d", [(1, 16), (113, 32), (200, 64)])
def test_retention(dt, m, d):
    fn = tiledsl.compile(RETENTION.format(dt=dt))
    assert templates(fn) == ["attention"]
    q, k, v = (randn(2, 2, m, d, dtype=TORCH[dt]) for _ in range(3))
    run_checked(fn, q, k, v, gamma=0.96875)


@pytest.mark.parametrize("m, d, e", [(1, 16, 16), (17, 32, 24), (113, 64, 80)])
def test_normaliser_is_a_side_sum(m, d, e):
    fn = tiledsl.compile(NORMALISED)
    assert templates(fn) == ["attention"]
    q = randn(2, 2, m, d).abs()
    k = randn(2, 2, m, d).abs()
    run_checked(fn, q, k, randn(2, 2, m, e))


@pytest.mark.parametrize("t", [1, 17, 64, 113])
def test_mamba2_intra_chunk(t):
    fn = tiledsl.compile(MAMBA2)
    # the cumulative sum of the gate is its own (scan) kernel, read at the score tile
    assert templates(fn) == ["rows", "attention"]
    a = -torch.rand(2, 3, t, generator=torch.Generator().manual_seed(t)) * 0.5
    run_checked(fn, randn(2, 3, t, 16), randn(2, 3, t, 16), randn(2, 3, t, 32), a)


def test_returned_sum_and_output():
    fn = tiledsl.compile("""
kernel f(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]) -> (f32[B, M, D], f32[B, M]) {
    s = exp(q @ k.T * 0.125)
    return s @ v, sum(s, axis=-1)
}""")
    assert templates(fn) == ["attention"]
    run_checked(fn, randn(3, 113, 32), randn(3, 75, 32), randn(3, 75, 32))


def test_mlp_with_weights_stays_two_gemms():
    fn = tiledsl.compile("""
kernel mlp(x: f16[M, K], w1: f16[K, F], w2: f16[F, N]) -> f16[M, N] {
    return relu(x @ w1) @ w2
}""")
    assert templates(fn) == ["matmul", "matmul"]
    run_checked(fn, randn(17, 64, dtype=torch.float16), randn(64, 96, dtype=torch.float16),
                randn(96, 40, dtype=torch.float16))


def test_returned_scores_are_stored_per_tile():
    """Scores returned too are refused by fuse-attention (its kernel never holds them whole);
    the walk over the keys that stores each tile and sums its product takes them."""
    fn = tiledsl.compile("""
kernel f(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]) -> (f32[B, M, D], f32[B, M, N]) {
    s = relu(q @ k.T)
    return s @ v, s
}""")
    assert templates(fn) == ["attention_backward"]
    assert "the scores are also used by return (line 4), which needs them whole" in fn.explain()
    run_checked(fn, randn(2, 113, 32), randn(2, 75, 32), randn(2, 75, 32))


@pytest.mark.parametrize("window", [None, 5])
def test_key_blocks_past_the_mask_are_skipped(window):
    """Small blocks, so that the walk has blocks past the bound (skipped), blocks inside it
    for every row (no mask evaluated) and blocks the mask cuts (a window's start too)."""
    mask = "causal(s)" if window is None else f"causal(s) & (index(s, -1) > index(s, -2) - {window})"
    fn = tiledsl.compile(f"""
@tile(BLOCK_M=16, BLOCK_N=16)
kernel f(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]) -> f32[B, M, D] {{
    s = q @ k.T
    return where({mask}, s, 0.0) @ v
}}""")
    assert templates(fn) == ["attention"]
    (kernel,) = fn.kernels
    assert "n_full" in kernel.source
    run_checked(fn, randn(2, 113, 32), randn(2, 113, 32), randn(2, 113, 32))


@pytest.mark.parametrize("summed, skips", [("where(causal(s), s, 0.0)", True), ("s", False)])
def test_softmax_attention_with_a_sum_over_the_keys(summed, skips):
    """A sum of the scores beside the online softmax: the key blocks past the causal bound
    are skipped only when what is summed is 0 there."""
    fn = tiledsl.compile(f"""
@tile(BLOCK_M=16, BLOCK_N=16)
kernel f(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]) -> (f32[B, M, D], f32[B, M]) {{
    s = q @ k.T * 0.125
    p = softmax(where(causal(s), s, -inf))
    return p @ v, sum({summed}, axis=-1)
}}""")
    assert templates(fn) == ["attention"]
    assert ("key blocks past the mask's bound are skipped" in fn.explain()) == skips
    run_checked(fn, randn(2, 113, 32), randn(2, 77, 32), randn(2, 77, 32))


def grads_ok(fn, *args):
    report = testing.check_grads(fn, *args, generator=torch.Generator().manual_seed(0))
    assert report.ok, f"{fn.name}: {report}"


@pytest.mark.parametrize("src, extra, backward", [
    (LINEAR.format(dt="f32"), (), ["attention_backward"] * 2),
    (RETENTION.format(dt="f32"), (0.96875,), ["attention_backward"] * 2),
    # the normaliser's gradient is a row value: one row program along E computes it and
    # scales g by the normaliser read per row (the broadcast join)
    (NORMALISED, (), ["rows", "attention_backward", "attention_backward"]),
], ids=["linear", "retention", "normalised"])
@pytest.mark.parametrize("m", [1, 17, 113])
def test_derived_backward_recomputes_the_scores(src, extra, backward, m):
    """The training forward is the one chain kernel (nothing [M, N] saved); the backward
    recomputes the score tiles in FlashAttention-2's two walks."""
    fn = tiledsl.compile(src)
    training = fn.training(fn.differentiable)
    d = training.derivation
    assert templates(training.forward) == ["attention"]
    saved = d.forward.returns[d.n_outputs:d.n_outputs + len(d.saved)]
    assert all(t.shape[-2:] != ("M", "N") for t in saved)  # rows (a normaliser) at most
    assert templates(training.backward) == backward
    q, k = randn(1, 2, m, 16).abs(), randn(1, 2, m, 16).abs()
    grads_ok(fn, q, k, randn(1, 2, m, 24 if "E]" in src else 16), *extra)
