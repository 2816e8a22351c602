"""Generated kernels compile for H100 (GPUTarget("cuda", 90, 32)) without a GPU.

Every e2e test already compiles each kernel it launches (helpers.run_checked);
this file checks what the compiled code looks like.
"""

import pytest
import torch

import tiledsl
from helpers import compile_for_sm90, randn


def compiled(src: str, *args, **kwargs):
    fn = tiledsl.compile(src)
    fn(*args, **kwargs)
    from tiledsl.backends.triton.aot import compile_launch

    return {launch.kernel.fn_name: compile_launch(launch) for launch in fn.launches}


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_matmul_uses_wgmma(dt):
    torch_dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dt]
    kernels = compiled(f"kernel f(a: {dt}[B, M, K], b: {dt}[K, N]) -> {dt}[B, M, N] {{ return a @ b }}",
                       randn(2, 113, 77, dtype=torch_dt), randn(77, 203, dtype=torch_dt))
    (ck,) = kernels.values()
    assert "wgmma.mma_async" in ck.asm["ptx"]
    assert len(ck.asm["cubin"]) > 0


def test_fp32_matmul_is_ieee_not_tf32():
    kernels = compiled("kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M, N] { return a @ b }",
                       randn(113, 64), randn(64, 64))
    ptx = next(iter(kernels.values())).asm["ptx"]
    assert "tf32" not in ptx and "wgmma" not in ptx


def test_bf16_conversions_are_native_on_the_gpu():
    kernels = compiled("kernel f(x: bf16[M, N]) -> bf16[M, N] { return exp(x) }",
                       randn(17, 113, dtype=torch.bfloat16))
    ptx = next(iter(kernels.values())).asm["ptx"]
    assert "cvt.rn.bf16.f32" in ptx
    assert "0x7fff" not in ptx.lower() and "32767" not in ptx  # no interpreter bit-rounding path


@pytest.mark.parametrize("pipeline", ["canonicalize,cse,dce", None], ids=["unfused", "fused"])
def test_every_template_compiles(pipeline):
    fn = tiledsl.compile("""
    kernel all(x: f16[M, N], w: f16[N, K], b: f32[K]) -> (f16[M, K], f32[M], f16[M, N]) {
        y = x @ w + b
        return y, logsumexp(x), softmax(x, axis=0) * 2.0 - exp(x)
    }""", pipeline=pipeline)
    fn(randn(17, 113, dtype=torch.float16), randn(113, 33, dtype=torch.float16), randn(33))
    results = compile_for_sm90(fn)
    assert {launch.kernel.kernel.template for launch, _ in results} == \
        ({"matmul", "pointwise", "rows"} if pipeline else {"matmul", "merged"})  # rows and pointwise: one launch
    assert all(ck.asm["cubin"] for _, ck in results)
