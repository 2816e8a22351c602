"""dce: dead code elimination.

Before: nodes whose values never reach the return (an unused assignment, the
operand `x` of `index(x, axis)`, constants folded away).
After: only the return node, what it transitively uses, and every parameter
(parameters are the kernel's interface and stay even when unused).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from tiledsl.ir import Graph
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class DCE(Pass):
    name = "dce"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        live = nx.ancestors(graph.nx, graph.output) | {graph.output} | set(graph.params)
        graph.remove_all([n for n in list(graph.nx.nodes) if n not in live])
