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


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n", [(113, 203), (1023, 1024)])
def test_causal_softcap_attention_on_gpu(m, n, dt):
    name = {torch.bfloat16: "bf16", torch.float32: "f32"}[dt]
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
