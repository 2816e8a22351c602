"""cse: common subexpression elimination.

Before: two nodes with the same kind, type, attributes and operands (e.g.
`cast(x, f32) * cast(x, f32)`, or `causal(s)` written twice).
After: one of them (the first in topological order) serves every use; the
others are gone. Spans are ignored when comparing, so equal expressions on
different lines merge. Parameters and the return node are never merged.

A product is also the transpose of another: `b @ a.T` is `(a @ b.T).T` (open_clip's
logits per text and per image, each from both feature sets). The later one becomes a
transpose of the first (a view: its readers read the one product through swapped
strides), so one GEMM computes both. The two sum the same products over K (exactly so
in f64; a tensor core's order within a K block is its own), so the numerics do not move.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from tiledsl.builder import Builder
from tiledsl.ir import Edge, Graph, KernelOp, Op
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class CSE(Pass):
    name = "cse"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        seen: dict[tuple, int] = {}
        visited: set[int] = set()
        for node in graph.topo_order():
            visited.add(node)
            op = graph.op(node)
            if op.kind in ("param", "return"):
                continue
            ident = op.replace(span=None) if isinstance(op, KernelOp) else op.key()
            key = (ident, tuple(graph.operand_edges(node)))
            first = seen.setdefault(key, node)
            if first != node:
                graph.replace_uses(node, first)
                graph.remove(node)
            elif (view := merge_transposed_product(graph, node, visited)) is not None:
                seen[key] = view  # (the same product written again is that view too)


def transposed_operand(graph: Graph, value: Edge) -> Edge | None:
    """The value a transpose of the last two dims reads (None: `value` is no such transpose)."""
    op = graph.op(value[0])
    if isinstance(op, Op) and op.kind == "transpose" and sorted(op.attr("dims")) == [op.type.rank - 2,
                                                                                     op.type.rank - 1]:
        return graph.operand_edges(value[0])[0]
    return None


def merge_transposed_product(graph: Graph, mm: int, earlier: Container[int]) -> int | None:
    """If `mm` is `b @ a.T` and a node of `earlier` (before it in program order) computes
    `a @ b.T` (same dtype and attributes), make `mm` a transpose of that product; the
    transpose's node when it did."""
    op = graph.op(mm)
    if not (isinstance(op, Op) and op.kind == "matmul" and op.type.rank >= 2):
        return None
    b, t = graph.operand_edges(mm)
    a = transposed_operand(graph, t)
    if a is None:
        return None
    for user, slot in graph.users(a[0]):
        other = graph.op(user)
        if user == mm or slot != 0 or not isinstance(other, Op) or other.kind != "matmul" \
                or (other.dtype, other.attrs, other.weak) != (op.dtype, op.attrs, op.weak):
            continue
        first, second = graph.operand_edges(user)
        if user in earlier and first == a and transposed_operand(graph, second) == b:
            rank = op.type.rank
            view = Builder(graph).op("transpose", [(user, 0)], op.span, dims=(rank - 2, rank - 1))
            graph.replace_uses(mm, view)
            graph.remove(mm)
            return view
    return None
