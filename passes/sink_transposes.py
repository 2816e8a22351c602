"""sink-transposes: a scale or cast after the transpose of an attention backward's product
moves before the transpose.

Before: a product of a score space (`passes/fusion/score_space.py`), after its epilogue
and sums over batch axes, transposed and then scaled or cast by an elementwise op that
reads nothing else but scalars: `%t = transpose %p`, `%r = mul %t, %c` (dk derived as
`(q.T @ ds).T * c`).
After: `%m = mul %p, %c`, `%r = transpose %m`, read where `%r` was; repeated while such an
op follows. The op joins the product's epilogue in fuse-attention-backward's kernel, and
the transpose stays a view, stored through the result's strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion import score_space
from tiledsl.passes.fusion.score_space import epilogue, is_op, scalar
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class SinkTransposes(Pass):
    name = "sink-transposes"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for found in score_space.spaces(graph):
            for p in found.products:
                chain = found.batch_sums.get(p.matmul, [])
                _sink(graph, chain[-1] if chain else p.matmul)


def _sink(graph: Graph, node: int) -> None:
    while True:
        node = ([node] + epilogue(graph, node))[-1]  # the epilogue's last op
        users = graph.users(node)
        if len(users) != 1 or not is_op(graph, users[0][0], "transpose"):
            return
        t = users[0][0]
        after = graph.users(t)
        op = graph.op(after[0][0]) if len(after) == 1 else None
        if not isinstance(op, Op) or not ops.is_elementwise(op.kind) or any(
                o != t and not scalar(graph, o) for o in graph.operands(after[0][0])):
            return
        e = after[0][0]
        b = Builder(graph)
        moved = b.copy(op, [(node, 0) if o == t else (o, r) for o, r in graph.operand_edges(e)])
        view = b.copy(graph.op(t), [moved])
        graph.replace_uses(e, view)
        graph.remove(e)
        graph.remove(t)
