"""canonicalize: fold constants and remove ops that do nothing.

Before: the graph as sema built it, e.g. `neg(const inf)`, `x * 1`,
`cast(x, f32)` of an f32 `x`, `transpose(transpose(x))`.
After: constant scalar expressions are single `const` nodes (Python-scalar
semantics: computed in double precision, rounded to the result dtype);
`x * 1`, `1 * x`, `x + 0`, `0 + x`, `x - 0`, `x / 1`, `--x`, casts to the same
type (but not a cast to f16/bf16 of a computed value, which rounds it) and
double transposes are replaced by `x` when that leaves every type unchanged, and a
reshape of a reshape is one reshape (none when it gives the source's shape back).
(A reduction over several axes stays one op per axis, as sema writes it: a row
program reduces them as one, `fuse-rows`.)
Equivalent forms become one: a reduction's dropped dim put back is the
reduction keeping it, a transposed product is the product of the transposes,
a gather of a cast is a cast of the gather, a gather along a row of a value its row
program computes is a sum selecting the element, and the transpose of a weight unpacked
through gathers is the weight unpacked at the transposed indices. An out-of-place scatter
(a zero-filled put, a put marking what it wrote, their merge over x; or a put adding
into zeros, added to x) is one put into x, a
put at a permutation (argsort's positions) needs no x, and values gathered at a
permutation and scattered back at it are the values.
Results that are NaN or that Python cannot compute (`log(0)`) are left for
run time.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.index_maps import affine
from tiledsl.indexing import permuted_axis, read_through, reindex, slice_source, view_coords
from tiledsl.ir import Edge, Graph, Op, walk
from tiledsl.ops.core import read_types
from tiledsl.passes.fusion.admission import gathered_operand, parameter_or_view
from tiledsl.passes.fusion.score_space import is_op, swaps_last
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import Pattern, Rewriter, apply_patterns
from tiledsl.types import DType, Shape, TensorType


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
    """The dtype a folded op reads each operand in (None: as it is), as `read_types` says,
    in Python's precision where it is weak."""
    return tuple(None if r is None or r is t else _as_python(r.dtype)
                 for r, t in zip(read_types(op.kind, types, op.type), types, strict=True))


def const_value(graph: Graph, node: int):
    op = graph.op(node)
    return op.attr("value") if isinstance(op, Op) and op.kind == "const" else None


def folds(op: Op) -> bool:
    """Whether `op` is computed at compile time when its operands are constants: a weak
    (Python-scalar) scalar whose kind has a fold. Sema asks it too (dropout's p)."""
    spec = ops.OPS.get(op.kind)
    return spec is not None and spec.fold is not None and op.weak and not op.shape


def fold_value(op: Op, args: Sequence[object]) -> object | None:
    """`op` (one that `folds`) applied to its operands' values `args`; None where Python
    cannot compute it (`log(0)`, `1 // 0`): it is left for run time."""
    try:
        return ops.OPS[op.kind].fold(*args, **op.attr_map)
    except (ArithmeticError, ValueError, TypeError):
        return None


class FoldConstants(Pattern):
    """An elementwise op of constants becomes one constant."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        operands = graph.operands(node)
        if not operands or not folds(op):
            return False
        values = [const_value(graph, n) for n in operands]
        if any(v is None for v in values):
            return False
        types = tuple(graph.op(n).type for n in operands)
        args = [v if dtype is None else _round(v, dtype)
                for v, dtype in zip(values, _read_as(op, types), strict=True)]
        value = fold_value(op, args)
        if value is None or isinstance(value, float) and math.isnan(value):
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
        lhs, rhs = graph.operand_edges(node)
        candidates = [(lhs, rhs)] + ([(rhs, lhs)] if commutes else [])
        for keep, other in candidates:
            v = const_value(graph, other[0])
            if v is not None and not isinstance(v, bool) and v == unit \
                    and graph.result_type(*keep) == op.type:
                rewriter.replace(node, keep)
                return True
        return False


class DivideByReciprocal(Pattern):
    """`x * (1 / y)` (either order) is `x / y`, one rounding instead of two, when nothing
    else reads `1 / y`: softmax written as `e * (1 / sum(e))` is `e / sum(e)`."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "mul" or not op.dtype.is_float:
            return False
        for keep, other in (graph.operand_edges(node), reversed(graph.operand_edges(node))):
            r_op = graph.op(other[0])
            if not (isinstance(r_op, Op) and r_op.kind == "div" and len(graph.users(other[0])) == 1):
                continue
            one, y = graph.operand_edges(other[0])
            if const_value(graph, one[0]) != 1 or isinstance(const_value(graph, one[0]), bool):
                continue
            if rewriter.build.type_of("div", [keep, y]) != op.type:
                continue
            rewriter.replace(node, rewriter.build.op("div", [keep, y], op.span))
            return True
        return False


class RemoveNoOpCast(Pattern):
    """A cast to the type a value already has is the value, except a cast to f16/bf16 of a
    computed value: kernels hold those in f32, and an explicit cast is where they round
    (design section 5), so `cast(a * b, bf16)` of a bf16 product stays."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "cast":
            return False
        (x,) = graph.operand_edges(node)
        if graph.result_type(*x) != op.type:
            return False
        if op.dtype in (DType.F16, DType.BF16) and not is_op(graph, x[0], "param"):
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
        (x,) = graph.operand_edges(inner)
        if graph.result_type(*x) != op.type:
            return False
        rewriter.replace(node, x)
        return True


class ReshapeOfReshape(Pattern):
    """`reshape(reshape(x, a), b)` is `reshape(x, b)`, and `x` itself where b is x's shape:
    Swin's window mask views the scores as `[B_ // nW, nW, H, N, N]` and back to
    `[-1, H, N, N]`, which is the scores again (attention fuses through it). A copy asked
    of either reshape stays asked of the one left."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "reshape":
            return False
        (inner,) = graph.operands(node)
        inner_op = graph.op(inner)
        if not (isinstance(inner_op, Op) and inner_op.kind == "reshape"):
            return False
        (x,) = graph.operand_edges(inner)
        if graph.result_type(*x).shape == op.shape:
            rewriter.replace(node, x)
        else:
            rewriter.replace(node, rewriter.build.op(
                "reshape", [x], op.span, shape=op.shape, copy=bool(op.attr("copy") or inner_op.attr("copy"))))
        return True


class ReduceAlongOne(Pattern):
    """A reduction along an axis of size 1 that gives its one element back (sum, mean, max,
    min, prod, logsumexp) is its operand in the result's dtype, the axis dropped unless kept
    (a view): nothing is reduced, so no row program runs along it (a bounds check's count of
    a `[K, 1]` index)."""

    KINDS = ("sum", "mean", "max", "min", "prod", "logsumexp")

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in self.KINDS:
            return False
        (x,) = graph.operand_edges(node)
        x_type = graph.result_type(*x)
        shape = x_type.shape
        axis = op.attr("axis") % len(shape)
        if shape[axis] != 1:
            return False
        b = rewriter.build
        value = x if x_type.dtype is op.dtype else b.op("cast", [x], op.span, dtype=op.dtype)
        if not op.attr("keepdims"):
            items = tuple(("at", 0) if k == axis else ("range", 0, d, 1, d) for k, d in enumerate(shape))
            value = b.op("slice", [value], op.span, items=items)
        rewriter.replace(node, value)
        return True


class ViewOfFill(Pattern):
    """A view (`reshape`, `transpose`, `slice`) of one number broadcast (`full(x, v)`, read
    at a shape only the sizes make equal) is that number broadcast to the view's shape: a
    fill computed where it is read, never a stored tensor viewed."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in ("reshape", "transpose", "slice"):
            return False
        (x,) = graph.operands(node)
        x_op = graph.op(x)
        if not (isinstance(x_op, Op) and x_op.kind == "expand"
                and graph.result_type(*graph.operand_edges(x)[0]).rank == 0):
            return False
        rewriter.replace(node, rewriter.build.op("expand", graph.operand_edges(x), op.span, shape=op.shape))
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
        rewriter.replace(node, b.op(rop.kind, graph.operand_edges(r), rop.span,
                                    **(rop.attr_map | {"axis": at, "keepdims": True})))
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


class TransposedOperand(Pattern):
    """A matmul operand that is the transpose of an elementwise op of one parameter (and
    scalars), `x @ cast(w_int8, f16).T` (gpt-fast's int8 weight-only linear; an fp8 or bf16
    weight cast as `F.linear` takes it), is the op of the transpose, `x @ cast(w_int8.T, f16)`:
    the transpose is a view of the parameter, and the op a prologue the GEMM applies to each
    tile it loads, never a stored copy."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "transpose" or not graph.users(node):
            return False
        if any(not (isinstance(u := graph.op(n), Op) and u.kind == "matmul") for n, _ in graph.users(node)):
            return False
        (x,) = graph.operands(node)
        x_op = graph.op(x)
        if not isinstance(x_op, Op) or not ops.is_elementwise(x_op.kind) or graph.users(x) != [(node, 0)]:
            return False
        tensors = [e for e in graph.operand_edges(x) if graph.result_type(*e).rank > 0]
        # a weight's dequantization or cast: an op of a parameter (a computed
        # value's transpose is a product's own business: the attention backward reads `ds.T`
        # as a transposed score-space value; fuse-attention takes `(k * c).T` as it is)
        if len(tensors) != 1 or x_op.kind == "index" or not is_op(graph, tensors[0][0], "param"):
            return False
        if graph.result_type(*tensors[0]).shape != x_op.shape:
            return False
        b = rewriter.build
        moved = b.op("transpose", [tensors[0]], op.span, **op.attr_map)
        operands = [moved if e == tensors[0] else e for e in graph.operand_edges(x)]
        rewriter.replace(node, b.op(x_op.kind, operands, x_op.span, **x_op.attr_map))
        return True


class ViewOfCast(Pattern):
    """A view (a reshape, a transpose) of a cast is the cast of the view when the cast reads a
    parameter, or a view of one, or when matmuls alone read the view (through further
    views) and nothing else the cast. DeepSeek-V3's block quantizer
    `reshape(cast(x, f32), [M, K // 128, 128])` is then a cast of a view of x, computed by the
    row program over the blocks, which no reshape of a computed value separates from its
    statistics; a GEMM's `transpose(cast(q, f32), 0, 1)` or
    `reshape(cast(w, f32), ...)` is a prologue on the tiles the GEMM loads through the view.
    A reshape moved onto a parameter copies a tensor whose strides cannot view it
    (`copy=true`): the program's reshape was of a value the compiler laid out."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in ("reshape", "transpose") or not graph.users(node):
            return False
        (x,) = graph.operand_edges(node)
        cast = graph.op(x[0])
        if not (isinstance(cast, Op) and cast.kind == "cast"):
            return False
        (src,) = graph.operand_edges(x[0])
        # a computed value's cast: read by this view alone, which is not a swap of the last
        # two dims (an attention backward reads `ds.T` as a transposed score-space value)
        parameter = parameter_or_view(graph, src[0])
        if not parameter and not (graph.users(x[0]) == [(node, 0)] and _read_by_matmuls(graph, node)
                                  and not swaps_last(graph, node)):
            return False
        attrs = dict(op.attr_map)
        if op.kind == "reshape" and parameter:
            attrs["copy"] = True
        b = rewriter.build
        moved = b.op(op.kind, [src], op.span, **attrs)
        rewriter.replace(node, b.op("cast", [moved], cast.span, **cast.attr_map))
        return True


def _read_by_matmuls(graph: Graph, node: int) -> bool:
    """Do matmuls alone read `node`, through views?"""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u, _ in graph.users(n):
            kind = graph.op(u).kind
            if kind in ("reshape", "transpose") and u not in seen:
                seen.add(u)
                stack.append(u)
            elif kind != "matmul":
                return False
    return True


class TransposedGatheredOperand(Pattern):
    """A matmul operand that is the transpose of a gathered operand (`x @ dequant(w).T` where
    `w` is a packed weight read through `take`s at index expressions: QLoRA's NF4, gpt-oss's
    MXFP4, as `F.linear` takes an [out, in] weight) is the gathered operand computed in the
    transposed space: each `index` counts along the swapped axis, each gather reads its
    parameter at the transposed indices, and each tensor it reads element for element is a
    transposed view. The GEMM then unpacks it in its K loop (`admission.gathered_operand`)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "transpose" or not graph.users(node) or any(
                not (isinstance(u := graph.op(n), Op) and u.kind == "matmul" and slot == 1)
                for n, slot in graph.users(node)):
            return False
        edge = graph.operand_edges(node)[0]
        rank = op.type.rank
        if graph.result_type(*edge).rank != rank:
            return False
        inside = gathered_operand(graph, edge)
        if not inside or any(u not in inside and u != node for n in inside for u, _ in graph.users(n)):
            return False
        a, b = op.attr("dims")
        built: dict[int, Edge] = {}

        def moved(e: Edge) -> Edge:  # e in the transposed space
            n = e[0]
            if n in built:
                return built[n]
            n_op = graph.op(n)
            t = graph.result_type(*e)
            if t.rank == 0:
                return e
            if n not in inside:  # a tensor read at the tile's index: a view of it
                if t.rank < rank:
                    e = (rewriter.build.op("reshape", [e], n_op.span, shape=(1,) * (rank - t.rank) + t.shape,
                                           copy=False), 0)
                out = (rewriter.build.op("transpose", [e], op.span, dims=(a, b)), 0)
            elif n_op.kind == "index":
                axis = n_op.attr("axis") % rank
                shape = list(n_op.shape)
                shape[a], shape[b] = shape[b], shape[a]
                out = (rewriter.build.op("index", [], n_op.span, axis={a: b, b: a}.get(axis, axis),
                                         shape=tuple(shape)), 0)
            else:
                operands = graph.operand_edges(n)
                if n_op.kind == "take":
                    operands = [operands[0], *(moved(i) for i in operands[1:])]
                else:
                    operands = [moved(o) for o in operands]
                out = (rewriter.build.copy(n_op, operands), 0)
            built[n] = out
            return out

        rewriter.replace(node, moved(edge))
        return True


class GatherBeforeElementwise(Pattern):
    """A gather of an elementwise op of one tensor (and constants), `gather(cast(x, f32), y)`,
    `gather(30 * tanh(x / 30), y)`, is the op of the gather, `cast(gather(x, y), f32)`:
    kernels load a gathered tensor through its indices, so `cast(x)` would otherwise be
    stored whole for the gather (a cross-entropy's second kernel). Only for ops that give 0
    at 0 (by their constant fold), so an index out of range still reads 0."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        x_op = graph.op(x[0])
        if not isinstance(x_op, Op) or not _zero_at_zero(graph, x[0], x_op):
            return False
        edges = graph.operand_edges(x[0])
        (slot,) = [k for k, e in enumerate(edges) if graph.result_type(*e).rank > 0]
        b = rewriter.build
        # a gather of the op's operand must type (not one of f8 values, which only a cast reads)
        if b.type_of("take", [edges[slot], *indices]) is None:
            return False
        edges[slot] = b.op("take", [edges[slot], *indices], op.span)
        rewriter.replace(node, b.op(x_op.kind, edges, x_op.span, **x_op.attr_map))
        return True


def _zero_at_zero(graph: Graph, node: int, op: Op) -> bool:
    """Is `op` an elementwise op of one tensor of its shape and constants that gives 0 where
    the tensor is 0 (its constant fold says so: `cast`, `neg`, `tanh`, `x * 30`, `x / 30`,
    not `x + 1` or `exp`)?"""
    fold = ops.OPS[op.kind].fold if op.kind in ops.OPS else None
    if fold is None or op.kind == "take" or not ops.is_elementwise(op.kind):
        return False
    types = [graph.result_type(*e) for e in graph.operand_edges(node)]
    tensors = [k for k, t in enumerate(types) if t.rank > 0]
    if len(tensors) != 1 or types[tensors[0]].shape != op.shape:
        return False
    zero = {DType.BOOL: False}.get(types[tensors[0]].dtype, 0)
    args = [zero if k == tensors[0] else const_value(graph, o) for k, o in enumerate(graph.operands(node))]
    if any(a is None for a in args):
        return False
    try:
        value = fold(*args, **op.attr_map)
    except (ArithmeticError, ValueError, TypeError):
        return False
    return not isinstance(value, bool) and value == 0


class GatherAlongRow(Pattern):
    """A gather along the axis a row program reduces, of a value that program computes
    (`gather(x - logsumexp(x, -1, keepdims=true), y)`, `gather(softmax(x), y)`), is a sum
    over that axis selecting the element: `sum(where(index(v, a) == wrap(y)[:, None], v,
    0), a)`. The row program reads every element of the row anyway; as a gather, it would
    store the whole value for another kernel to read one element of each row. Exact: the
    sum adds zeros to the one element, and an index out of range selects none (0, as a
    gather reads there); a negative one counts from the end, as a gather's does."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        (v, res), *indices = graph.operand_edges(node)
        shape = graph.result_type(v, res).shape
        axis = _gathered_axis(graph, indices, shape, op.shape)
        if axis is None or not _computed_along(graph, v, axis):
            return False
        b = rewriter.build
        at = indices[axis]
        i_type = graph.result_type(*at)
        span = op.span
        size = b.size(shape[axis], span)
        negative = b.op("lt", [at, b.const(0, i_type.dtype, span)], span)
        wrapped = b.op("where", [negative, b.op("add", [at, size], span), at], span)
        if op.shape:  # the index of each element of the result, read along the gathered axis
            items = [("range", 0, d, 1, d) for d in op.shape]
            items.insert(axis, ("new",))
            wrapped = b.op("slice", [wrapped], span, items=tuple(items))
        # a 0-d index (one element of a vector) broadcasts as it is: it is computed where it
        # is read, so there is no tensor to view (`softmax(y)[i]`; fuzz finding 0:8159)
        small = tuple(d if k == axis else 1 for k, d in enumerate(shape))
        hit = b.op("eq", [b.op("index", [], span, axis=axis, shape=small), wrapped], span)
        zero = b.const(0, graph.result_type(v, res).dtype, span)
        selected = b.op("where", [hit, (v, res), zero], span)
        rewriter.replace(node, b.op("sum", [selected], span, axis=axis, keepdims=False))
        return True


class PickAlongRow(Pattern):
    """A slice picking one element along the axis a row program computes its value along, at
    a position of its own (`topk(x, 5)[0][..., -1, None]`, Hugging Face's top-k warper's k-th
    largest; gpt-fast's pivot `v.select(-1, -1)`), is a sum over that axis selecting it, as
    a gather there is (`GatherAlongRow`): the row program holds the row, or the selected
    elements, and reads the element per row, which the readers of the slice then read as a
    per-row value, in the same kernel."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "slice":
            return False
        (v, res), = graph.operand_edges(node)
        shape = graph.result_type(v, res).shape
        items = op.attr("items")
        picks = [k for k, it in enumerate(items) if it[0] == "at"]
        if len(picks) != 1:
            return False
        axis = sum(1 for it in items[:picks[0]] if it[0] != "new")
        own = [it for it in items if it[0] != "new"]
        if shape[axis] == 1 or any(it[0] == "range" and (it[1] != 0 or it[3] != 1 or it[4] != shape[k])
                                   for k, it in enumerate(own)):
            return False
        news = [k for k, it in enumerate(items) if it[0] == "new"]
        keep = bool(news)
        if news and (len(news) != 1 or abs(news[0] - picks[0]) != 1):
            return False  # (one new axis beside the picked one: where keepdims leaves it)
        if not _computed_along(graph, v, axis):
            return False
        b, span = rewriter.build, op.span
        at = items[picks[0]][1]
        small = tuple(d if k == axis else 1 for k, d in enumerate(shape))
        hit = b.op("eq", [b.op("index", [], span, axis=axis, shape=small), b.size(at, span)], span)
        zero = b.const(0, graph.result_type(v, res).dtype, span)
        picked = b.op("sum", [b.op("where", [hit, (v, res), zero], span)], span, axis=axis, keepdims=keep)
        if b.types([picked])[0] != op.type:
            return False
        rewriter.replace(node, picked)
        return True


def _gathered_axis(graph: Graph, indices: list[Edge], shape: tuple, out: tuple) -> int | None:
    """The one axis a gather of a value of `shape` reads at computed indices, every other
    axis read at its own index (the gather's result is the value without that axis); None
    for any other gather."""
    if len(indices) != len(shape) or len(out) != len(shape) - 1:
        return None

    def own(k: int, at: int) -> bool:  # axis k read at the result's index along `at`
        i_op = graph.op(indices[k][0])
        return isinstance(i_op, Op) and i_op.kind == "index" and i_op.attr("axis") == at \
            and len(i_op.shape) == len(out) and i_op.shape[at] == shape[k]

    for axis in range(len(shape)):
        if graph.result_type(*indices[axis]).shape == out and all(
                own(k, k if k < axis else k - 1) for k in range(len(shape)) if k != axis):
            return axis
    return None


def _computed_along(graph: Graph, node: int, axis: int, depth: int = 8) -> bool:
    """Is `node` computed by a row program over `axis`: a softmax or scan along it, or an
    elementwise op of one (or of a reduction along it that kept the axis), within `depth`?"""
    op = graph.op(node)
    if not isinstance(op, Op):
        return False
    category = ops.category(op.kind)
    if category in (ops.Category.SOFTMAX, ops.Category.SCAN, ops.Category.REDUCTION, ops.Category.SELECT):
        return op.attr("axis") == axis and (category is not ops.Category.REDUCTION or op.attr("keepdims"))
    if depth == 0 or not ops.is_elementwise(op.kind) or op.kind == "take":
        return False
    return any(graph.result_type(*e).rank == op.type.rank and _computed_along(graph, e[0], axis, depth - 1)
               for e in graph.operand_edges(node))


class ViewOfGather(Pattern):
    """A view (transpose, reshape, slice) of a gather read only through views is the
    gather at the viewed index: each index expression computed at the source position of
    each element of the view, where the view's transpose swaps two index axes, its reshape
    splits a merged index (`j` of [L * P] is `j // P` of [L] and `j % P` of [P]) and its
    slice offsets and strides one. So `reshape(k_cache[block_table], [B, L * P, D])` is
    `k_cache[block_table[b, j // P], j % P]`, which the kernel reading it (attention's k and
    v tiles included) loads through the index; the gather is never stored whole. An index
    tensor that is not an index expression is read at the source position through a gather
    of its own."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in ("transpose", "reshape", "slice"):
            return False
        (src,) = graph.operands(node)
        take = graph.op(src)
        if not isinstance(take, Op) or take.kind != "take" or not all(
                isinstance(u := graph.op(n), Op) and ops.category(u.kind) is ops.Category.LAYOUT
                for n, _ in graph.users(src)):
            return False
        x, *indices = graph.operand_edges(src)
        if not all(_reindexable(graph, i) for i, _ in indices):
            return False
        b = rewriter.build
        coords = view_coords(b, op, take.shape)

        def at(v: int) -> int:
            """Index tensor `v` (broadcast to the gather's shape) read at each element's
            source position."""
            v_shape = graph.op(v).shape
            lead = len(take.shape) - len(v_shape)
            return reindex(b, v, [None if d == 1 else coords[lead + k] for k, d in enumerate(v_shape)],
                           op.span)

        gathered = b.op("take", [x, *(at(i) for i, _ in indices)], take.span)
        if b.types([gathered])[0] != op.type:
            return False
        rewriter.replace(node, gathered)
        return True


class ReshapeOfIndexMap(Pattern):
    """A reshape of a value computed elementwise from positions (a concat of slices, as
    GPT-J's rotate_every_two interleaves `-x[..., 1::2]` and `x[..., ::2]` along a new axis
    and merges it) read only through views is that value computed at the reshape's source
    positions: the map read through, as a slice of one is (sema's `_read_positional`), so
    what reads it computes it at its own index instead of gathering it from a store."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "reshape":
            return False
        (src,) = graph.operands(node)
        if not read_through(graph, src, {}) or not all(
                isinstance(u := graph.op(n), Op) and ops.category(u.kind) is ops.Category.LAYOUT
                for n, _ in graph.users(src)):
            return False
        s_op = graph.op(src)
        b = rewriter.build
        coords = view_coords(b, op, s_op.shape)
        out = reindex(b, src, coords, op.span)
        if b.types([out])[0] != op.type:
            return False
        rewriter.replace(node, out)
        return True


def _reindexable(graph: Graph, node: int) -> bool:
    """Can `reindex` read index tensor `node` again at other positions: is every value it
    walks through (elementwise ops and slices, and what they read) an op, not a kernel an
    earlier pass formed?"""

    def read(n: int) -> list[int]:
        op = graph.op(n)
        walked = isinstance(op, Op) and op.type.rank and (ops.is_elementwise(op.kind) or op.kind == "slice")
        return graph.operands(n) if walked else []

    return all(isinstance(graph.op(n), Op) for n in walk([node], read))


class GatherOfView(Pattern):
    """A gather of a computed value reading some of its axes at the result's own positions of
    other axes reads a view of it at its own positions there: `take(m, b, s, h, 0)` over a
    [B, H, S, 1] result (s: the index along the result's axis 2, h along its axis 1) is
    `take(transpose(m, 1, 2), b, h, s, 0)`, and new size-1 axes of the result are new axes of
    the view; an index computed along one axis of the result stays at its place. At every
    own position it is the view (`RemoveIdentityGather`), which the row program computing the
    value reads: Qwen3's RoPE, read through its head transpose at the rows' positions, reads
    the rows' statistic so. A parameter's gather stays as it is (loaded through its pointer:
    an attention's gathered queries, a GEMM's gathered operand)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        shape, rank = graph.result_type(*x).shape, len(op.shape)
        n = len(shape)
        if len(indices) != n or n > rank or parameter_or_view(graph, x[0]):
            return False  # (a parameter's gather loads it through its pointer, as it is)

        def along(k: int) -> int | None:
            """The result axis x's axis k is read along: an `index` of it, or an index
            computed along that axis alone (a rotation of it); None: a size-1 axis read at 0;
            -1: neither (no view reads it)."""
            i_op = graph.op(indices[k][0])
            if shape[k] == 1 and const_value(graph, indices[k][0]) == 0:
                return None
            t = graph.result_type(*indices[k])
            if isinstance(i_op, Op) and i_op.kind == "index":
                axis = i_op.attr("axis")
                return axis if t.rank == rank and t.shape[axis] == op.shape[axis] == shape[k] else -1
            varying = [r for r in range(t.rank) if t.shape[r] != 1]
            if t.rank != rank or len(varying) != 1 or t.shape[varying[0]] != op.shape[varying[0]]:
                return -1
            # a computed index stays at its place (a gathered GEMM operand's packed axis,
            # computed along another, is `TransposedGatheredOperand`'s)
            return varying[0] if varying[0] == k + rank - n else -1

        places = [along(k) for k in range(n)]
        ones = [r for r in range(rank) if op.shape[r] == 1 and r not in places]
        for k in range(n):  # a size-1 axis read at 0 takes a size-1 place of the result
            if places[k] is None:
                if not ones:
                    return False
                places[k] = ones.pop(0)
        if -1 in places or len(set(places)) != n or places == list(range(n)) \
                or any(op.shape[r] != 1 for r in range(rank) if r not in places):
            return False
        b = rewriter.build
        view, current = x, list(range(n))  # current[j]: the axis of x at the view's place j
        for j, axis in enumerate(sorted(range(n), key=places.__getitem__)):
            at = current.index(axis)
            if at != j:
                view = b.op("transpose", [view], op.span, dims=(j, at))
                current[j], current[at] = current[at], current[j]
        read = sorted(places)
        if n != rank:
            v_shape = b.types([view])[0].shape
            items = []
            for r in range(rank):
                j = read.index(r) if r in read else None
                items.append(("range", 0, v_shape[j], 1, v_shape[j]) if j is not None else ("new",))
            view = b.op("slice", [view], op.span, items=tuple(items))
        at_axis = {places[k]: indices[k] for k in range(n)}
        zero = b.const(0, DType.I32, op.span)
        out = b.op("take", [view, *(at_axis.get(r, zero) for r in range(rank))], op.span)
        if b.types([out])[0] != op.type:
            return False
        rewriter.replace(node, out)
        return True


class GatherOfSlicedParameter(Pattern):
    """A gather at an index map of positions from a slice of a parameter (a concat's piece,
    `q[..., D // 2:]` read at `i - (D - D // 2)`) is a gather from the parameter at the
    slice's source positions (`i - (D - D // 2) + D // 2`): both halves of rotate-half then
    read one tensor, which `SelectOfGathers` reads once."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        view = graph.op(x[0])
        if not (isinstance(view, Op) and view.kind == "slice" and parameter_or_view(graph, x[0])) \
                or any(item[0] == "new" for item in view.attr("items")) \
                or any(affine(graph, i) is None for i, _ in indices):
            return False
        b = rewriter.build
        source = slice_source(b, view, [i for i, _ in indices], op.span)
        (src,) = graph.operand_edges(x[0])
        out = b.op("take", [src, *source], op.span)
        if b.types([out])[0] != op.type:
            return False
        rewriter.replace(node, out)
        return True


class SelectOfGathers(Pattern):
    """A select between gathers of one tensor, each under unary elementwise ops (a concat's
    `where(i < h, -x[.., i + h], x[.., i - h])`), gathers once, at the selected index:
    `t = x[.., where(i < h, i + h, i - h)]`, then `where(i < h, -t, t)`: one load an element
    instead of two."""

    UNARY = ("neg", "cast")

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "where":
            return False
        cond, a, b_ = graph.operand_edges(node)
        chain_a, take_a = self._chain(graph, a)
        chain_b, take_b = self._chain(graph, b_)
        if take_a is None or take_b is None or take_a == take_b:
            return False
        xa, *ia = graph.operand_edges(take_a)
        xb, *ib = graph.operand_edges(take_b)
        if xa != xb or len(ia) != len(ib):
            return False
        b = rewriter.build
        at = [i if _same_values(graph, [i], [j]) else b.op("where", [cond, i, j], op.span)
              for i, j in zip(ia, ib, strict=True)]
        t = b.op("take", [xa, *at], graph.op(take_a).span)
        out = b.op("where", [cond, self._rebuild(graph, b, chain_a, t), self._rebuild(graph, b, chain_b, t)],
                   op.span)
        if b.types([out])[0] != op.type:
            return False
        rewriter.replace(node, out)
        return True

    def _chain(self, graph: Graph, edge: Edge) -> tuple[list[int], int | None]:
        """The unary ops over a gather (outermost first) read only here, and the gather."""
        chain, node = [], edge[0]
        for _ in range(3):
            op = graph.op(node)
            if not isinstance(op, Op) or len(graph.users(node)) != 1:
                return chain, None
            if op.kind == "take":
                return chain, node
            if op.kind not in self.UNARY:
                return chain, None
            chain.append(node)
            node = graph.operands(node)[0]
        return chain, None

    @staticmethod
    def _rebuild(graph: Graph, b, chain: list[int], value: int) -> int:
        for n in reversed(chain):
            op = graph.op(n)
            value = b.op(op.kind, [value], op.span, **op.attr_map)
        return value


class RemoveIdentityGather(Pattern):
    """A gather of each element at its own index, `take(x, i0, .., ik)` where `ik` is the
    index along axis k (0 where x has size 1 there), is `x`: a concat's piece re-indexed
    through a slice of a normalised row reads the row's statistic so (`rsqrt(mean(x * x))`
    keeps its one reduction over the whole row)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        x_type = graph.result_type(*x)
        if x_type != op.type:
            return False
        for k, ((i, _), d) in enumerate(zip(indices, x_type.shape, strict=True)):
            i_op = graph.op(i)
            own = (isinstance(i_op, Op) and i_op.kind == "index" and i_op.attr("axis") == k
                   and i_op.type.rank == x_type.rank and i_op.shape[k] == d)
            if not own and not (d == 1 and const_value(graph, i) == 0):
                return False
        rewriter.replace(node, x)
        return True


def _same_values(graph: Graph, a: Sequence[Edge], b: Sequence[Edge]) -> bool:
    """Are the values `a` and `b` pairwise the same: one edge, or ops of no operands (an
    `index`, a constant) alike (canonicalize runs before cse merges them)?"""
    def same(x: Edge, y: Edge) -> bool:
        if x == y:
            return True
        ox, oy = graph.op(x[0]), graph.op(y[0])
        return (isinstance(ox, Op) and isinstance(oy, Op) and not graph.operands(x[0])
                and not graph.operands(y[0]) and ox.kind == oy.kind and ox.type == oy.type
                and ox.attr_map == oy.attr_map)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


def _all_true(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    if isinstance(op, Op) and op.kind == "expand":
        node = graph.operands(node)[0]
    return const_value(graph, node) is True


class WriteInto(Pattern):
    """x with src written at indices, as sema builds torch's out-of-place scatter: a put of
    src into zeros, a put of `true` marking the written elements, and their merge
    `where(written, put, x)`, is one `put_into(x, src, ..)`: its kernel stores src at the
    indices into a copy of x, with no mask and no merge kernel after it."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "where":
            return False
        (w, _), (p, _), x = graph.operand_edges(node)
        w_op, p_op = graph.op(w), graph.op(p)
        if not (is_op(graph, w, "put") and is_op(graph, p, "put")) or w_op.attr("accumulate") \
                or p_op.attr("accumulate") or graph.operand_edges(w)[1:] != graph.operand_edges(p)[1:]:
            return False
        if not _all_true(graph, graph.operands(w)[0]) or graph.result_type(*x) != op.type \
                or p_op.type != op.type:
            return False
        src, *indices = graph.operand_edges(p)
        rewriter.replace(node, rewriter.build.op("put_into", [x, src, *indices], op.span, accumulate=False))
        return True


class AddInto(Pattern):
    """x plus src added at indices into zeros (`add(x, put(src, ..) {accumulate})`, sema's
    scatter_add and index_add) is `put_into(x, src, ..) {accumulate}`: one kernel adding into
    a copy of x, where the adds keep x's type (an f16 x's adds go to f32 and stay a put)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "add":
            return False
        for p, x in (graph.operand_edges(node), reversed(graph.operand_edges(node))):
            p_op = graph.op(p[0])
            if is_op(graph, p[0], "put") and p_op.attr("accumulate") and p_op.type == op.type \
                    and graph.result_type(*x) == op.type and len(graph.users(p[0])) == 1:
                src, *indices = graph.operand_edges(p[0])
                rewriter.replace(node, rewriter.build.op("put_into", [x, src, *indices], op.span,
                                                         accumulate=True))
                return True
        return False


class SelectOfSame(Pattern):
    """`where(c, a, a)` is `a` (when that keeps its type): what a scatter at a permutation of
    the values gathered there leaves of its merge."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "where":
            return False
        _, a, b = graph.operand_edges(node)
        if a != b or graph.result_type(*a) != op.type:
            return False
        rewriter.replace(node, a)
        return True


class PermutedWrite(Pattern):
    """A scatter at a permutation writes every element (argsort's positions, scattered back
    along their row: Hugging Face's top-p and min-p warpers): x is never read, and the
    values gathered at the permutation scattered back at it are the values. So
    `put_into(x, src, I)` is `put(src, I)`, and `put(take(y, I), I)` is y."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind not in ("put_into", "put"):
            return False
        edges = graph.operand_edges(node)
        src, *indices = edges[1:] if op.kind == "put_into" else edges
        if op.attr("accumulate") or permuted_axis(graph, indices, op.type.shape) is None:
            return False
        if is_op(graph, src[0], "take") and _same_values(graph, graph.operand_edges(src[0])[1:], indices) \
                and graph.result_type(*graph.operand_edges(src[0])[0]) == op.type:
            rewriter.replace(node, graph.operand_edges(src[0])[0])
            return True
        if op.kind == "put_into":
            rewriter.replace(node, rewriter.build.op("put", [src, *indices], op.span, shape=op.type.shape,
                                                     accumulate=False))
            return True
        return False


def _permuted(b, edge: Edge, kind: str, indices: Sequence[Edge]) -> Edge | int:
    """`edge` read at the permutation `indices`, as its `_permuted_kind` says: itself, or its
    gather at the same indices."""
    return edge if kind == "same" else b.op("take", [edge, *indices], None)


def _permuted_kind(graph: Graph, edge: Edge, shape: Shape, k: int) -> str | None:
    """How an elementwise op of `shape` permuted along axis k reads its operand `edge`: "same"
    where it does not vary along k (a scalar, a row's statistic), "gather" at the same indices
    where it has the op's shape, None where it cannot (a value broadcast along another axis)."""
    t = graph.result_type(*edge)
    lead = len(shape) - t.rank
    if k < lead or t.shape[k - lead] == 1:
        return "same"
    return "gather" if t.shape == tuple(shape) else None


def _sorts_row(graph: Graph, edge: Edge, indices: Sequence[Edge], k: int) -> bool:
    """Are `indices` argsort's positions of the row `edge` itself (its gather there is the
    sort's values)?"""
    sel = indices[k][0]
    return graph.operand_edges(sel)[0] == tuple(edge)


class SortedValues(Pattern):
    """A row gathered at its own sort's positions, `take(x, .., argtopk(x))` with k the row's
    length (torch's `x.gather(-1, x.argsort(-1))`), is the sort's values, `topk(x)` of the
    same attributes: a row program computes them with the positions, from one sort."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        x, *indices = graph.operand_edges(node)
        shape = graph.result_type(*x).shape
        if shape != op.shape or (k := permuted_axis(graph, indices, shape)) is None \
                or not _sorts_row(graph, x, indices, k):
            return False
        sel = graph.op(indices[k][0])
        rewriter.replace(node, rewriter.build.op("topk", [x], op.span, **sel.attr_map))
        return True


class GatherAtPermutation(Pattern):
    """A gather at a permutation of a row (argsort's positions) of an elementwise op, or of a
    softmax along that row, is the op of the gathered operands: `take(p < t * m, I)` is
    `take(p, I) < t * m` for a statistic m of the row, and `take(softmax(x), I)` is
    `softmax(take(x, I))` (softmax commutes with permuting its row). Moved when the gather
    is the op's only reader, or when every gather it leaves is of the sorted row itself
    (the sort's values, `SortedValues`): Hugging Face's min-p warper gathers its mask to sorted
    order so, and the row program computes it there from the sort it already holds."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "take":
            return False
        (x, res), *indices = graph.operand_edges(node)
        shape = graph.result_type(x, res).shape
        x_op = graph.op(x)
        if shape != op.shape or not isinstance(x_op, Op) or x_op.kind == "take" \
                or (k := permuted_axis(graph, indices, shape)) is None:
            return False
        if not (ops.is_elementwise(x_op.kind) or (x_op.kind == "softmax" and x_op.attr("axis") == k)):
            return False
        edges = graph.operand_edges(x)
        if not any(graph.result_type(*e).rank for e in edges):
            return False  # (`index`: a position, which the permutation moves; a fill)
        kinds = [_permuted_kind(graph, e, shape, k) for e in edges]
        gathered = [e for e, kind in zip(edges, kinds, strict=True) if kind == "gather"]
        if None in kinds or len(graph.users(x)) > 1 and not all(_sorts_row(graph, e, indices, k)
                                                                for e in gathered):
            return False
        b = rewriter.build
        operands = [_permuted(b, e, kind, indices) for e, kind in zip(edges, kinds, strict=True)]
        rewriter.replace(node, b.op(x_op.kind, operands, x_op.span, **x_op.attr_map))
        return True


class ElementwiseOfPermutedWrite(Pattern):
    """An elementwise op of a scatter at a permutation of a row (argsort's positions), read
    by nothing else, is that scatter of the op computed in sorted order, the other operands
    gathered there: `where(put(m, I), -inf, x)` is `put(where(m, -inf, take(x, I)), I)`.
    Hugging Face's top-p and min-p warpers fill the logits so with the mask they scatter
    back to vocabulary order; with x the sorted row (`SortedValues`), one row program sorts,
    computes and stores the filled row at the positions."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if not ops.is_elementwise(op.kind) or op.kind == "take":
            return False
        edges = graph.operand_edges(node)
        puts = [e for e in edges if is_op(graph, e[0], "put")]
        if len(puts) != 1 or len(graph.users(puts[0][0])) != 1 or puts[0][1] != 0:
            return False
        put = puts[0][0]
        p_op = graph.op(put)
        src, *indices = graph.operand_edges(put)
        if p_op.attr("accumulate") or p_op.type.shape != op.shape \
                or (k := permuted_axis(graph, indices, op.shape)) is None:
            return False
        kinds = [None if e[0] == put else _permuted_kind(graph, e, op.shape, k) for e in edges]
        if any(kind is None and e[0] != put for e, kind in zip(edges, kinds, strict=True)):
            return False
        b = rewriter.build
        operands = [src if e[0] == put else _permuted(b, e, kind, indices)
                    for e, kind in zip(edges, kinds, strict=True)]
        value = b.op(op.kind, operands, op.span, **op.attr_map)
        rewriter.replace(node, b.op("put", [value, *indices], p_op.span, shape=op.shape, accumulate=False))
        return True


PATTERNS = (FoldConstants(), RemoveIdentity(), DivideByReciprocal(), RemoveNoOpCast(), CancelInvolution(),
            ReshapeOfReshape(), ReduceAlongOne(), ViewOfFill(), KeepReducedDim(), TransposeProduct(),
            TransposedOperand(), ViewOfCast(), TransposedGatheredOperand(), GatherBeforeElementwise(),
            GatherAlongRow(), PickAlongRow(), ViewOfGather(), ReshapeOfIndexMap(), GatherOfView(),
            GatherOfSlicedParameter(), SelectOfGathers(), RemoveIdentityGather(), WriteInto(), AddInto(),
            SelectOfSame(), PermutedWrite(), SortedValues(), GatherAtPermutation(),
            ElementwiseOfPermutedWrite())


@register
@dataclass(frozen=True)
class Canonicalize(Pass):
    name = "canonicalize"
    max_iterations: int = 10

    def run(self, graph: Graph, ctx: PassContext) -> None:
        apply_patterns(graph, PATTERNS, self.max_iterations)
