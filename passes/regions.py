"""Building kernel regions from groups of graph nodes.

Shared by every pass that forms kernels (lower-kernels now, the fusion passes
later): given the nodes a kernel will compute, `outline` builds its `Region`
and the list of values that flow in from outside. Constants are cloned into
the region instead of becoming inputs; scalar parameters and dims become
by-value inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiledsl.ir import Graph, KernelOp, Op, Region, RegionInput, RegionOp


def is_by_value(op: Op | KernelOp) -> bool:
    """Values passed to kernels by value rather than through a pointer."""
    return isinstance(op, Op) and (op.kind == "dim" or (op.kind == "param" and op.attr("scalar")))


def outline(
    graph: Graph, nodes: Sequence[int], outputs: Sequence[int]
) -> tuple[Region, list[tuple[int, int]]]:
    """The region computing `outputs` from `nodes` (in dependency order).

    Returns the region and, for each region input, the (node, result) it
    reads from outside the group.
    """
    members = set(nodes)
    values: dict[tuple[int, int], int] = {}
    inputs: list[RegionInput] = []
    external: list[tuple[int, int]] = []
    body: list[RegionOp] = []
    consts: dict[int, int] = {}

    # Inputs first: their value ids precede every op's.
    for node in nodes:
        for edge in graph.operand_edges(node):
            src = edge[0]
            if src in members or edge in values or _is_const(graph, src):
                continue
            producer = graph.op(src)
            t = producer.result_types[edge[1]] if isinstance(producer, KernelOp) else producer.type
            values[edge] = len(inputs)
            inputs.append(RegionInput(t, is_by_value(producer)))
            external.append(edge)

    def value_of(edge: tuple[int, int]) -> int:
        if edge in values:
            return values[edge]
        # a constant from outside: clone it into the region once
        if edge[0] not in consts:
            consts[edge[0]] = len(inputs) + len(body)
            body.append(RegionOp(graph.op(edge[0]), ()))
        return consts[edge[0]]

    for node in nodes:
        operands = tuple(value_of(e) for e in graph.operand_edges(node))
        values[(node, 0)] = len(inputs) + len(body)
        body.append(RegionOp(graph.op(node), operands))
    region = Region(tuple(inputs), tuple(body), tuple(values[(n, 0)] for n in outputs))
    return region, external


def _is_const(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind == "const"


def replace_with_kernel(graph: Graph, nodes: Sequence[int], outputs: Sequence[int],
                        template: str, name: str = "k?") -> int:
    """Replace `nodes` by one kernel node computing `outputs`; returns the kernel node.

    Every use of output i moves to result i of the kernel; the grouped nodes
    (and constants only they used) are removed.
    """
    region, external = outline(graph, nodes, outputs)
    span = None
    for n in nodes:
        s = graph.op(n).span
        if s is not None:
            span = s if span is None else span.to(s)
    kernel = graph.add(KernelOp(name, template, region, span), external)
    for i, out in enumerate(outputs):
        graph.replace_uses(out, kernel, new_res=i)
    dead = list(reversed(nodes))
    for n in dead:
        operands = graph.operands(n)
        graph.remove(n)
        for src in operands:
            if _is_const(graph, src) and graph.nx.out_degree(src) == 0:
                graph.remove(src)
    return kernel
