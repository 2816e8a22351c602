"""Layer norm forward after the design of Triton's tutorial 05-layer-norm.py, written for
these benchmarks: one program per row, three passes over the row in blocks of BLOCK
columns (the mean, the variance, then normalize, scale and shift), f32 statistics.
BLOCK is the row length's next power of two up to 64 KiB of the element type, and
num_warps = BLOCK / 256 between 1 and 8, as the tutorial picks them. (The tutorial also
stores each row's mean and 1/std for its backward; here only y is.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sm90 import Build, launch


@triton.jit
def _layer_norm(X, Y, W, B, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * N
    Y += row * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        acc += tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        x = tl.where(cols < N, x - mean, 0.0)
        acc += x * x
    rstd = 1 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask)
        b = tl.load(B + cols, mask=mask)
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


def config(N: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK, num_warps) of rows of N elements."""
    block = min(65536 // dtype.itemsize, triton.next_power_of_2(N))
    return block, min(max(block // 256, 1), 8)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm of each row of a contiguous [M, N] tensor, scaled by w and shifted by b [N]."""
    M, N = x.shape
    assert x.is_contiguous()
    y = torch.empty_like(x)
    block, warps = config(N, x.dtype)
    launch(_layer_norm, (M,), x, y, w, b, N, eps, BLOCK=block, num_warps=warps)
    return y


def sm90_build(M: int, N: int, dtype: torch.dtype = torch.float16) -> Build:
    block, warps = config(N, dtype)
    return Build("layer_norm", "rows", _layer_norm, {"X": dtype, "Y": dtype, "W": dtype, "B": dtype, "N": N,
                                                     "eps": 1e-5},
                 {"BLOCK": block}, warps, 3, block, "element")
