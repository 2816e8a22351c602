"""The compiled GPU path (skipped without a CUDA device): the same programs on CUDA tensors."""

from pathlib import Path

import pytest
import torch

import tiledsl
from tiledsl import testing

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).parent.parent / "examples"


def cuda_randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).cuda()


def check_cuda(fn, *args, **kwargs):
    outputs = fn(*args, **kwargs)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert all(o.is_cuda for o in outs)
    report = testing.compare(
        tuple(o.cpu() for o in outs) if isinstance(outputs, tuple) else outputs.cpu(),
        fn.reference(*cpu_args, float64=True, **kwargs), fn.reference(*cpu_args, **kwargs))
    assert report.ok, str(report)
    return outputs


@pytest.mark.parametrize("b, h, m, n, d", [(1, 2, 113, 203, 64), (2, 4, 1023, 1024, 128), (1, 1, 1, 239, 80)])
def test_attention_example_on_gpu(b, h, m, n, d):
    fn = tiledsl.compile(EXAMPLES / "attention.tdsl")
    q, k, v = (cuda_randn(b, h, s, d, dtype=torch.float16, seed=i) for i, s in enumerate((m, n, n)))
    check_cuda(fn, q, k, v, scale=d**-0.5)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (113, 77, 17), (1024, 512, 2048)], ids=str)
def test_matmul_on_gpu(mkn, dt):
    m, k, n = mkn
    name = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dt]
    fn = tiledsl.compile(f"kernel f(a: {name}[M, K], b: {name}[K, N]) -> {name}[M, N] {{ return a @ b }}")
    check_cuda(fn, cuda_randn(m, k, dtype=dt), cuda_randn(k, n, dtype=dt, seed=1))


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "matmul_bias_relu", "gemm_multiply_multiply"])
def test_examples_on_gpu(name):
    fn = tiledsl.compile(EXAMPLES / f"{name}.tdsl")
    dims = {"M": 257, "N": 4999, "K": 64}
    inputs = testing.random_inputs(fn, dims, "cuda", torch.Generator().manual_seed(0))
    check_cuda(fn, **inputs)


def test_new_runtime_dims_do_not_recompile():
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[M, N] { return exp(x) * 2 }")
    fn(cuda_randn(17, 113))
    jit = fn.runtime.load(fn.runtime.emitted[0], "cuda")
    before = sum(len(c[0]) for c in jit.device_caches.values())
    fn(cuda_randn(19, 117))  # same block size, same divisibility class
    after = sum(len(c[0]) for c in jit.device_caches.values())
    assert after == before


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n", [(113, 203), (1023, 1024)])
def test_causal_softcap_attention_on_gpu(m, n, dt):
    """bf16: the soft cap's tanh is tanh.approx.f32 (issue 29), within the oracle's bound;
    f16 and f32 the exact form."""
    name = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dt]
    fn = tiledsl.compile((EXAMPLES / "causal_softcap_attention.tdsl").read_text().replace("bf16", name))
    assert [k.template for k in fn.kernels] == ["attention"]
    q, k, v = (cuda_randn(2, 2, s, 128, dtype=dt, seed=i) for i, s in enumerate((m, n, n)))
    check_cuda(fn, q, k, v, scale=128**-0.5, cap=20.0)


def test_cuda_graph_capture_and_replay():
    fn = tiledsl.compile(EXAMPLES / "rmsnorm.tdsl")
    x, w = cuda_randn(17, 4099, dtype=torch.float16), cuda_randn(4099, dtype=torch.float16, seed=1)
    captured = fn.cuda_graph(x, w, 1e-6)
    for seed in (2, 3):
        x2, w2 = (cuda_randn(*t.shape, dtype=torch.float16, seed=seed + i) for i, t in enumerate((x, w)))
        before = torch.cuda.memory_allocated()
        out = captured(x2, w2, 1e-6)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before  # a replay allocates nothing
        assert torch.equal(out, fn(x2, w2, 1e-6))
    with pytest.raises(tiledsl.TileDSLError, match="replays at the sizes it was captured with"):
        captured(cuda_randn(3, 4099, dtype=torch.float16), w, 1e-6)
    with pytest.raises(tiledsl.TileDSLError, match="scalar 'eps' was captured as 1e-06"):
        captured(x, w, 1e-5)


def test_tma_and_pointer_paths_on_gpu():
    """The descriptor path (aligned, unit last stride), the transposed-rows path and the
    pointer path (unaligned) of the GEMM and attention, all against the oracle."""
    fn = tiledsl.compile("kernel f(a: f16[M, K], b: f16[K, N], d: f16[M, N]) -> f16[M, N] { return (a @ b) * d }")
    a, b, d = cuda_randn(300, 256, dtype=torch.float16), cuda_randn(256, 200, dtype=torch.float16, seed=1), \
        cuda_randn(300, 200, dtype=torch.float16, seed=2)
    shifted = cuda_randn(300 * 256 + 1, dtype=torch.float16, seed=3)[1:].view(300, 256)
    for args in ((a, b, d), (shifted, b, d), (a, b.t().contiguous().t(), d)):
        check_cuda(fn, *args)
    attention = tiledsl.compile(EXAMPLES / "attention.tdsl")
    for dim in (64, 59):  # 59: rows of 118 bytes, pointers only
        q, k, v = (cuda_randn(2, 2, s, dim, dtype=torch.float16, seed=i) for i, s in enumerate((300, 520, 520)))
        check_cuda(attention, q, k, v, scale=dim**-0.5)


@pytest.mark.parametrize("dt, n", [(torch.float16, 32768), (torch.float32, 16384), (torch.float32, 20000)])
def test_long_rows_on_gpu(dt, n):
    name = {torch.float16: "f16", torch.float32: "f32"}[dt]
    fn = tiledsl.compile(f"kernel f(x: {name}[M, N]) -> {name}[M, N] {{ return softmax(x * 0.5, axis=-1) }}")
    check_cuda(fn, cuda_randn(17, n, dtype=dt))


@pytest.mark.parametrize("name", ["gemm_multiply_multiply", "matmul_bias_relu"])
def test_every_gemm_candidate_on_gpu(name):
    """Each autotune candidate (wide tiles, the persistent grid) computes the right result,
    not only the one the autotuner picks."""
    import dataclasses

    from tiledsl.backends.triton.launch import KernelStep

    dims = {"M": 1000, "N": 777, "K": 320}
    inputs = testing.random_inputs(tiledsl.compile(EXAMPLES / f"{name}.tdsl"), dims, "cuda",
                                   torch.Generator().manual_seed(0))
    base = tiledsl.compile(EXAMPLES / f"{name}.tdsl")
    (step,) = [s for s in base.runtime.steps if s.emitted.kernel.template == "matmul"]
    candidates = step.emitted.launch_candidates(dims, "cuda")
    assert len(candidates) >= 5 and any(c.persistent for c in candidates)
    for cfg in candidates:
        fn = tiledsl.compile(EXAMPLES / f"{name}.tdsl")
        steps = list(fn.runtime.steps)
        i = next(k for k, s in enumerate(steps) if s.emitted.kernel.template == "matmul")
        only = dataclasses.replace(steps[i].emitted, configure=lambda d, dev, cfg=cfg: cfg,
                                   candidates=None)
        steps[i] = KernelStep(only, steps[i].reads, steps[i].slot)
        fn.runtime.steps = tuple(steps)
        check_cuda(fn, **inputs)


BACKWARD = {  # score modification, extra parameter declaration, its shape
    "causal": ("s = where(causal(s), s, -inf)", "", None),
    "softcap bias causal": ("s = where(causal(s), tanh((s + bias) * 0.05) * 20.0, -inf)",
                            ", bias: {dt}[B, H, M, N]", "full"),
    "alibi causal": ("s = where(causal(s), s + slopes * cast(index(s, -1) - index(s, -2), f32), -inf)",
                     ", slopes: f32[H, 1, 1]", "slopes"),
    "window": ("s = where((index(s, -2) + 64 >= index(s, -1)) & (index(s, -1) + 64 > index(s, -2)), s, -inf)",
               "", None),
}


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", list(BACKWARD))
def test_attention_backward_on_gpu(variant, d, dt):
    # the fused backward (fuse-attention-backward's two kernels, block skipping, atomics for
    # the slopes' gradient) against float64 autograd, at sizes with several blocks
    mod, extra, kind = BACKWARD[variant]
    name = {torch.float16: "f16", torch.bfloat16: "bf16"}[dt]
    fn = tiledsl.compile(f"""
    kernel attn(q: {name}[B, H, M, D], k: {name}[B, H, N, D], v: {name}[B, H, N, D]{extra.format(dt=name)})
            -> {name}[B, H, M, D] {{
        s = q @ k.T * rsqrt(D)
        {mod}
        return softmax(s, axis=-1) @ v
    }}""".replace("\n            ->", " ->"))
    b, h, m, n = 2, 3, 1000, 1023
    args = [cuda_randn(b, h, s, d, dtype=dt, seed=i) for i, s in enumerate((m, n, n))]
    if kind == "full":
        args.append(cuda_randn(b, h, m, n, dtype=dt, seed=7))
    elif kind == "slopes":
        args.append(cuda_randn(h, 1, 1, seed=8) * 0.1)
    report = testing.check_grads(fn, *args, generator=torch.Generator().manual_seed(0))
    assert report.ok, str(report)
    assert [k.template for k in fn.backward.kernels] == ["rows", "attention_backward", "attention_backward"]


def test_gqa_backward_on_gpu():
    fn = tiledsl.compile(EXAMPLES / "gqa_attention.tdsl")
    q = cuda_randn(2, 8, 777, 128, dtype=torch.bfloat16)
    k, v = (cuda_randn(2, 2, 777, 128, dtype=torch.bfloat16, seed=i) for i in (1, 2))
    report = testing.check_grads(fn, q, k, v, generator=torch.Generator().manual_seed(0))
    assert report.ok, str(report)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_hardware_tanh_on_gpu(dt):
    """tanh and gelu(tanh) of bf16 ops through tanh.approx.f32 (f16 ones exact), against
    float64 by the oracle's rule, over inputs from about -9 to 9 (both saturations)."""
    name = {torch.float16: "f16", torch.bfloat16: "bf16"}[dt]
    fn = tiledsl.compile(f"kernel f(x: {name}[M, N]) -> ({name}[M, N], {name}[M, N]) "
                         "{ return tanh(x), gelu(x, approximate=\"tanh\") }")
    assert ("tanh_approx(" in fn.kernels[0].source) is (dt is torch.bfloat16)
    check_cuda(fn, cuda_randn(113, 1031, dtype=torch.float32, seed=3).mul(3).to(dt))


def test_fp8_gemm_with_n_major_b_on_gpu():
    """The fp8 example's b: [K, N] goes K-major through a copy made on every call (nothing
    kept: a write through `b.data` keeps its version, so a kept copy could not tell it
    stale): the result is the oracle's before and after such a write, and with b passed
    K-major (no copy)."""
    fn = tiledsl.compile(EXAMPLES / "gemm_fp8_scaled.tdsl")
    dims = {"M": 257, "N": 384, "K": 512}
    inputs = testing.random_inputs(fn, dims, "cuda", torch.Generator().manual_seed(0))
    name, b = next((k, v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == (512, 384))
    check_cuda(fn, **inputs)
    b.data.copy_(b.float().mul(-0.5).to(b.dtype))  # written without a version bump
    check_cuda(fn, **inputs)
    check_cuda(fn, **(inputs | {name: b.t().contiguous().t()}))


def combines(fn) -> list[str]:
    """The combine launches a program made (split kernels' second launches)."""
    return sorted({launch.kernel.fn_name for launch in fn.launches if launch.kernel.fn_name.endswith("_combine")})


@pytest.mark.parametrize("kv_heads", [32, 8])
def test_split_kv_decode_on_gpu(kv_heads):
    """Decode at one query row against 32k keys splits the keys (flash-decoding): the partials
    merged by their log-sum-exp agree with the float64 reference (GQA too)."""
    fn = tiledsl.compile("""kernel decode(q: f16[B, H, D], k: f16[B, KH, L, D], v: f16[B, KH, L, D]) -> f16[B, H, D] {
        qg = reshape(q, [B, KH, H // KH, 1, D])
        s = qg @ k[:, :, None].T * rsqrt(D)
        return reshape(softmax(s) @ v[:, :, None], [B, H, D])
    }""")
    q = cuda_randn(1, 32, 128, dtype=torch.float16)
    k, v = (cuda_randn(1, kv_heads, 32768, 128, dtype=torch.float16, seed=i) for i in (1, 2))
    check_cuda(fn, q, k, v)
    assert combines(fn) == ["k0_attention_combine"]


def test_split_k_gemm_on_gpu():
    """M = 16 against K = 16384: programs share each tile's K loop, a combine adds them."""
    fn = tiledsl.compile("kernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] { return a @ b }")
    check_cuda(fn, cuda_randn(16, 16384, dtype=torch.float16), cuda_randn(16384, 4096, dtype=torch.float16, seed=1))
    assert combines(fn) == ["k0_combine"]


def test_split_row_programs_on_gpu():
    """A cross-entropy mean over a 32k vocabulary, bf16 LayerNorm's backward (dx with dw and
    db as partials) and clip_grad_norm_'s merged launch of three split sums, each against
    the float64 reference."""
    ce = tiledsl.compile("""kernel ce(x: bf16[M, V], y: i64[M]) -> f32[] {
        xf = cast(x, f32)
        return mean(logsumexp(xf, axis=-1) - sum(where(index(xf, -1) == y[:, None], xf, 0.0), axis=-1))
    }""")
    y = torch.randint(0, 32000, (4096,), generator=torch.Generator().manual_seed(1)).cuda()
    check_cuda(ce, cuda_randn(4096, 32000, dtype=torch.bfloat16), y)
    assert combines(ce) == ["k0_combine"]
    ln = tiledsl.compile("""kernel ln(x: bf16[M, N], w: bf16[N], b: bf16[N]) -> bf16[M, N] {
        xf = cast(x, f32)
        mu = mean(xf, axis=-1, keepdims=true)
        var = mean((xf - mu) * (xf - mu), axis=-1, keepdims=true)
        return cast((xf - mu) * rsqrt(var + 1e-5) * cast(w, f32) + cast(b, f32), bf16)
    }""")
    args = cuda_randn(8192, 4096, dtype=torch.bfloat16), cuda_randn(4096, dtype=torch.bfloat16, seed=1), \
        cuda_randn(4096, dtype=torch.bfloat16, seed=2)
    report = testing.check_grads(ln, *args, generator=torch.Generator().manual_seed(0))
    assert report.ok, str(report)
    assert len(ln.backward.kernels) == 1 and combines(ln.backward) == ["k0_combine"]
    clip = tiledsl.compile("""kernel clip(g1: f32[A, K], g2: f32[K], g3: f32[C, E], max_norm: f32)
            -> (f32[A, K], f32[K], f32[C, E], f32[]) {
        total_norm = sqrt(sum(g1 * g1, axis=None) + sum(g2 * g2, axis=None) + sum(g3 * g3, axis=None))
        clip_coef = minimum(max_norm / (total_norm + 1e-6), 1.0)
        return g1 * clip_coef, g2 * clip_coef, g3 * clip_coef, total_norm
    }""")
    check_cuda(clip, cuda_randn(4096, 4096), cuda_randn(4096, seed=1), cuda_randn(11008, 4096, seed=2), 1.0)
    assert combines(clip) == ["k0_1_combine", "k0_2_combine"]
