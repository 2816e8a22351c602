"""online-softmax: every softmax and logsumexp, however written, in its online form.

The row templates compute `softmax` and `logsumexp` by the composable-kernel
tile recurrence (shared/seeds/ck_softmax_tiles.rst): one pass over the row
keeps a running max `m` and a running sum `z`, rescaling `z` by
exp(m_old - m_new) whenever the max grows; softmax then reads the row once
more to write exp(x - m) / z (a row that fits in one block is read once), and
the attention template runs the same recurrence over key blocks. The
statistics written out by hand are the textbook two-pass form instead (a max
loop, then a sum-of-exp loop that depends on it, then a write loop). This
pass rewrites those into the ops the templates run online:

    e = exp(x - max(x, axis, keepdims=true))
    e / sum(e, axis, keepdims=true)                -> softmax(x, axis)
    m = max(x, axis, keepdims=true)
    m + log(sum(exp(x - m), axis, keepdims=true))  -> logsumexp(x, axis, keepdims=true)
    e / (sum(e, axis, keepdims=true) + exp(sink - m))
                                -> softmax(x, axis) * sigmoid(logsumexp(x, axis) - sink)
                                   (the factor in f32, of the f32 logsumexp)
    exp(x - logsumexp(x, axis, keepdims=true))     -> softmax(x, axis)
    (e @ v) / sum(e, -1, keepdims=true)            -> softmax(x, -1) @ v

when the intermediate values have no other use. A row that is all -inf then
gives 0 (softmax) and -inf (logsumexp) instead of the NaN of the written-out
form (with a sink, the row is 0: every weight is exp(-inf) over a finite sink term; the
written form agrees when its max includes the sink). Runs before fuse-attention, so a
hand-written softmax between two matmuls is recognised as attention. Its row input
and sink may be results of kernels formed earlier (a pipeline that runs a fusion pass
first): they are matched as (node, result) edges, never as nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ir import Edge, Graph, Op
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import Pattern, Rewriter, apply_patterns
from tiledsl.types import DType, broadcast_shapes


def _is(graph: Graph, node: int, kind: str) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind == kind


def _row_max_of(graph: Graph, m: Edge, x: Edge, axis: int) -> bool:
    """Is `m` = max(x, axis, keepdims=true), or, where x widens y (`cast(s_bf16, f32)`, as
    `s - m` reads bf16 scores beside an f32 sink), cast(max(y)) to x's dtype: the same value,
    since a widening cast keeps the order and every value exactly?"""
    op = graph.op(m[0])
    if _is(graph, m[0], "cast") and _is(graph, x[0], "cast") \
            and op.attr("dtype") is graph.op(x[0]).attr("dtype"):
        (y,) = graph.operand_edges(x[0])
        yt, wide = graph.result_type(*y), op.attr("dtype")
        if yt.dtype.is_float and wide.is_float and wide.itemsize >= yt.dtype.itemsize:
            return _row_max_of(graph, graph.operand_edges(m[0])[0], y, axis)
    return (_is(graph, m[0], "max") and graph.operand_edges(m[0]) == [x] and op.attr("axis") == axis
            and bool(op.attr("keepdims")))


def _shifted_exp(graph: Graph, e: int) -> tuple[Edge, Edge] | None:
    """(x, m) when `e` = exp(x - m)."""
    if not _is(graph, e, "exp"):
        return None
    (d,) = graph.operands(e)
    return tuple(graph.operand_edges(d)) if _is(graph, d, "sub") else None


def _only_used_by(graph: Graph, node: int, users: set[int]) -> bool:
    return {u for u, _ in graph.users(node)} <= users


def _replace(graph: Graph, node: int, op: Op, kind: str, x: Edge, rewriter: Rewriter, **attrs) -> bool:
    """Replace `node` by `kind(x, **attrs)` when that has exactly `node`'s type."""
    if rewriter.build.type_of(kind, [x], **attrs) != op.type:
        return False
    rewriter.replace(node, rewriter.build.op(kind, [x], op.span, **attrs))
    return True


class RecognizeSoftmax(Pattern):
    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "div":
            return False
        e, z = graph.operands(node)
        found = _shifted_exp(graph, e)
        if found is None or not _is(graph, z, "sum") or graph.operands(z) != [e]:
            return False
        x, m = found
        axis = graph.op(z).attr("axis")
        if not (graph.op(z).attr("keepdims") and _row_max_of(graph, m, x, axis)):
            return False
        if not (_only_used_by(graph, e, {node, z}) and _only_used_by(graph, z, {node})):
            return False
        return _replace(graph, node, op, "softmax", x, rewriter, axis=axis)


class RecognizeSoftmaxOfLogsumexp(Pattern):
    """exp(x - logsumexp(x, axis, keepdims=true)) is softmax(x, axis): probabilities from a
    logsumexp (which may be returned too: the attention kernel stores it), when nothing else
    computes with the logsumexp."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        found = _shifted_exp(graph, node)
        if found is None:
            return False
        x, lse = found
        lse_op = graph.op(lse[0])
        if not (_is(graph, lse[0], "logsumexp") and graph.operand_edges(lse[0]) == [x]
                and lse_op.attr("keepdims")):
            return False
        # read by nothing else but the return (a training forward's saved logsumexp): another
        # reader computing with it (`exp(lse) * p`, a gradient's) rounds against exp(x - lse)
        # as it is written, not against the softmax (gradient fuzzer, seed 2712, program 48)
        d = graph.operands(node)[0]
        if not _only_used_by(graph, lse[0], {d, graph.output}):
            return False
        return _replace(graph, node, op, "softmax", x, rewriter, axis=lse_op.attr("axis"))


class RecognizeNormalisedProduct(Pattern):
    """(e @ v) / sum(e, -1, keepdims=true) with e = exp(x - max(x, -1, keepdims=true)) is
    softmax(x) @ v: the row sum is constant along each row of the product, so dividing
    after the product is dividing the probabilities before it (attention normalised at
    its output, as flash kernels do)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "div":
            return False
        mm, z = graph.operands(node)
        if not (_is(graph, mm, "matmul") and _is(graph, z, "sum") and graph.op(z).attr("keepdims")):
            return False
        e, v = graph.operand_edges(mm)
        found = _shifted_exp(graph, e[0])
        axis = graph.op(z).attr("axis")
        if found is None or graph.operand_edges(z) != [e] or axis != graph.op(e[0]).type.rank - 1:
            return False
        x, m = found
        if not (_row_max_of(graph, m, x, axis) and _only_used_by(graph, e[0], {mm, z})
                and _only_used_by(graph, z, {node}) and _only_used_by(graph, mm, {node})):
            return False
        b = rewriter.build
        if b.type_of("softmax", [x], axis=axis) != graph.op(e[0]).type:
            return False
        product = b.op("matmul", [b.op("softmax", [x], op.span, axis=axis), v], graph.op(mm).span)
        if b.types([product])[0] != op.type:
            return False
        rewriter.replace(node, product)
        return True


class RecognizeLogsumexp(Pattern):
    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "add":
            return False
        for m, (lg, _) in (graph.operand_edges(node), reversed(graph.operand_edges(node))):
            if not _is(graph, lg, "log"):
                continue
            (z,) = graph.operands(lg)
            if not _is(graph, z, "sum") or not graph.op(z).attr("keepdims"):
                continue
            (e,) = graph.operands(z)
            found = _shifted_exp(graph, e)
            if found is None or found[1] != m:
                continue
            x = found[0]
            axis = graph.op(z).attr("axis")
            if not _row_max_of(graph, m, x, axis) or not all(
                    _only_used_by(graph, a, {b}) for a, b in ((lg, node), (z, lg), (e, z))):
                continue
            return _replace(graph, node, op, "logsumexp", x, rewriter, axis=axis, keepdims=True)
        return False


class RecognizeSinkSoftmax(Pattern):
    """e / (sum(e) + exp(sink - m)), e = exp(x - m): a softmax whose denominator has one more
    logit, `sink`, that no value is weighted by (gpt-oss's attention sinks), with m the row
    max or the max of it and the sink. It equals softmax(x) * sigmoid(logsumexp(x) - sink):
    an online softmax and a factor per row, which attention applies to its output. In a
    16-bit program the factor is computed in f32, from the f32 logsumexp (which the
    attention kernel has and a flash backward saves anyway), and rounded once: its
    derivative sigmoid * (1 - sigmoid) loses the sink's share 1 - sigmoid to cancellation
    when the sigmoid, or the logsumexp under it, is rounded to 16 bits (the sink's gradient
    missed the oracle by up to 10x: fuzz findings s3:1142, across:666)."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "div" or not op.dtype.is_float:
            return False
        e, den = graph.operands(node)
        found = _shifted_exp(graph, e)
        if found is None or not _is(graph, den, "add"):
            return False
        x, m = found
        for z, extra in (graph.operands(den), reversed(graph.operands(den))):
            if not (_is(graph, z, "sum") and graph.operands(z) == [e] and graph.op(z).attr("keepdims")):
                continue
            axis = graph.op(z).attr("axis")
            sink = _sink_of(graph, extra, m)
            if sink is None or not (_row_max_of(graph, m, x, axis) or _max_with(graph, m, x, axis, sink)):
                continue
            if not (_only_used_by(graph, e, {node, z}) and _only_used_by(graph, z, {den})
                    and _only_used_by(graph, den, {node}) and _only_used_by(graph, extra, {den})):
                continue
            return self._rewrite(graph, node, op, x, sink, axis, rewriter)
        return False

    @staticmethod
    def _rewrite(graph: Graph, node: int, op: Op, x: Edge, sink: Edge, axis: int, rewriter: Rewriter) -> bool:
        xt, st = graph.result_type(*x), graph.result_type(*sink)
        b, span = rewriter.build, op.span
        if xt.dtype is not op.dtype and xt.dtype.is_float and op.dtype.itemsize > xt.dtype.itemsize:
            # 16-bit scores beside an f32 sink: the written form computes in f32, as this does
            x = (b.op("cast", [x], span, dtype=op.dtype), 0)
            xt = graph.result_type(*x)
        if xt.dtype is not op.dtype or st.dtype is not op.dtype and not st.weak:
            return False
        row_shape = xt.shape[:axis] + (1,) + xt.shape[axis + 1:]
        if broadcast_shapes(row_shape, st.shape) != row_shape:
            return False
        sm = b.op("softmax", [x], span, axis=axis)
        wide = x if xt.dtype is DType.F32 else (b.op("cast", [x], span, dtype=DType.F32), 0)
        lse = b.op("logsumexp", [wide], span, axis=axis, keepdims=True)
        keep = b.op("sigmoid", [b.op("sub", [lse, sink], span)], span)
        if op.dtype is not DType.F32:
            keep = b.op("cast", [keep], span, dtype=op.dtype)
        rewriter.replace(node, b.op("mul", [sm, keep], span))
        return True


def _sink_of(graph: Graph, extra: int, m: Edge) -> Edge | None:
    """`sink` when `extra` = exp(sink - m)."""
    if not _is(graph, extra, "exp"):
        return None
    (d,) = graph.operands(extra)
    if not _is(graph, d, "sub") or graph.operand_edges(d)[1] != m:
        return None
    return graph.operand_edges(d)[0]


def _max_with(graph: Graph, m: Edge, x: Edge, axis: int, sink: Edge) -> bool:
    """Is `m` = maximum(max(x, axis, keepdims=true), sink) (either order)?"""
    if not _is(graph, m[0], "maximum"):
        return False
    a, b = graph.operand_edges(m[0])
    return (b == sink and _row_max_of(graph, a, x, axis)) or (a == sink and _row_max_of(graph, b, x, axis))


@register
@dataclass(frozen=True)
class OnlineSoftmax(Pass):
    name = "online-softmax"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        apply_patterns(graph, (RecognizeSoftmax(), RecognizeSinkSoftmax(), RecognizeLogsumexp(),
                               RecognizeSoftmaxOfLogsumexp(), RecognizeNormalisedProduct()))
