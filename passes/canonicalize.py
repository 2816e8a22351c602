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
Equivalent forms become one: a reduction's dropped dim put back is the
reduction keeping it, a transposed product is the product of the transposes,
a gather of a cast is a cast of the gather.
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
from tiledsl.passes.fusion.score_space import swaps_last
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


class KeepReducedDim(Pattern):
    """`r[:, None]` (or a reshape giving back the size-1 dim) of a reduction that dropped its
    axis is the reduction keeping it: `exp(x - max(x, -1)[:, None])` reads the row max as
    `exp(x - max(x, -1, keepdims=true))` does, so the row forms (softmax, norms) are one
    form. The reduction without the dim stays for its other readers (both are one row
    program's). An elementwise op of such values, read only with the dim put back
    (`rsqrt(var + eps)[:, None]`), takes the dim back first."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        at = _inserted_axis(graph, node)
        if at is None:
            return False
        (r,) = graph.operands(node)
        rop = graph.op(r)
        if not isinstance(rop, Op):
            return False
        b = rewriter.build
        if _reduced_along(graph, r, at) == "through":
            edges = [o if graph.result_type(*o).rank == 0 else b.op(op.kind, [o], op.span, **op.attr_map)
                     for o in graph.operand_edges(r)]
            rewriter.replace(node, b.op(rop.kind, edges, rop.span, **rop.attr_map))
            return True
        if _reduced_along(graph, r, at) != "reduction":
            return False
        rewriter.replace(node, b.op(rop.kind, graph.operand_edges(r), rop.span, axis=at, keepdims=True))
        return True


def _reduced_along(graph: Graph, node: int, axis: int, depth: int = 8) -> str | None:
    """"reduction": `node` is a reduction along `axis` that dropped it; "through": an
    elementwise op of values of its shape (and scalars), read by one op, one of them such a
    reduction or in turn such an op; None otherwise. (Other views put back stay: recompute
    moves them to the parameters.)"""
    op = graph.op(node)
    if not isinstance(op, Op):
        return None
    red = ops.OPS[op.kind].reduction if op.kind in ops.OPS else None
    if red is not None:
        return "reduction" if not op.attr("keepdims") and op.attr("axis") == axis else None
    edges = graph.operand_edges(node)
    if depth == 0 or not ops.is_elementwise(op.kind) or op.kind == "take" or len(graph.users(node)) != 1 \
            or any(graph.result_type(*e).shape not in (op.shape, ()) for e in edges):
        return None
    if any(_reduced_along(graph, e[0], axis, depth - 1) for e in edges if e[1] == 0):
        return "through"
    return None


def _inserted_axis(graph: Graph, node: int) -> int | None:
    """Where a view that only inserts one size-1 axis (`x[:, None]`, a reshape to the same
    dims with a 1 among them) puts it; None for any other op."""
    op = graph.op(node)
    if not isinstance(op, Op) or op.kind not in ("slice", "reshape"):
        return None
    (x,) = graph.operand_edges(node)
    shape = graph.result_type(*x).shape
    if len(op.shape) != len(shape) + 1:
        return None
    if op.kind == "slice":
        items = op.attr("items")
        ranges = [it for it in items if it[0] == "range"]
        if len(items) != len(op.shape) or len(ranges) != len(shape) or not all(
                it == ("range", 0, d, 1, d) for it, d in zip(ranges, shape, strict=True)):
            return None
        return items.index(("new",))
    return next((k for k in range(len(op.shape))
                 if op.shape[k] == 1 and op.shape[:k] + op.shape[k + 1:] == shape), None)


class TransposeProduct(Pattern):
    """`(a @ b).T` is `b.T @ a.T`: a product read only transposed is computed in the layout
    it is read in (`(v.T @ p.T).T` is `p @ v`, attention's; `(w @ x.T).T + b` is a GEMM with
    its bias epilogue), the operands' transposes views (a double one cancels)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if not swaps_last(graph, node):
            return False
        (mm,) = graph.operands(node)
        mm_op = graph.op(mm)
        if not isinstance(mm_op, Op) or mm_op.kind != "matmul" or graph.users(mm) != [(node, 0)] \
                or mm_op.type.rank != op.type.rank:
            return False
        b = rewriter.build
        a_t, b_t = (b.op("transpose", [o], op.span, dims=(o_t.rank - 2, o_t.rank - 1))
                    for o, o_t in ((o, b.types([o])[0]) for o in reversed(graph.operand_edges(mm))))
        product = b.op("matmul", [a_t, b_t], mm_op.span)
        if b.types([product])[0] != op.type:
            return False
        rewriter.replace(node, product)
        return True


# unary ops that give 0 at 0: a gather reading 0 past its index range reads them as 0 too
_ZERO_AT_ZERO = frozenset({"cast", "neg", "abs", "relu"})


class GatherBeforeElementwise(Pattern):
    """A gather of an elementwise op of one tensor, `gather(cast(x, f32), y)`, is the op of
    the gather, `cast(gather(x, y), f32)`: kernels load a gathered tensor through its
    indices, so `cast(x)` would otherwise be stored whole for the gather (a cross-entropy's
    second kernel). Only for ops that give 0 at 0, so an index out of range still reads 0."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        x_op = graph.op(x[0])
        if not isinstance(x_op, Op) or x_op.kind not in _ZERO_AT_ZERO:
            return False
        b = rewriter.build
        # a gather of the op's operand must type (not one of f8 values, which only a cast reads)
        if b.type_of("take", [*graph.operand_edges(x[0]), *indices]) is None:
            return False
        gathered = b.op("take", [*graph.operand_edges(x[0]), *indices], op.span)
        rewriter.replace(node, b.op(x_op.kind, [gathered], x_op.span, **x_op.attr_map))
        return True


class RemoveIdentityGather(Pattern):
    """A gather of each element at its own index, `take(x, i0, .., ik)` where `ik` is the
    index along axis k (0 where x has size 1 there), is `x`: a concat's piece re-indexed
    through a slice of a normalised row reads the row's statistic so (`rsqrt(mean(x * x))`
    keeps its one reduction over the whole row)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operands(node)
        x_type = graph.op(x).type
        if x_type != op.type:
            return False
        for k, (i, d) in enumerate(zip(indices, x_type.shape, strict=True)):
            i_op = graph.op(i)
            own = (isinstance(i_op, Op) and i_op.kind == "index" and i_op.attr("axis") == k
                   and i_op.type.rank == x_type.rank and i_op.shape[k] == d)
            if not own and not (d == 1 and const_value(graph, i) == 0):
                return False
        rewriter.replace(node, x)
        return True


PATTERNS = (FoldConstants(), RemoveIdentity(), RemoveNoOpCast(), CancelInvolution(), KeepReducedDim(),
            TransposeProduct(), GatherBeforeElementwise(), RemoveIdentityGather())


@register
@dataclass(frozen=True)
class Canonicalize(Pass):
    name = "canonicalize"
    max_iterations: int = 10

    def run(self, graph: Graph, ctx: PassContext) -> None:
        apply_patterns(graph, PATTERNS, self.max_iterations)
