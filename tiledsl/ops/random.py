"""Random numbers that depend only on a seed and an element's position.

`random(position, seed)` is Triton's Philox generator (`tl.randint4x`: 32-bit
counters, 10 rounds) at an i64 position: the uniform is `tl.rand`'s, the normal
is Box-Muller of the first two words computed in f64 and rounded once. The
reference backend runs the same generator in torch, bit for bit, so a program's
random values are the same on every backend and in every kernel that computes
them: a backward regenerates its forward's dropout mask instead of storing it.
Sema's `rand(x, seed)`, `randn(x, seed)` and `dropout(x, p, seed)` build it at
the flat (row-major) position of each element of x.
"""

from __future__ import annotations

import math

import torch

from tiledsl import diagnostics as diag
from tiledsl.types import DType, TensorType

from .core import Category, Reads, RuleError, define

_M32 = 0xFFFFFFFF
# Triton's Philox-4x32 constants (triton/language/random.py)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # tl.rand's: the largest s with (2^31 - 1) * s < 1 in f32


def philox(seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two words of Philox-4x32 at counters (position lo, position hi, 0, 0) and key
    (seed lo, seed hi), as int64 tensors holding uint32 values. Products of two uint32
    wrap in int64 with their bit pattern intact, so `>> 32 & M32` is their high word."""
    seed = int(seed)
    position = position.to(torch.int64)
    c0, c1 = position & _M32, (position >> 32) & _M32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        b, a = _ROUND_B * c2, _ROUND_A * c0
        c0, c2 = ((b >> 32) & _M32) ^ c1 ^ k0, ((a >> 32) & _M32) ^ c3 ^ k1
        c1, c3 = b & _M32, a & _M32
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1


def _uniform(word: torch.Tensor) -> torch.Tensor:
    """tl.rand's [0, 1) float of a uint32 word: its int32 bits, folded to >= 0, scaled."""
    signed = torch.where(word >= 2**31, word - 2**32, word)
    folded = torch.where(signed < 0, -signed - 1, signed)
    return folded.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def _reference(position, seed, dist):
    w0, w1 = philox(seed, position)
    if dist == "uniform":
        return _uniform(w0)
    u1 = torch.clamp(_uniform(w0), min=1.0e-7).double()
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * _uniform(w1).double())).float()


def _infer(types, attrs):
    position, seed = types
    if position.dtype not in (DType.I32, DType.I64):
        raise RuleError(diag.DTypeError, (0,), message="a random position is an integer")
    if seed.rank != 0 or seed.dtype not in (DType.I32, DType.I64):
        raise RuleError(diag.DTypeError, (1,), message=(
            f"a seed is an integer scalar (an i32 or i64 parameter, or a literal), got {seed}"))
    return TensorType(DType.F32, position.shape, position.weak)


def _fold(position, seed, dist):
    return _reference(torch.tensor(position), torch.tensor(seed), dist).item()


# sema's rand, randn and dropout build it; its operands are integers, so it passes no
# gradient back
define("random", 2, Category.ELEMENTWISE, _infer, reads=Reads.OPERAND, fold=_fold, reference=_reference,
       units=8, vjp=lambda d, wanted: (None, None))  # Philox's rounds
