"""A persistent GEMM C = A B^T, after the design of Triton's tutorial 09-persistent-matmul.py
(its device-side tensor-descriptor variant), written for these benchmarks.

One program per SM walks the output tiles (grouped along M by GROUP_M, so programs running
together share B tiles in L2); A [M, K] and B [N, K] tiles come by TMA descriptors (made on
the device; a ragged K arrives as zeros), both K-major as Hopper's fp8 wgmma wants them, and
the f32 accumulator is scaled per row of A and per column of B when SCALED (the fp8 GEMM's
dequantization), then stored through masked pointers (a descriptor would need 16-byte
aligned output rows). The tile loop and the K loop are nested (the tutorial flattens them
into one loop, which would put the epilogue inside the loop the static profile reads).
Configurations from the tutorial's autotuning space: 128x256x64 for f16, 128x256x128 for
fp8 e4m3, 8 warps, 3 stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sm90 import Build, launch

CONFIGS = {torch.float16: {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64},
           torch.float8_e4m3fn: {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128}}
GROUP_M, WARPS, STAGES = 8, 8, 3
SMS = 132  # an H100 SXM's, for the static builds


@triton.jit
def _matmul_persistent(A, B, C, ROW_SCALE, COL_SCALE, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_SMS: tl.constexpr, SCALED: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    in_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        first_m = tile // in_group * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        start_m = (first_m + tile % group_m) * BLOCK_M
        start_n = (tile % in_group) // group_m * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([start_m, ki * BLOCK_K])
            b = b_desc.load([start_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if SCALED:
            acc = acc * tl.load(ROW_SCALE + offs_m, mask=offs_m < M, other=0.0)[:, None]
            acc = acc * tl.load(COL_SCALE + offs_n, mask=offs_n < N, other=0.0)[None, :]
        tl.store(C + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(C.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, row_scale: torch.Tensor | None = None,
           col_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T (times row_scale [M] and col_scale [N] when given), contiguous
    f16 or fp8 e4m3 operands; the result in out_dtype (default a's; bf16 for fp8)."""
    M, K = a.shape
    N = b.shape[0]
    assert b.shape[1] == K and a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
    assert K * a.element_size() % 16 == 0, "TMA needs 16-byte aligned rows"
    cfg = CONFIGS[a.dtype]
    c = torch.empty((M, N), dtype=out_dtype or (torch.bfloat16 if a.dtype != torch.float16 else a.dtype),
                    device=a.device)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    programs = min(sms, tiles)
    scaled = row_scale is not None
    launch(_matmul_persistent, (programs,), a, b, c, row_scale if scaled else c, col_scale if scaled else c,
           M, N, K, **cfg, GROUP_M=GROUP_M, NUM_SMS=programs, SCALED=scaled, num_warps=WARPS,
           num_stages=STAGES)
    return c


def sm90_build(M: int, N: int, K: int, dtype: torch.dtype) -> Build:
    """The GEMM at M x N x K (fp8: with the row and column scales and a bf16 result)."""
    cfg = CONFIGS[dtype]
    scaled = dtype != torch.float16
    out = torch.bfloat16 if scaled else dtype
    return Build("matmul_persistent" + ("_fp8" if scaled else ""), "gemm", _matmul_persistent,
                 {"A": dtype, "B": dtype, "C": out, "ROW_SCALE": torch.float32, "COL_SCALE": torch.float32,
                  "M": M, "N": N, "K": K},
                 {**cfg, "GROUP_M": GROUP_M, "NUM_SMS": SMS, "SCALED": scaled}, WARPS, STAGES,
                 cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["BLOCK_K"], "mac")
