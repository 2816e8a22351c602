"""canonicalize: fold constants and remove ops that do nothing.

Before: the graph as sema built it, e.g. `neg(const inf)`, `x * 1`,
`cast(x, f32)` of an f32 `x`, `transpose(transpose(x))`.
After: constant scalar expressions are single `const` nodes (Python-scalar
semantics: computed in double precision, rounded to the result dtype);
`x * 1`, `1 * x`, `x + 0`, `0 + x`, `x - 0`, `x / 1`, `--x`, casts to the same
type (but not a cast to f16/bf16 of a computed value, which rounds it) and
double transposes are replaced by `x` when that leaves every type unchanged.
(A reduction over several axes stays one op per axis, as sema writes it: a row
program reduces them as one, `fuse-rows`.)
Results that are NaN or that Python cannot compute (`log(0)`) are left for
run time.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph, Op
from tiledsl.ops import Reads
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import Pattern, Rewriter, apply_patterns
from tiledsl.types import DType, TensorType, result_dtype


def _round(value: float | int | bool, dtype: DType) -> float | int | bool:
    """`value` as the nearest value of `dtype` (f16/bf16 rounding, i32 wrap-around)."""
    if dtype is DType.BOOL:
        return bool(value)
    if dtype.is_int:  # wrap around
        lo, hi = dtype.int_range
        return (int(value) - lo) % (hi - lo + 1) + lo
    v = float(value)
    if dtype is DType.F32 or not math.isfinite(v):
        return v
    if dtype is DType.F16:
        try:
            return struct.unpack("<e", struct.pack("<e", v))[0]
        except OverflowError:
            return math.copysign(math.inf, v)
    # bf16: round-to-nearest-even on the top 16 bits of the f32 encoding
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _as_python(dtype: DType) -> DType:
    """Weak values are Python scalars: floats stay doubles (F32 here means "a Python
    float", which `_round` leaves as it is); only an explicit cast rounds to f16/bf16."""
    return DType.F32 if dtype.is_float else dtype


def _read_as(op: Op, types: tuple[TensorType, ...]) -> tuple[DType | None, ...]:
    """The dtype the op reads each operand in (None: as it is), as its `Reads` says."""
    reads = ops.OPS[op.kind].reads
    if reads is Reads.COMPARE:
        return (_as_python(result_dtype(types)),) * len(types)
    if reads is Reads.SELECT:
        return (None,) + (_as_python(op.dtype),) * (len(types) - 1)
    if reads is Reads.OPERAND:
        return (None,) * len(types)
    return (_as_python(op.dtype),) * len(types)


def const_value(graph: Graph, node: int):
    op = graph.op(node)
    return op.attr("value") if isinstance(op, Op) and op.kind == "const" else None


class FoldConstants(Pattern):
    """An elementwise op of constants becomes one constant."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        fold = ops.OPS[op.kind].fold
        operands = graph.operands(node)
        if fold is None or not operands or op.shape or not op.weak:
            return False
        values = [const_value(graph, n) for n in operands]
        if any(v is None for v in values):
            return False
        types = tuple(graph.op(n).type for n in operands)
        args = [v if dtype is None else _round(v, dtype)
                for v, dtype in zip(values, _read_as(op, types), strict=True)]
        try:
            value = fold(*args, **op.attr_map)
        except (ArithmeticError, ValueError, TypeError):
            return False
        if isinstance(value, float) and math.isnan(value):
            return False
        value = _round(value, op.dtype if op.kind == "cast" else _as_python(op.dtype))
        rewriter.replace(node, rewriter.build.const(value, op.dtype, op.span))
        return True


_IDENTITY = {"mul": (1, True), "add": (0, True), "sub": (0, False), "div": (1, False)}


class RemoveIdentity(Pattern):
    """`x * 1`, `x + 0`, `x - 0`, `x / 1` (and the commuted forms) become `x`."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in _IDENTITY:
            return False
        unit, commutes = _IDENTITY[op.kind]
        lhs, rhs = graph.operands(node)
        candidates = [(lhs, rhs)] + ([(rhs, lhs)] if commutes else [])
        for keep, other in candidates:
            v = const_value(graph, other)
            if v is not None and not isinstance(v, bool) and v == unit \
                    and graph.op(keep).type == op.type:
                rewriter.replace(node, keep)
                return True
        return False


class RemoveNoOpCast(Pattern):
    """A cast to the type a value already has is the value, except a cast to f16/bf16 of a
    computed value: kernels hold those in f32, and an explicit cast is where they round
    (design section 5), so `cast(a * b, bf16)` of a bf16 product stays."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "cast":
            return False
        (x,) = graph.operands(node)
        x_op = graph.op(x)
        if x_op.type != op.type:
            return False
        if op.dtype in (DType.F16, DType.BF16) and not (isinstance(x_op, Op) and x_op.kind == "param"):
            return False
        rewriter.replace(node, x)
        return True


class CancelInvolution(Pattern):
    """`--x` and `transpose(transpose(x, a, b), a, b)` are `x`."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in ("neg", "transpose"):
            return False
        (inner,) = graph.operands(node)
        inner_op = graph.op(inner)
        if not isinstance(inner_op, Op) or inner_op.kind != op.kind or inner_op.attrs != op.attrs:
            return False
        (x,) = graph.operands(inner)
        if graph.op(x).type != op.type:
            return False
        rewriter.replace(node, x)
        return True


PATTERNS = (FoldConstants(), RemoveIdentity(), RemoveNoOpCast(), CancelInvolution())


@register
@dataclass(frozen=True)
class Canonicalize(Pass):
    name = "canonicalize"
    max_iterations: int = 10

    def run(self, graph: Graph, ctx: PassContext) -> None:
        apply_patterns(graph, PATTERNS, self.max_iterations)
