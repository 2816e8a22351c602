"""sink-reshape: elementwise ops on a reshaped result are computed before the reshape, reading
their other operands at the matching index.

Before: group norm as written with a reshape to groups and back:
`reshape(d * rsqrt(var + eps), [N, C, W]) * w + b`, with `w`, `b` per channel. The
normalisation is a row program over [N, G, C // G * W]; the affine step is over [N, C, W],
which the row program cannot read its result in (fusion refuses a read "through a
reshape"), so it is a second kernel that reads the normalised tensor back.
After: `reshape((d * rsqrt(var + eps)) * w' + b', [N, C, W])`, where `w'` and `b'` are `w` and
`b` gathered at the channel of each element of the group space (`take` at an index
expression: the flat index of [N, G, C // G * W] split by the shape [N, C, W]). The gathers
are index expressions, computed by the reading kernel over its own tile, so the affine step
joins the row program: one kernel; the returned reshape is a view of its result.

Sunk: an elementwise op one of whose operands is a reshape of a computed value (not a
parameter: reading a parameter through a reshape view is already free), read by nothing
but elementwise ops, whose other operands are scalars or values that broadcast to the
op's shape; in one walk in dependency order, so a chain sinks op by op. Each rewrite is
a fused remark. Runs before recompute and the fusion passes.

A unit view (a reshape that only drops or inserts size-1 dims, or a slice that only drops
them: `mu[0, :, 0]` of batch norm's `[1, C, 1]` statistic, `loss[:, 0]`) sinks the same way, and the other
operands need no gather: each is viewed in the source's shape too, and an elementwise op
computing one (read by nothing else) is computed in that shape itself, down to its
parameters and scalars. So batch norm's running statistics, `(1 - m) * running_mean + m *
mu[0, :, 0]`, are per-channel values of the statistics' row program, not a kernel of their
own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.dims import build as build_dim
from tiledsl.ir import Graph, Op
from tiledsl.passes.canonicalize import ReshapeOfReshape
from tiledsl.passes.fusion.legality import describe_node
from tiledsl.passes.fusion.remarks import FusionRemark
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import apply_patterns
from tiledsl.source import Span
from tiledsl.types import DType, broadcasts_to, format_shape

NAME = "sink-reshape"


@register
@dataclass(frozen=True)
class SinkReshape(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        # one walk in dependency order: a sunk op's readers come later and then read the
        # new reshape, so a chain sinks op by op
        for node in graph.topo_order():
            if node in graph.nx:
                _sink(graph, node, ctx.remarks)
        apply_patterns(graph, (ReshapeOfReshape(),))  # a sunk op's reshape read back by a reshape


def _sink(graph: Graph, node: int, remarks: list) -> bool:
    op = graph.op(node)
    if not (isinstance(op, Op) and ops.is_elementwise(op.kind)) or op.kind in ("take", "index") \
            or op.shape == ():
        return False
    operands = graph.operands(node)
    found = next((i for i, o in enumerate(operands) if _sinkable(graph, o, op.shape)), None)
    if found is None:
        return False
    if any(not isinstance(graph.op(o), Op) for o in operands):
        return False  # (a kernel's result, in a pipeline that formed one first: left as it is)
    view = operands[found]
    (src,) = graph.operands(view)
    inner = graph.op(src).shape
    unit = _unit(inner, op.shape)
    if graph.op(view).kind == "slice" and not all(
            _liftable(graph, o, node) for i, o in enumerate(operands) if i != found):
        return False  # (a slice of another computed value: the op stays where its reader is)
    new_operands = []
    for i, o in enumerate(operands):
        if i == found:
            new_operands.append(src)
        elif graph.op(o).shape == ():
            new_operands.append(o)
        elif unit:
            new_operands.append(_lifted(graph, o, _unit_shape(graph.op(o).shape, inner, op.shape), node))
        else:
            new_operands.append(_gathered(graph, o, inner, op.shape, op.span))
    b = Builder(graph)
    t = b.type_of(op.kind, new_operands, **op.attr_map)
    if t is None or t.shape != inner or t.dtype is not op.dtype:
        return False
    computed = b.copy(op, new_operands)
    back = b.op("reshape", [computed], graph.op(view).span, shape=op.shape, copy=False)
    remarks.append(FusionRemark(
        NAME, True, None, graph.op(view), op,
        f"{describe_node(graph, node)} is computed in the reshape's source shape "
        f"{format_shape(inner)}, its other operands "
        f"{'viewed in that shape' if unit else 'gathered at the matching index'}, and reshaped "
        f"to {format_shape(op.shape)} after: the kernel computing {format_shape(inner)} can take it"))
    graph.replace_uses(node, back)
    graph.remove(node)
    if not graph.users(view):
        graph.remove(view)
    return True


def _sinkable(graph: Graph, operand: int, shape) -> bool:
    """A reshape to `shape` (or a slice that is a unit view) of a computed value, read only
    by elementwise ops."""
    op = graph.op(operand)
    if not (isinstance(op, Op) and op.kind in ("reshape", "slice") and op.shape == shape):
        return False
    (src,) = graph.operands(operand)
    producer = graph.op(src)
    if not isinstance(producer, Op):  # (a kernel's result, in a pipeline that formed one first)
        return False
    if op.kind == "slice" and not _unit_slice(op, producer.shape):
        return False
    return (producer.kind not in ("param", "reshape", "slice", "transpose")
            and all(isinstance(graph.op(u), Op) and ops.is_elementwise(graph.op(u).kind)
                    for u, _ in graph.users(operand)))


def _unit(inner, outer) -> bool:
    """Whether a view between the shapes only drops or inserts size-1 dims."""
    return [d for d in inner if d != 1] == [d for d in outer if d != 1]


def _unit_slice(op: Op, source) -> bool:
    """A slice that reads every element of its source and drops size-1 dims (whole ranges
    and index 0 of size-1 dims): a value the kernel computing the source keeps per row
    (`mu[0, :, 0]`). One that inserts dims (`x[:, None]`) does not sink: its readers are
    computed in the larger shape, where a row program reading them is."""
    axis = 0
    for item in op.attr("items"):
        if item[0] == "new":
            return False
        if item[0] == "at" and (item[1] != 0 or source[axis] != 1):
            return False
        if item[0] == "range" and (item[1] != 0 or item[3] != 1):
            return False
        axis += 1
    return _unit(source, op.shape)


def _unit_shape(shape, inner, outer) -> tuple:
    """The shape in `inner`'s rank of a value of `shape` that broadcasts to `outer`, where
    `outer` is a unit view of `inner`: its dims at their places among inner's, 1 elsewhere."""
    full = (1,) * (len(outer) - len(shape)) + tuple(shape)
    places = iter(j for j, d in enumerate(outer) if d != 1)
    return tuple(full[next(places)] if d != 1 else 1 for d in inner)


def _liftable(graph: Graph, value: int, reader: int) -> bool:
    """Whether `_lifted` computes `value` in a unit view's source shape without viewing a
    computed value: a scalar, a parameter, or an elementwise op of such read by `reader`
    alone."""
    op = graph.op(value)
    if op.shape == () or (isinstance(op, Op) and op.kind == "param"):
        return True
    return _recomputable(graph, value, reader) \
        and all(_liftable(graph, o, value) for o in graph.operands(value))


def _recomputable(graph: Graph, value: int, reader: int) -> bool:
    """An elementwise op with elements (not a gather or an index) read by `reader` alone: it
    may be computed in another shape in its place."""
    op = graph.op(value)
    return isinstance(op, Op) and ops.is_elementwise(op.kind) and op.kind not in ("take", "index") \
        and op.shape != () and {u for u, _ in graph.users(value)} == {reader}


def _lifted(graph: Graph, value: int, shape, reader: int) -> int:
    """`value` viewed in `shape` (a unit view): an elementwise op read by `reader` alone is
    computed in that shape itself, its operands lifted in turn; anything else is viewed."""
    op = graph.op(value)
    if op.shape == shape:
        return value
    if _recomputable(graph, value, reader):
        operands = [o if graph.op(o).shape == () else
                    _lifted(graph, o, _unit_shape(graph.op(o).shape, shape, op.shape), value)
                    for o in graph.operands(value)]
        b = Builder(graph)
        t = b.type_of(op.kind, operands, **op.attr_map)
        if t is not None and t.shape == tuple(shape) and t.dtype is op.dtype:
            return b.copy(op, operands)
    return Builder(graph).op("reshape", [value], op.span, shape=tuple(shape), copy=False)


def _gathered(graph: Graph, value: int, inner, outer, span: Span | None) -> int:
    """`value` (broadcast to `outer`) read at each element of `inner`: take at the index of
    `outer` that the same flat position has."""
    b = _Index(graph, span)
    rank = len(inner)
    flat = None
    for k in range(rank):
        if inner[k] == 1:
            continue
        term = b.cast(b.op("index", [], axis=k, shape=inner))
        stride = b.product(inner[k + 1:])
        term = b.op("mul", [term, stride]) if stride is not None else term
        flat = term if flat is None else b.op("add", [flat, term])
    flat = flat if flat is not None else b.const(0, DType.I64)
    vshape = graph.op(value).shape
    lead = len(outer) - len(vshape)
    assert broadcasts_to(vshape, outer), "an elementwise operand broadcasts to the op's shape"
    indices = []
    for j, d in enumerate(vshape):
        jj = lead + j
        if d == 1:
            indices.append(b.const(0, DType.I64))
            continue
        q = b.product(outer[jj + 1:])
        at = b.op("floordiv", [flat, q]) if q is not None else flat
        indices.append(b.op("mod", [at, b.size(outer[jj])]))
    return b.op("take", [value, *indices])


class _Index:
    """Index arithmetic in i64 (a flat index never overflows), one dim node per symbol."""

    def __init__(self, graph: Graph, span: Span | None) -> None:
        self.build, self.span = Builder(graph), span
        self.dims = {graph.op(n).attr("symbol"): n for n in graph.nodes()
                     if isinstance(graph.op(n), Op) and graph.op(n).kind == "dim"}

    def op(self, kind: str, operands: list[int], **attrs) -> int:
        return self.build.op(kind, operands, self.span, **attrs)

    def const(self, value: int, dtype: DType) -> int:
        return self.build.const(value, dtype, self.span)

    def cast(self, node: int) -> int:
        return self.op("cast", [node], dtype=DType.I64)

    def size(self, dim) -> int:
        """A dim (an int or a dim expression) as an i64 value."""
        return self.cast(build_dim(dim, self.dim, lambda k: self.const(k, DType.I32),
                                   lambda kind, *args: self.op(kind, list(args))))

    def dim(self, symbol: str) -> int:
        if symbol not in self.dims:
            self.dims[symbol] = self.build.dim(symbol, self.span)
        return self.dims[symbol]

    def product(self, dims) -> int | None:
        out = None
        for d in dims:
            if d == 1:
                continue
            s = self.size(d)
            out = s if out is None else self.op("mul", [out, s])
        return out
