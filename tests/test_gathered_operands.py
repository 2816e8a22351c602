"""Gathered GEMM operands (issue "The compiler owns its intermediates"): a weight computed
from packed codes, lookup tables and per-block scales at index expressions of its tile is
unpacked in the GEMM's K loop, one kernel, while its ops per element cost at most
`GATHERED_PROLOGUE_BUDGET` of the registry's units; written as the models write it, with
`F.linear`'s [out, in] weight transposed."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import ops
from tiledsl.passes.fusion import profitability

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
    assert profitability.PROLOGUE_UNITS == 1


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
