"""Row softmax after the design of Triton's tutorial 02-fused-softmax.py, written for these
benchmarks: a whole row in one block (BLOCK = the row length's next power of two), each
program looping over rows num_programs apart (software-pipelined by num_stages), one read
and one write per element. The rows are scaled by 1/temperature on load, as
examples/softmax.tdsl does. The tutorial's 8 warps and, for an H100's shared memory,
4 stages, fewer where the stages' row buffers (one less than the stages) would not fit a
block's shared memory (the tutorial's rows are shorter); on a GPU, a grid of 4 programs per
SM (the tutorial sizes it from the kernel's occupancy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sm90 import Build, launch

WARPS = 8
SHARED_LIMIT = 232448  # an H100's shared memory per block


def stages(block: int, dtype: torch.dtype) -> int:
    """The most stages, up to the tutorial's 4, whose row buffers fit a block's shared memory."""
    return max(s for s in (1, 2, 3, 4) if (s - 1) * block * dtype.itemsize < SHARED_LIMIT)


@triton.jit
def _softmax(OUT, X, n_rows, n_cols, inv_temperature, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=STAGES):
        base = tl.cast(row, tl.int64) * n_cols
        x = tl.load(X + base + offs, mask=offs < n_cols, other=-float("inf")) * inv_temperature
        x = x - tl.max(x, axis=0)
        num = tl.exp(x)
        tl.store(OUT + base + offs, num / tl.sum(num, axis=0), mask=offs < n_cols)


def softmax(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(x / temperature) along the last dim of a contiguous [M, N] tensor."""
    M, N = x.shape
    assert x.is_contiguous() and temperature > 0
    out = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    block = triton.next_power_of_2(N)
    launch(_softmax, (min(M, 4 * sms),), out, x, M, N, 1.0 / temperature, BLOCK=block,
           STAGES=stages(block, x.dtype), num_warps=WARPS)
    return out


def sm90_build(M: int, N: int, dtype: torch.dtype = torch.float32) -> Build:
    block = triton.next_power_of_2(N)
    n = stages(block, dtype)
    return Build("softmax", "rows", _softmax, {"OUT": dtype, "X": dtype, "n_rows": M, "n_cols": N,
                                               "inv_temperature": 0.5},
                 {"BLOCK": block, "STAGES": n}, WARPS, n, block, "element")
