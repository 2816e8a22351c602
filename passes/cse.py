"""cse: common subexpression elimination.

Before: two nodes with the same kind, type, attributes and operands (e.g.
`cast(x, f32) * cast(x, f32)`, or `causal(s)` written twice).
After: one of them (the first in topological order) serves every use; the
others are gone. Spans are ignored when comparing, so equal expressions on
different lines merge. Parameters and the return node are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ir import Graph, KernelOp
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class CSE(Pass):
    name = "cse"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        seen: dict[tuple, int] = {}
        for node in graph.topo_order():
            op = graph.op(node)
            if op.kind in ("param", "return"):
                continue
            ident = op.replace(span=None) if isinstance(op, KernelOp) else op.key()
            key = (ident, tuple(graph.operand_edges(node)))
            first = seen.setdefault(key, node)
            if first != node:
                graph.replace_uses(node, first)
                graph.remove(node)
