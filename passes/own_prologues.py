"""own-prologues: each score dot and product of an attention backward gets its own copy
of its operands' prologues.

Before: a score dot or product (`passes/fusion/score_space.py`) reads an operand computed
by elementwise ops with scalars from one loaded tensor, `(q * scale) @ k.T`, a widening
cast, possibly through a transpose of them, `ds.T @ (q * scale)`; other ops may read the
same prologue (the forward's `q * scale` read by dq's product and by the score dot).
After: every such matmul reads a copy of its own, a transpose moved onto the tensor the
copy loads (a view and an elementwise op with scalars commute): `%t = transpose %q`,
`%c = mul %t, %scale`, `%m = matmul %c, %ds`. The originals nothing reads now are removed.
fuse-attention-backward computes each copy on the tiles its kernel loads, so no prologue
value is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion import score_space
from tiledsl.passes.fusion.score_space import is_op, is_prologue, prologue_ops
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class OwnPrologues(Pass):
    name = "own-prologues"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for found in score_space.spaces(graph):
            for m in found.dots + [p.matmul for p in found.products]:
                edges = graph.operand_edges(m)
                if any(prologue_ops(graph, o) for o, _ in edges):
                    graph.set_operands(m, [(_copy(graph, o), 0) if prologue_ops(graph, o) else (o, r)
                                           for o, r in edges])
                    _remove_dead(graph, [o for o, _ in edges])


def _copy(graph: Graph, node: int, transpose: Op | None = None) -> int:
    """A copy of the prologue `node` (of a transpose of one: the prologue of the transposed
    tensor, in its shape) for one dot's use."""
    if transpose is None and is_op(graph, node, "transpose"):
        transpose, (node,) = graph.op(node), graph.operands(node)
    b = Builder(graph)
    edges = []
    for src, res in graph.operand_edges(node):
        if is_prologue(graph, src):
            edges.append((_copy(graph, src, transpose), 0))
        elif transpose is not None and not score_space.scalar(graph, src):  # the loaded tensor, transposed
            edges.append((b.copy(transpose, [(src, res)]), 0))
        else:
            edges.append((src, res))
    return b.copy(graph.op(node), edges)


def _remove_dead(graph: Graph, nodes: list[int]) -> None:
    """Remove the ops among `nodes` that nothing reads now, and what only they read."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in graph.nx and isinstance(graph.op(n), Op) and graph.op(n).kind != "param" \
                and not graph.users(n):
            stack.extend(graph.operands(n))
            graph.remove(n)
