"""Rewrite patterns and the driver that applies them.

A `Pattern` looks at one node and its neighbours and either rewrites through
the `Rewriter` (returning True) or leaves the graph alone (returning False).
The driver owns traversal, the worklist, the fixpoint and the bookkeeping:
nodes whose operands changed are revisited, replaced nodes are erased.

The driver hands a pattern ops only, never a kernel an earlier pass formed (any
pipeline is valid, `passes/registry.py`). A neighbour may be one: a pattern reads a
neighbour's type through its edge (`Graph.result_type(node, res)`, a kernel has a type
per result), matches a neighbour's kind only when it is an `Op`, and replaces with
the edge it read, not the node.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tiledsl.builder import Builder
from tiledsl.ir import Edge, Graph, Op


class Rewriter:
    """The only way a pattern changes the graph: new ops through `build`, then `replace`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.worklist: list[int] = []
        self.changed = False
        self.build = Builder(graph, self)

    def created(self, node: int) -> None:
        """`build` added `node`: its patterns run on it too."""
        self.worklist.append(node)
        self.changed = True

    def replace(self, old: int, new: int | Edge) -> None:
        """Use `new` wherever `old` was used, then erase `old` (and what only it used).
        `new` is a node (its result 0) or a (node, result) value: one result of a kernel."""
        node, res = new if isinstance(new, tuple) else (new, 0)
        users = [u for u, _ in self.graph.users(old)]
        self.graph.replace_uses(old, node, res)
        self.worklist.extend(users)
        self.worklist.append(node)
        self._erase_dead(old)
        self.changed = True

    def _erase_dead(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n not in self.graph.nx or self.graph.nx.out_degree(n):
                continue
            if self.graph.op(n).kind in ("param", "return"):
                continue
            operands = self.graph.operands(n)
            self.graph.remove(n)
            stack.extend(operands)


class Pattern:
    """Match one node; rewrite through the rewriter and return True, or return False."""

    def apply(self, graph: Graph, node: int, op: Op, rewriter: Rewriter) -> bool:
        raise NotImplementedError  # pragma: no cover


def apply_patterns(graph: Graph, patterns: Sequence[Pattern], max_iterations: int = 10) -> bool:
    """Apply patterns until none matches; returns whether anything changed.

    Nodes are visited in topological order; whatever a rewrite touches (new
    nodes, users of replaced ones) is queued again. The work is bounded by
    `max_iterations` visits per node, so a cycle of patterns cannot hang.
    """
    rewriter = Rewriter(graph)
    work = deque(graph.topo_order())
    queued = set(work)
    budget = max_iterations * max(len(work), 1)
    while work and budget > 0:
        budget -= 1
        node = work.popleft()
        queued.discard(node)
        if node not in graph.nx:
            continue
        op = graph.op(node)
        if isinstance(op, Op):
            for pattern in patterns:
                if pattern.apply(graph, node, op, rewriter):
                    break
        for n in rewriter.worklist:
            if n not in queued:
                queued.add(n)
                work.append(n)
        rewriter.worklist.clear()
    return rewriter.changed
