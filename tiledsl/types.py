"""Dtypes, symbolic shapes, broadcasting and torch's type promotion.

A dim is an `int` (a literal size) or a `str` (a symbol such as "M" bound at
call time). Shapes are tuples of dims and are compared structurally: `M` and
`N` are different dims even if they happen to be bound to equal sizes, and a
literal 1 broadcasts against anything.

Promotion follows `torch.result_type`: dimensioned tensors outrank 0-dim
tensors, which outrank "weak" Python-scalar-like values (literals, dims used
as values, and arithmetic on them); a lower rank only wins when it brings a
higher category (bool < integer < float).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Dim = int | str
Shape = tuple[Dim, ...]

MAX_RANK = 8


class DType(enum.Enum):
    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    I8 = "i8"
    U8 = "u8"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"
    F8E4M3 = "f8e4m3"  # torch.float8_e4m3fn: storage and matmul operands only
    F8E5M2 = "f8e5m2"

    @property
    def is_float(self) -> bool:
        return self in (DType.F16, DType.BF16, DType.F32, DType.F8E4M3, DType.F8E5M2)

    @property
    def is_f8(self) -> bool:
        return self in (DType.F8E4M3, DType.F8E5M2)

    @property
    def is_int(self) -> bool:
        return self in (DType.I8, DType.U8, DType.I16, DType.I32, DType.I64)

    @property
    def category(self) -> int:
        """0 for bool, 1 for integers, 2 for floats."""
        return 2 if self.is_float else (1 if self.is_int else 0)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def int_range(self) -> tuple[int, int]:
        """The smallest and largest value of an integer dtype."""
        return _INT_RANGE[self]

    def __str__(self) -> str:
        return self.value


DTYPES = {d.value: d for d in DType}
PARAM_DTYPES = ("f16", "bf16", "f32", "i8", "u8", "i16", "i32", "i64", "bool", "f8e4m3", "f8e5m2")
_ITEMSIZE = {DType.F16: 2, DType.BF16: 2, DType.F32: 4, DType.I8: 1, DType.U8: 1, DType.I16: 2,
             DType.I32: 4, DType.I64: 8, DType.BOOL: 1, DType.F8E4M3: 1, DType.F8E5M2: 1}
_INT_RANGE = {d: (-(2 ** (8 * _ITEMSIZE[d] - 1)), 2 ** (8 * _ITEMSIZE[d] - 1) - 1)
              for d in (DType.I8, DType.I16, DType.I32, DType.I64)} | {DType.U8: (0, 255)}

# The join of two dtypes (torch.promote_types restricted to ours; f8 values only meet in
# matmuls, whose type rule decides). Integers join by width, except that u8 and i8 meet
# in i16 (the narrowest type holding both).
_ORDER = {DType.BOOL: 0, DType.I8: 1, DType.U8: 1, DType.I16: 2, DType.I32: 3, DType.I64: 4,
          DType.F8E4M3: 5, DType.F8E5M2: 5, DType.F16: 5, DType.BF16: 5, DType.F32: 6}


def promote_types(a: DType, b: DType) -> DType:
    if a is b:
        return a
    if _ORDER[a] == _ORDER[b] == 5:  # two different 16- or 8-bit floats
        return DType.F32
    if _ORDER[a] == _ORDER[b] == 1:  # i8 and u8
        return DType.I16
    return a if _ORDER[a] > _ORDER[b] else b


def _join(dtypes: Iterable[DType]) -> DType | None:
    result = None
    for d in dtypes:
        result = d if result is None else promote_types(result, d)
    return result


def _combine(higher: DType | None, lower: DType | None) -> DType | None:
    # torch's combine_categories: a lower priority class only matters when it
    # brings a higher category.
    if higher is None:
        return lower
    if lower is None or higher.is_float:
        return higher
    if higher is DType.BOOL or lower.is_float:
        return promote_types(higher, lower)
    return higher


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of an IR value. Rank 0 is a scalar; `weak` marks Python-like scalars."""

    dtype: DType
    shape: Shape = ()
    weak: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        base = f"{self.dtype}{format_shape(self.shape)}" if self.shape else str(self.dtype)
        return f"weak {base}" if self.weak else base


def result_dtype(types: Sequence[TensorType]) -> DType:
    """torch.result_type over the operands of an elementwise op."""
    dimensioned = _join(t.dtype for t in types if t.rank > 0)
    zero_dim = _join(t.dtype for t in types if t.rank == 0 and not t.weak)
    weak = _join(t.dtype for t in types if t.weak)
    out = _combine(dimensioned, _combine(zero_dim, weak))
    assert out is not None, "result_dtype of no operands"
    return out


class Compute(enum.Enum):
    """The type a value computes in inside a kernel (the numerics contract, design section 5):
    floats in f32, integers in their own width and signedness (i8, u8, i16, i32, i64: they
    wrap as torch's do), bools in i1; weak values like the Python arithmetic they stand for,
    floats in f64 and integers in i64 (a product of sizes, `M * N`, past 2^31 does not wrap).
    Values round to their dtype only when stored, or cast."""

    F32 = "f32"
    F64 = "f64"
    I8 = "i8"
    U8 = "u8"
    I16 = "i16"
    I32 = "i32"
    I64 = "i64"
    BOOL = "i1"

    @property
    def is_float(self) -> bool:
        return self in (Compute.F32, Compute.F64)

    @property
    def is_int(self) -> bool:
        return not self.is_float and self is not Compute.BOOL


# integers narrower than i32: Triton refuses literals outside their range, where torch wraps
NARROW = (Compute.I8, Compute.U8, Compute.I16)


def compute_type(dtype: DType) -> Compute:
    """The compute type of a stored (non-weak) value of `dtype`."""
    if dtype.is_float:
        return Compute.F32
    return {DType.I8: Compute.I8, DType.U8: Compute.U8, DType.I16: Compute.I16, DType.I32: Compute.I32,
            DType.I64: Compute.I64}.get(dtype, Compute.BOOL)


def value_compute(t: TensorType) -> Compute:
    """The compute type of a value of type `t`: weak floats compute in f64, weak integers
    (literals, dims used as values, arithmetic on them) in i64."""
    if t.weak and t.dtype.is_float:
        return Compute.F64
    if t.weak and t.dtype.is_int:
        return Compute.I64
    return compute_type(t.dtype)


def all_weak(types: Sequence[TensorType]) -> bool:
    return bool(types) and all(t.weak for t in types)


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class BroadcastMismatch(Exception):
    """Raised by `broadcast_shapes`; `dim` counts from the left of the result."""

    def __init__(self, dim: int, a: Dim, b: Dim) -> None:
        super().__init__(dim, a, b)
        self.dim, self.a, self.b = dim, a, b


def broadcast_shapes(*shapes: Shape) -> Shape:
    """NumPy broadcasting on symbolic shapes: equal dims match, a literal 1 stretches."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = [1] * rank
    for shape in shapes:
        offset = rank - len(shape)
        for i, d in enumerate(shape):
            cur = out[offset + i]
            if cur == d or d == 1:
                continue
            if cur == 1:
                out[offset + i] = d
            else:
                raise BroadcastMismatch(offset + i, cur, d)
    return tuple(out)


def broadcasts_to(shape: Shape, target: Shape) -> bool:
    """Does `shape` broadcast to exactly `target` (right-aligned; literal 1s stretch)?"""
    try:
        return broadcast_shapes(shape, target) == tuple(target)
    except BroadcastMismatch:
        return False


def reshape_ends(source: Shape, out: Shape) -> tuple[int, int]:
    """How many axes a reshape of `source` to `out` keeps at its start and at its end (the
    dims both shapes begin and end with); the middle ones are merged or split."""
    lo = 0
    while lo < min(len(out), len(source)) and out[lo] == source[lo]:
        lo += 1
    hi = 0
    while hi < min(len(out), len(source)) - lo and out[-1 - hi] == source[-1 - hi]:
        hi += 1
    return lo, hi


def normalize_axis(axis: int, rank: int) -> int | None:
    """`axis` as a non-negative index, or None when out of range."""
    if -rank <= axis < rank:
        return axis % rank
    return None
