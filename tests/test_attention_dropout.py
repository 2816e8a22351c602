"""Attention with dropout on the probabilities (fuse-attention's probability modification):
one forward kernel, against the float64 reference (which draws the same Philox numbers) on
awkward shapes; determinism; gradients by the oracle; sm_90 builds without spills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "attention_dropout.tdsl"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def program(dt: str, causal: bool = False, rate: str = "0.1") -> tiledsl.Program:
    mask = "s = where(causal(s), s, -inf)" if causal else ""
    return tiledsl.compile(f"""
    kernel attn(q: {dt}[B, H, M, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D], seed: i64) -> {dt}[B, H, M, D] {{
        s = q @ k.T * rsqrt(D)
        {mask}
        return dropout(softmax(s, axis=-1), {rate}, seed) @ v
    }}""")


def qkv(b, h, m, n, d, dt, seed=0):
    t = DTYPES[dt]
    return (randn(b, h, m, d, dtype=t, seed=seed), randn(b, h, n, d, dtype=t, seed=seed + 1),
            randn(b, h, n, d, dtype=t, seed=seed + 2))


@pytest.mark.parametrize("dt, causal", [("f16", False), ("bf16", True), ("f32", True)])
@pytest.mark.parametrize("b, h, m, n, d", [(1, 1, 1, 1, 16), (2, 3, 17, 33, 16), (1, 2, 113, 65, 32)])
def test_dropout_attention_is_one_kernel_matching_the_reference(dt, causal, b, h, m, n, d):
    fn = program(dt, causal)
    _, out = run_checked(fn, *qkv(b, h, m, n, d, dt), 1234)
    assert [k.template for k in fn.kernels] == ["attention"]
    assert torch.isfinite(out).all()


def test_the_example_drops_a_tenth_of_the_probabilities_and_is_deterministic():
    """The output is p @ v with p's kept entries scaled by 1 / 0.9: with v the identity (one
    value per key) the output is the dropped probabilities themselves."""
    fn = tiledsl.compile(EXAMPLE)
    q, k, _ = qkv(2, 4, 64, 96, 96, "f16")
    v = torch.eye(96, dtype=torch.float16).expand(2, 4, 96, 96)
    out = fn(q, k, v, 7)
    assert torch.equal(out, fn(q, k, v, 7))
    assert not torch.equal(out, fn(q, k, v, 8))
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - 0.1) < 0.01  # 49,152 Bernoulli(0.1) draws: sd 0.0014
    p = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / 96 ** 0.5, -1)
    kept = out != 0
    assert torch.allclose(out[kept].float(), p[kept] / 0.9, rtol=2e-2, atol=1e-4)


def test_a_zero_rate_is_attention():
    q, k, v = qkv(2, 3, 17, 33, 16, "f32")
    plain = tiledsl.compile("""
    kernel attn(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D]) -> f32[B, H, M, D] {
        return softmax(q @ k.T * rsqrt(D), axis=-1) @ v
    }""")
    assert torch.allclose(program("f32", rate="0.0")(q, k, v, 3), plain(q, k, v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dt", ["f16", "f32"])
def test_gradients_regenerate_the_mask(dt):
    fn = program(dt, causal=True)
    report = testing.check_grads(fn, *qkv(2, 2, 17, 33, 16, dt), 99, generator=gen(0))
    assert report.ok, report
    # FlashAttention-2's backward with the mask drawn again from the seed: the training
    # forward stores its output and the logsumexp, nothing [M, N]
    training = fn.training(fn.differentiable)
    assert [k.template for k in training.forward.kernels] == ["attention"]
    assert [k.template for k in training.backward.kernels] == ["rows", "attention_backward", "attention_backward"]
    assert all(any(op.kind == "random" for op in k.ops) for k in training.backward.kernels[1:])


@pytest.mark.parametrize("d", [64, 128])
def test_dropout_attention_backward_compiles_for_sm90_without_spills(d):
    fn = tiledsl.compile(EXAMPLE).backward
    dims = {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d}
    reports = aot.inspect_program(fn, dims, {"seed": 3})
    assert len(reports) == 3 and all(r.spill_bytes == 0 for r in reports)


def test_a_mask_after_the_softmax_is_a_probability_modification():
    """where(keep, p, 0) (probabilities zeroed, not renormalised) joins the kernel too."""
    src = """
    kernel attn(q: f32[M, D], k: f32[N, D], v: f32[N, D], keep: bool[M, N]) -> f32[M, D] {
        return where(keep, softmax(q @ k.T), 0.0) @ v
    }"""
    q, k, v = randn(17, 16), randn(33, 16, seed=1), randn(33, 16, seed=2)
    keep = torch.rand(17, 33, generator=gen(3)) > 0.3
    fn, out = run_checked(src, q, k, v, keep)
    assert [kk.template for kk in fn.kernels] == ["attention"]
    assert torch.allclose(out, torch.where(keep, torch.softmax(q @ k.T, -1), 0.0) @ v, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128])
def test_dropout_attention_compiles_for_sm90_without_spills(d):
    fn = tiledsl.compile(EXAMPLE)
    (r,) = aot.inspect_program(fn, {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d}, {"seed": 3})
    assert r.spill_bytes == 0 and "m64n64k16" in r.wgmma
    # and every autotune candidate: tiles of 128 keys, whose mask draws spill, are left out
    every = aot.inspect_program(fn, {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d}, {"seed": 3},
                                every_candidate=True)
    assert len(every) > 1 and all(c.spill_bytes == 0 and c.config["BLOCK_N"] <= 64 for c in every), every


@pytest.mark.parametrize("rate", ["p", "0.25"])
def test_returned_dropped_weights_are_the_ones_p_at_v_multiplies(rate):
    """Hugging Face's eager attention in training returns `w = dropout(softmax(...))` beside
    `w @ v`: the second walk over the keys that stores w applies the dropout too (it stored
    the plain softmax, and p @ v multiplied it: no element dropped)."""
    scalar = ", p: f32" if rate == "p" else ""
    fn = tiledsl.compile(f"""
    kernel attn(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], mask: f32[B, 1, M, N]{scalar},
                seed: i64) -> (f32[B, H, M, D], f32[B, H, M, N]) {{
        w = dropout(softmax(q @ k.T * rsqrt(D) + mask, axis=-1), {rate}, seed)
        return w @ v, w
    }}""")
    q, k, v = qkv(1, 2, 37, 53, 32, "f32", seed=5)
    mask = randn(1, 1, 37, 53, dtype=torch.float32, seed=8)
    args = (q, k, v, mask, *((0.25,) if rate == "p" else ()), 11)
    _, (out, w) = run_checked(fn, *args)
    assert [k.template for k in fn.kernels] == ["attention"]
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 32 ** 0.5 + mask.double(), -1)
    kept = w != 0
    assert abs(kept.double().mean().item() - 0.75) < 0.03  # 3,922 Bernoulli(0.75) draws: sd 0.007
    assert (w.double() - p / 0.75)[kept].abs().max().item() < 1e-6
    assert (out.double() - w.double() @ v.double()).abs().max().item() < 1e-5
    report = testing.check_grads(fn, *args, generator=gen(0))
    assert report.ok, report
