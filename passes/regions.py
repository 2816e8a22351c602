"""Building kernel regions from groups of graph nodes.

Shared by every pass that forms kernels (the fusion passes and lower-kernels):
given the nodes a kernel will compute, `outline` builds its `Region` and the
list of values that flow in from outside, and `replace_with_kernel` puts the
kernel, with the plan of the spec the pass gave (`fusion.spec`, `fusion.planning`), in their
place. Constants and scalar
expressions (rank-0 elementwise ops on constants, dims and scalar parameters,
like `rsqrt(D) * N`) are cloned into every region that reads them instead of
becoming inputs: they cost nothing to recompute, and a 0-d value never has to
be stored by one kernel for another. So are index expressions (`index` ops and
elementwise ops on them, scalars and constants, like the shifted index of a
`concat`, and loads through them from an index array) where every user computes
them over its own tile, and values the recompute pass marked (cheap expressions of
a smaller shape than their readers, like `sqrt(abs(y))` with `y: [N]` read at
`[M, N]`). Scalar parameters and dims become by-value inputs; the tensors a
recomputed value reads become ordinary inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op, Region, RegionInput, RegionOp
from tiledsl.passes.fusion.planning import plan_kernel
from tiledsl.passes.fusion.spec import MergedSpec, Spec, in_region
from tiledsl.plans import Member


def is_by_value(op: Op | KernelOp) -> bool:
    """Values passed to kernels by value rather than through a pointer."""
    return isinstance(op, Op) and (op.kind == "dim" or (op.kind == "param" and op.attr("scalar")))


def is_clonable(graph: Graph, node: int, memo: dict[int, bool] | None = None) -> bool:
    """A constant, a scalar or index expression, or a recomputed value: cloned into each
    kernel that reads it.

    Answers are memoized on the graph until it changes (or in `memo`), which keeps
    a long chain of scalar statements linear.
    """
    memo = graph.memo("clonable") if memo is None else memo
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        op = graph.op(n)
        if not isinstance(op, Op) or op.kind in ("param", "dim"):  # inputs, never cloned
            memo[n] = False
        elif op.kind == "const" or graph.recomputed(n):
            memo[n] = True
        elif op.shape != () and not _index_expression_users(graph, n):
            memo[n] = False
        elif op.kind == "index":
            memo[n] = True
        elif not ops.is_elementwise(op.kind):
            memo[n] = False
        else:  # a gathered operand is read through its pointer: any stored tensor will do
            read = [o for slot, o in enumerate(graph.operands(n)) if not ops.gathers_at(op.kind, slot)]
            pending = [o for o in read if o not in memo and not _leaf(graph, o)]
            if pending:
                stack.extend(pending)
                continue
            memo[n] = all(_leaf(graph, o) or memo[o] for o in read)
        stack.pop()
    return memo[node]


def _index_expression_users(graph: Graph, node: int) -> bool:
    """Can every user of `node` compute it over its own tile? Elementwise ops (not
    gathering from it), reductions and softmax can, unless the value reaches a matmul
    operand through elementwise ops (a dot prologue reads tensors, not tile indices); a
    view, a returned value, or a kernel that reads it as an input needs it stored."""
    for user, slot in graph.users(node):
        op = graph.op(user)
        if isinstance(op, KernelOp):
            return False  # it reads a stored copy: formed when the value was not clonable
        if ops.gathers_at(op.kind, slot) or not (ops.is_elementwise(op.kind) or op.kind in ops.ROW_KINDS):
            return False
    return not feeds_dot(graph, node)


def feeds_dot(graph: Graph, node: int) -> bool:
    """Does `node` reach a matmul operand through elementwise ops? Not through the index of
    a gather: a kernel loading a gathered dot operand computes its index over the tile."""
    memo = graph.memo("feeds-dot")
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen or memo.get(n) is False:
            continue
        seen.add(n)
        for user, slot in graph.users(n):
            op = graph.op(user)
            if isinstance(op, Op) and op.kind == "matmul":
                return True
            if isinstance(op, Op) and ops.is_elementwise(op.kind) and not (
                    op.kind == "take" and not ops.gathers_at(op.kind, slot)):
                stack.append(user)
    memo.update(dict.fromkeys(seen, False))
    return False


def _leaf(graph: Graph, node: int) -> bool:
    """A value a cloned scalar expression reads from outside: a dim or a scalar parameter."""
    return is_by_value(graph.op(node))


def outline(
    graph: Graph, nodes: Sequence[int], outputs: Sequence[int], memo: dict[int, bool] | None = None
) -> tuple[Region, list[tuple[int, int]], dict[int, int]]:
    """The region computing `outputs` from `nodes` (in dependency order).

    Returns the region, for each region input the (node, result) it reads from outside
    the group, and the region value of each of `nodes`. `memo`: see `is_clonable`.
    """
    members = set(nodes)
    values: dict[tuple[int, int], int] = {}
    inputs: list[RegionInput] = []
    external: list[tuple[int, int]] = []
    body: list[RegionOp] = []
    def clone(node: int) -> bool:
        return is_clonable(graph, node, memo)

    # Inputs first: their value ids precede every op's. The leaves of a cloned
    # scalar expression (dims, scalar parameters) are inputs too.
    stack = [e for node in reversed(nodes) for e in reversed(graph.operand_edges(node))]
    while stack:
        edge = stack.pop()
        src = edge[0]
        if src in members or edge in values:
            continue
        if clone(src):
            stack.extend(reversed(graph.operand_edges(src)))
            continue
        producer = graph.op(src)
        t = producer.result_types[edge[1]] if isinstance(producer, KernelOp) else producer.type
        values[edge] = len(inputs)
        inputs.append(RegionInput(t, is_by_value(producer)))
        external.append(edge)

    def value_of(edge: tuple[int, int]) -> int:
        if edge in values:
            return values[edge]
        # a constant or scalar expression from outside: clone it into the region once
        pending = [edge[0]]
        while pending:
            n = pending[-1]
            missing = [e[0] for e in graph.operand_edges(n) if e not in values]
            if missing:
                pending.extend(missing)
                continue
            pending.pop()
            if (n, 0) not in values:
                values[(n, 0)] = len(inputs) + len(body)
                body.append(RegionOp(graph.op(n), tuple(values[e] for e in graph.operand_edges(n))))
        return values[edge]

    for node in nodes:
        operands = tuple(value_of(e) for e in graph.operand_edges(node))
        values[(node, 0)] = len(inputs) + len(body)
        body.append(RegionOp(graph.op(node), operands))
    region = Region(tuple(inputs), tuple(body), tuple(values[(n, 0)] for n in outputs))
    # the members' values and those of the clones computed inside (a spec may name an index
    # expression a member reads: a grouped GEMM's per-row index)
    return region, external, {n: v for (n, r), v in values.items() if r == 0 and v >= len(inputs)}


def replace_with_kernel(graph: Graph, nodes: Sequence[int], outputs: Sequence[int],
                        spec: Spec, name: str = "k?") -> int:
    """Replace `nodes` by one kernel node computing `outputs`, planned from the pass's `spec`
    (its nodes renumbered as the region's values, `fusion.planning`); returns the kernel node.

    Every use of output i moves to result i of the kernel; the grouped nodes
    (and constants only they used) are removed.
    """
    # removing members changes no answer about what they read (only about their users)
    memo: dict[int, bool] = {}
    region, external, values = outline(graph, nodes, outputs, memo)
    span = None
    for n in nodes:
        s = graph.op(n).span
        if s is not None:
            span = s if span is None else span.to(s)
    plan = plan_kernel(region, in_region(spec, values))
    kernel = graph.add(KernelOp(name, plan.template, region, span, plan=plan), external)
    for i, out in enumerate(outputs):
        graph.replace_uses(out, kernel, new_res=i)
    members = set(nodes)
    for n in reversed(nodes):
        operands = graph.operands(n)
        graph.remove(n)
        members.discard(n)
        remove_dead_clonables(graph, [o for o in operands if o not in members], memo)
    return kernel


def remove_dead_clonables(graph: Graph, nodes: Sequence[int],
                          memo: dict[int, bool] | None = None) -> None:
    """Remove the constants and scalar expressions among `nodes` (and, in turn, among
    their operands) that nothing uses any more. `memo`: see `is_clonable`."""
    memo = {} if memo is None else memo
    stack = list(nodes)
    while stack:
        n = stack.pop()
        # `not succ[n]` is O(1); a multigraph's out_degree counts every edge (a dim has many)
        if n in graph.nx and not is_by_value(graph.op(n)) and not graph.nx.succ[n] \
                and graph.output != n and is_clonable(graph, n, memo):
            operands = graph.operands(n)
            graph.remove(n)
            stack.extend(operands)


def merged_region(graph: Graph, nodes: Sequence[int]) -> tuple[Region, list[tuple[int, int]], list[Member]]:
    """The region computing the results of kernels `nodes`, in program order, the (node,
    result) each of its inputs reads (inputs they share become one), and each kernel's place
    in it: a `Member` with the kernel's own plan (its part of the region, `Region.part`, is
    the kernel's region). A kernel reading an earlier one's result reads its value (which
    stays a result of the merged kernel: `plans.MergedPlan` says when that may be)."""
    edges: dict[tuple[int, int], int] = {}
    inputs: list[RegionInput] = []
    body: list[RegionOp] = []
    outputs: list[int] = []
    kernels = [graph.op(n) for n in nodes]
    for node, kernel in zip(nodes, kernels, strict=True):
        for e, inp in zip(graph.operand_edges(node), kernel.region.inputs, strict=True):
            if e not in edges and e[0] not in nodes:
                edges[e] = len(inputs)
                inputs.append(inp)
    n_in = len(inputs)
    members = []
    produced: dict[tuple[int, int], int] = {}  # a member's (node, result) -> its value
    for node, kernel in zip(nodes, kernels, strict=True):
        region = kernel.region
        local = [produced[e] if e in produced else edges[e] for e in graph.operand_edges(node)]
        base = n_in + len(body)
        values = tuple(base + i for i in range(len(region.ops)))
        members.append(Member(tuple(local), values,
                              tuple(range(len(outputs), len(outputs) + len(region.outputs))), kernel.plan))
        local += values
        body.extend(RegionOp(r.op, tuple(local[v] for v in r.operands)) for r in region.ops)
        outputs.extend(local[v] for v in region.outputs)
        produced.update(((node, r), local[v]) for r, v in enumerate(region.outputs))
    return Region(tuple(inputs), tuple(body), tuple(outputs)), list(edges), members


def merge_kernels(graph: Graph, nodes: Sequence[int], spec: Spec | None = None) -> int:
    """Replace independent kernels by one kernel computing all their results (horizontal
    fusion), planned from `spec` (the kernels' shared iteration space, in region values), or,
    with no spec, a merged launch whose members are the kernels with their own plans
    (`MergedSpec`). Only a merged launch's member may read another's result."""
    kernels = [graph.op(n) for n in nodes]
    region, edges, members = merged_region(graph, nodes)
    span = None
    for k in kernels:
        if k.span is not None:
            span = k.span if span is None else span.to(k.span)
    plan = plan_kernel(region, spec if spec is not None else MergedSpec(tuple(members)))
    merged = graph.add(KernelOp("k?", plan.template, region, span, plan=plan), edges)
    offset = 0
    for node, kernel in zip(nodes, kernels, strict=True):
        for r in range(len(kernel.region.outputs)):
            graph.replace_uses(node, merged, new_res=offset + r, old_res=r)
        offset += len(kernel.region.outputs)
        graph.remove(node)
    return merged
