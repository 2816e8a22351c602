"""own-prologues: each score dot and product of an attention backward gets its own copy
of its operands' prologues; a GEMM operand's chain gets its own copy of a widening cast
that other ops read too.

Before: a score dot or product (`passes/fusion/score_space.py`) reads an operand computed
by elementwise ops with scalars from one loaded tensor, `(q * scale) @ k.T`, a widening
cast, possibly through a transpose of them, `ds.T @ (q * scale)`; other ops may read the
same prologue (the forward's `q * scale` read by dq's product and by the score dot).
After: every such matmul reads a copy of its own, a transpose moved onto the tensor the
copy loads (a view and an elementwise op with scalars commute): `%t = transpose %q`,
`%c = mul %t, %scale`, `%m = matmul %c, %ds`. The originals nothing reads now are removed.
fuse-attention-backward computes each copy on the tiles its kernel loads, so no prologue
value is stored.

And for any matmul: its operand computed through elementwise ops each read by nothing else
(a prologue fuse-epilogue may take) from a cast of a parameter that other ops read too
(`xf = cast(x, f32)`, read by the per-token quantizer `cast(xf / s, f8e4m3)` feeding the
GEMM and by `max(abs(xf))` computing `s`) reads a cast of its own: the kernel reading the
operand loads the parameter, no wider than its cast, instead of an f32 tensor another
kernel would store for it. The other readers keep the original.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion import score_space
from tiledsl.passes.fusion.admission import parameter_or_view
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
        for m in graph.topo_order():
            if is_op(graph, m, "matmul"):
                for o in graph.operands(m):
                    _own_casts(graph, o, m)


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


def _own_casts(graph: Graph, node: int, reader: int) -> None:
    """Give the chain computing `node` (elementwise ops each read only by the next, ending at
    `reader`) its own copy of each widening cast of a parameter it reads that others read too."""
    chain, stack = {reader}, [node]
    while stack:
        n = stack.pop()
        op = graph.op(n)
        if n in chain or not isinstance(op, Op) or not ops.is_elementwise(op.kind) or op.type.rank == 0:
            continue
        users = {u for u, _ in graph.users(n)}
        if users <= chain:
            chain.add(n)
            stack.extend(graph.operands(n))
        elif _widening_cast_of_parameter(graph, n):
            copy = Builder(graph).copy(op, graph.operand_edges(n))
            for u in sorted(users & chain):
                graph.set_operands(u, [(copy, 0) if e == (n, 0) else e for e in graph.operand_edges(u)])


def _widening_cast_of_parameter(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    if op.kind != "cast":
        return False
    (src, res), = graph.operand_edges(node)
    return parameter_or_view(graph, src) and graph.result_type(src, res).dtype.itemsize <= op.dtype.itemsize


def _remove_dead(graph: Graph, nodes: list[int]) -> None:
    """Remove the ops among `nodes` that nothing reads now, and what only they read."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in graph.nx and isinstance(graph.op(n), Op) and graph.op(n).kind != "param" \
                and not graph.users(n):
            stack.extend(graph.operands(n))
            graph.remove(n)
