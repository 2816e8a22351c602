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

when the intermediate values have no other use. A row that is all -inf then
gives 0 (softmax) and -inf (logsumexp) instead of the NaN of the written-out
form. Runs before fuse-attention, so a hand-written softmax between two
matmuls is recognised as attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph, Op, make_attrs
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import Pattern, Rewriter, apply_patterns


def _is(graph: Graph, node: int, kind: str) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind == kind


def _row_max_of(graph: Graph, m: int, x: int, axis: int) -> bool:
    """Is `m` = max(x, axis, keepdims=true)?"""
    op = graph.op(m)
    return (_is(graph, m, "max") and graph.operands(m) == [x] and op.attr("axis") == axis
            and bool(op.attr("keepdims")))


def _shifted_exp(graph: Graph, e: int) -> tuple[int, int] | None:
    """(x, m) when `e` = exp(x - m)."""
    if not _is(graph, e, "exp"):
        return None
    (d,) = graph.operands(e)
    return tuple(graph.operands(d)) if _is(graph, d, "sub") else None


def _only_used_by(graph: Graph, node: int, users: set[int]) -> bool:
    return {u for u, _ in graph.users(node)} <= users


def _replace(graph: Graph, node: int, op: Op, kind: str, x: int, rewriter: Rewriter, **attrs) -> bool:
    """Replace `node` by `kind(x, **attrs)` when that has exactly `node`'s type."""
    attrs_t = make_attrs(**attrs)
    if ops.OPS[kind].infer((graph.op(x).type,), dict(attrs_t)) != op.type:
        return False
    rewriter.replace(node, rewriter.create(Op(kind, op.dtype, op.shape, attrs_t, op.span), [x]))
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


class RecognizeLogsumexp(Pattern):
    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        if op.kind != "add":
            return False
        for m, lg in (graph.operands(node), reversed(graph.operands(node))):
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


@register
@dataclass(frozen=True)
class OnlineSoftmax(Pass):
    name = "online-softmax"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        apply_patterns(graph, (RecognizeSoftmax(), RecognizeLogsumexp()))
