"""Gathered GEMM operands (issue "The compiler owns its intermediates"): a weight computed
from packed codes, lookup tables and per-block scales at index expressions of its tile is
unpacked in the GEMM's K loop, one kernel, while its ops per element cost at most
`GATHERED_PROLOGUE_BUDGET` of the registry's units; written as the models write it, with
`F.linear`'s [out, in] weight transposed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import ops
from tiledsl.backends.triton import aot
from tiledsl.passes.fusion import profitability

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# QLoRA's NF4 code book (bitsandbytes' `create_normal_map`, as `Linear4bit` dequantizes it)
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]

NF4_LINEAR = """kernel nf4_linear(x: bf16[M, K], qw: u8[N, K2], absmax: f32[N, KB], table: f32[16]) -> bf16[M, N] {
    k = index(x, 1)[:1]
    n = index(absmax, 0)[:, :1]
    code = (cast(qw[n, k // 2], i32) >> (4 * (1 - k % 2))) & 15
    w = table[code] * absmax[n, k // 64]
    return x @ transpose(cast(w, bf16), 0, 1)
}"""


def pack_nf4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte, the first in the high nibble (bitsandbytes' layout)."""
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)


@pytest.mark.parametrize("m, n, k", [(1, 1, 64), (17, 33, 128), (113, 40, 192)])
def test_an_nf4_linear_dequantizes_in_the_k_loop(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    codes = torch.randint(0, 16, (n, k), generator=g)
    absmax = torch.rand(n, k // 64, generator=g) + 0.5
    table = torch.tensor(NF4)
    x = randn(m, k, dtype=torch.bfloat16)
    fn, out = run_checked(NF4_LINEAR, x, pack_nf4(codes), absmax, table)
    assert [kn.template for kn in fn.kernels] == ["matmul"]
    w = (table.double()[codes] * absmax.double().repeat_interleave(64, dim=1)).bfloat16().double()
    want = x.double() @ w.T
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2 ** -7 * want.abs().max().item() + 1e-2)


# gpt-oss's MXFP4 (transformers' `convert_moe_packed_tensors`): two e2m1 codes a byte, the low
# nibble first, a block of 32 values along K sharing an e8m0 exponent
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

MXFP4_LINEAR = """kernel mxfp4_linear(x: bf16[M, K], blocks: u8[N, K2], scales: u8[N, KB], lut: f32[16]) -> bf16[M, N] {
    k = index(x, 1)[:1]
    n = index(scales, 0)[:, :1]
    code = (cast(blocks[n, k // 2], i32) >> (4 * (k % 2))) & 15
    w = lut[code] * exp2(cast(scales[n, k // 32], f32) - 127.0)
    return x @ transpose(cast(w, bf16), 0, 1)
}"""


@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (17, 33, 96), (113, 40, 256)])
def test_an_mxfp4_linear_dequantizes_in_the_k_loop(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    codes = torch.randint(0, 16, (n, k), generator=g)
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(120, 130, (n, k // 32), generator=g).to(torch.uint8)
    lut = torch.tensor(FP4_VALUES)
    x = randn(m, k, dtype=torch.bfloat16)
    fn, out = run_checked(MXFP4_LINEAR, x, blocks, scales, lut)
    assert [kn.template for kn in fn.kernels] == ["matmul"]
    w = torch.ldexp(lut.double()[codes], (scales.long() - 127).repeat_interleave(32, dim=1).double())
    want = x.double() @ w.bfloat16().double().T
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2 ** -7 * want.abs().max().item() + 1e-2)


def test_a_gathered_operand_over_the_unit_budget_is_stored_with_the_reason():
    """Three f64 slow-path calls per element of a gathered weight (48 units, 53 with the
    mask, the lookup and the products) are more than the K loop hides: the weight is a
    kernel of its own, and explain says why in units."""
    fn = tiledsl.compile("""kernel f(x: f32[M, K], q: i32[K, N], t: f32[16]) -> f32[M, N] {
        w = t[q & 15]
        return x @ (sin(w) * cos(w) * tan(w))
    }""")
    assert [kn.template for kn in fn.kernels] == ["pointwise", "matmul"]
    assert fn.explain().split("fusions not made:")[1].strip() == (
        "[fuse-epilogue] refused: mul (line 3) -> matmul (line 3): unpacking it costs 53 units per element "
        "of every tile, more than the 24 a GEMM's K loop hides [rule: profit]")


def test_every_elementwise_op_declares_its_units():
    """Prologue admission, recompute and the spill rules read the registry's units; an
    elementwise op without them would silently cost 1."""
    missing = [k for k, d in ops.OPS.items() if d.category is ops.Category.ELEMENTWISE and d.units is None]
    assert missing == []
    assert ops.units("add") == 1 and ops.units("exp") == 4 and ops.units("sin") == ops.SLOW_PATH_UNITS
    assert profitability.PROLOGUE_BUDGET == 8


def test_a_gathered_operand_may_read_a_parameter_at_the_tiles_index():
    """A code looked up in a table times a per-element parameter (and one along K) is
    unpacked in the K loop too."""
    src = """kernel f(x: f32[M, K], q: i32[K, N], t: f32[16], s: f32[K, N], r: f32[K]) -> f32[M, N] {
        return x @ (t[q & 15] * s * r[:, None])
    }"""
    q = torch.randint(-100, 100, (33, 17), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    x, t, s, r = randn(9, 33), randn(16), randn(33, 17), randn(33)
    fn, out = run_checked(src, x, q, t, s, r)
    assert [kn.template for kn in fn.kernels] == ["matmul"]
    want = x.double() @ (t.double()[q & 15] * s.double() * r.double()[:, None])
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)


MULTI_LORA = """
kernel multi_lora(x: f32[T, K], w: f32[N, K], lora_a: f32[L, R, K], lora_b: f32[L, N, R], indices: i64[T],
                  scaling: f32) -> f32[T, N] {
    base = x @ w.T
    shrunk = sum(x[:, None, :] * lora_a[indices], axis=-1)
    return base + sum(shrunk[:, None, :] * lora_b[indices], axis=-1) * scaling
}
"""


@pytest.mark.parametrize("t", [1, 17, 113])
def test_a_multi_lora_layer_with_per_token_adapters(t):
    # vLLM's multi-LoRA linear (punica's torch reference, bgmv: einsum("bi,boi->bo", inputs,
    # lora_weights[indices])): each token's adapter gathered by its index, shrunk to rank R
    # then expanded and scaled, added to the base projection. vLLM launches the base GEMM, the
    # shrink and the expand: 3, as here (the shrink and the expand are row programs reading
    # each token's adapter rows; the add is the GEMM's epilogue)
    k, n, lanes, r = 64, 48, 3, 8
    x, w = randn(t, k, seed=t), randn(n, k, seed=1)
    a, b = randn(lanes, r, k, seed=2), randn(lanes, n, r, seed=3)
    idx = torch.randint(0, lanes, (t,), generator=torch.Generator().manual_seed(t))
    fn, out = run_checked(MULTI_LORA, x, w, a, b, idx, 0.5)
    ref = x.double() @ w.double().T + torch.einsum(
        "tr,tnr->tn", torch.einsum("tk,trk->tr", x.double(), a.double()[idx]), b.double()[idx]) * 0.5
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert [kk.template for kk in fn.kernels] == ["rows", "rows", "matmul"]


FP8_LINEAR = (EXAMPLES / "fp8_per_token_linear.tdsl").read_text()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `ref_dynamic_per_token_quant`, in f32 as it runs on a GPU: torch divides by a
    scalar there as a product with the scalar's reciprocal (`div_true_kernel_cuda`), as the
    compiled kernels do; one ulp of the scale moves values across e4m3 rounding boundaries."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) * (torch.tensor(1.0) / torch.tensor(448.0))
    return (xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


@pytest.mark.parametrize("t, n, k", [(1, 1, 64), (17, 33, 128), (113, 40, 192)])
def test_a_per_token_fp8_linear_is_vllms_two_kernels(t, n, k):
    """vLLM's dynamic per-token fp8 linear: a row program computes each token's scale and
    stores x / s rounded to e4m3 (the quantizer's ops cost more per element than an f8 dot
    hides, and its e4m3 values are the narrowest of the chain: the prologue stops there); the
    GEMM multiplies e4m3 by e4m3 and scales the f32 accumulator by both scales, hoisted off
    its operands: 2 kernels, vLLM's count."""
    g = torch.Generator().manual_seed(t + n + k)
    x = (torch.randn(t, k, generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    w_scale = torch.rand(n, 1, generator=g) + 0.25
    fn, out = run_checked(FP8_LINEAR, x, w, w_scale)
    assert [kn.template for kn in fn.kernels] == ["rows", "matmul"]
    # the GEMM reads the quantized tokens and their scales, and the weight and its scale as stored
    assert "in:  w.T: f8e4m3[K, N], k0#1: f8e4m3[T, K], k0#0: f32[T, 1], w_scale.T: f32[1, N]" in fn.explain()
    assert ("[fuse-epilogue] refused: cast (line 14) -> cast (line 15): with the ops computing its f32 operand "
            "the prologue would cost 8 units per element, more than the 4 the dot hides: the kernel computing "
            "them stores its f8e4m3 result, the chain's narrowest [rule: profit]") in fn.explain()
    # against the quantization as vLLM computes it (torch._scaled_mm: f32 accumulation, then
    # both scales); the two agree to the output's rounding
    q, s = quantize_per_token(x)
    want = (q.double() @ w.double().T) * s.double() * w_scale.double().T
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6 * want.abs().max().item())


def test_a_per_token_fp8_linear_multiplies_on_fp8_tensor_cores():
    """Both dot operands are e4m3 tensors as stored, loaded by TMA (the weight K-major, as the
    fp8 wgmma reads B): k32 is the f8 wgmma."""
    fn = tiledsl.compile(FP8_LINEAR)
    reports = aot.inspect_program(fn, {"T": 4096, "K": 7168, "N": 4096})
    (gemm,) = [r for r in reports if r.wgmma]
    assert gemm.wgmma[0].endswith("k32") and gemm.spill_bytes == 0 and gemm.tma > 0, gemm


@pytest.mark.parametrize("m, k", [(1, 16), (17, 48), (113, 80)])
def test_an_a_prologue_reads_a_per_row_scale_in_the_k_loop(m, k):
    """A per-row scale another kernel computes is read by the A prologue once a row of the
    tile (a clamp keeps it from being hoisted to the product): one row kernel, one GEMM."""
    src = """kernel f(x: f32[M, K], w: bf16[N, K]) -> f32[M, N] {
        s = sqrt(mean(x * x, axis=-1, keepdims=true))
        return cast(clamp(x / s, -2.0, 2.0), bf16) @ w.T
    }"""
    x, w = randn(m, k, seed=m), randn(40, k, dtype=torch.bfloat16, seed=k)
    fn, out = run_checked(src, x, w)
    assert [kn.template for kn in fn.kernels] == ["rows", "matmul"]
    assert "in:  x: f32[M, K], k0: f32[M, 1], w.T: bf16[K, N]" in fn.explain()
    xd = x.double()
    a = (xd / xd.square().mean(-1, keepdim=True).sqrt()).clamp(-2, 2).bfloat16().double()
    torch.testing.assert_close(out.double(), a @ w.double().T, rtol=1e-5, atol=1e-5)


# DeepSeek-V3's fp8 linear layer (inference/kernel.py's act_quant then fp8_gemm, as vLLM's torch
# reference `native_w8a8_block_matmul` computes it): activations quantized per block of 128
# along K (each block's scale its largest magnitude over 448, e4m3's largest finite value);
# the weight stored e4m3 with a scale per 128 x 128 block; the product summed block by block,
# each block pair's product scaled by both blocks' scales.
#
# Two kernels, DeepSeek's count: a row program over the blocks computes each block's scale and
# stores its e4m3 values; the GEMM multiplies e4m3 by e4m3 on the tensor cores one block of K at
# a time, scales each block's product by its two scales and adds it to the one accumulator.
# (K a multiple of 128: not an example, whose sweep runs every program at K = 19)
FP8_BLOCK_LINEAR = """
kernel fp8_block_linear(x: bf16[M, K], w: f8e4m3[N, K], w_scale: f32[NB, KB]) -> bf16[M, N] {
    xb = reshape(cast(x, f32), [M, K // 128, 128])
    s = max(abs(xb), axis=-1, keepdims=true) / 448.0
    q = cast(clamp(xb / s, -448.0, 448.0), f8e4m3)
    # one product per block of K: [K // 128, M, 128] @ [K // 128, 128, N]
    a = transpose(cast(q, f32), 0, 1)
    b = transpose(reshape(cast(w, f32), [N, K // 128, 128]), 0, 1)
    # each output column's weight block scale, per block of K: [K // 128, 1, N]
    sb = transpose(w_scale[index(w, 0)[:, 0] // 128], 0, 1)[:, None, :]
    return cast(sum((a @ transpose(b, 1, 2)) * transpose(s, 0, 1) * sb, axis=0), bf16)
}
"""


def block_matmul(q, s, w, w_scale):
    """vLLM's `native_w8a8_block_matmul`: each 128-block pair's product scaled by both blocks'
    scales, summed over the blocks of K, in f64."""
    m, k = q.shape
    out = torch.zeros(m, w.shape[0], dtype=torch.float64)
    for i in range(k // 128):
        a, b = q[:, i * 128:(i + 1) * 128].double(), w[:, i * 128:(i + 1) * 128].double()
        sb = w_scale[:, i].double().repeat_interleave(128)[:w.shape[0]]
        out += (a @ b.T) * s[:, i, None].double() * sb
    return out


@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (17, 33, 256), (113, 200, 384), (1, 7, 2048)])
def test_deepseeks_block_fp8_linear_is_its_two_kernels(m, n, k):
    """DeepSeek-V3's act_quant then fp8_gemm: a row program over the 128-blocks stores each
    block's scale and e4m3 values; the GEMM takes one block of K a step, scales each block's
    product by both blocks' scales (hoisted off nothing: they vary along K) and sums them in one
    accumulator (a batch sum whose elements are scaled, `GemmPlan.batch_scales`)."""
    g = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    w_scale = torch.rand((n + 127) // 128, k // 128, generator=g) + 0.25
    fn, out = run_checked(FP8_BLOCK_LINEAR, x, w, w_scale)
    assert [kn.template for kn in fn.kernels] == ["rows", "matmul"]
    assert "in:  transpose(k0#1): f8e4m3[K // 128, M, 128], transpose(reshape(w, [N, K // 128, 128])).T: " \
        "f8e4m3[K // 128, 128, N], transpose(k0#0): f32[K // 128, M, 1], w_scale: f32[NB, KB]" in fn.explain()
    assert "structure: each summed batch element's product scaled (mul (line 11), mul (line 11)) before the " \
        "accumulator adds it" in fn.explain()
    blocks = x.float().reshape(m, k // 128, 128)
    s = blocks.abs().amax(-1) * (torch.tensor(1.0) / torch.tensor(448.0))  # as a GPU divides by 448
    q = (blocks / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(m, k)
    want = block_matmul(q, s, w, w_scale)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6 * want.abs().max().item())
    if k == 2048:  # one output tile: split K, each split summing its blocks' scaled products
        (gemm,) = [launch for launch in fn.launches if launch.kernel.fn_name == "k1_matmul"]
        assert gemm.kernel.launch_config(dict(gemm.dims), "interpreter").constexprs["SPLITS"] > 1


def test_deepseeks_block_fp8_linear_multiplies_e4m3_blocks_on_tensor_cores():
    """One 128-block of K a step (the block's product scaled as DeepSeek's kernel scales it),
    both operands e4m3 loaded by TMA: the f8 wgmma (k32), no spills."""
    fn = tiledsl.compile(FP8_BLOCK_LINEAR)
    reports = aot.inspect_program(fn, {"M": 4096, "K": 7168, "N": 4096, "NB": 32, "KB": 56})
    (gemm,) = [r for r in reports if r.wgmma]
    assert gemm.config["BLOCK_K"] == 128 and gemm.wgmma[0].endswith("k32"), gemm
    assert gemm.spill_bytes == 0 and gemm.tma > 0, gemm
