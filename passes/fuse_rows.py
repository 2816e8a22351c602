"""fuse-rows: row programs become one kernel each.

Before: reductions (sum, max, min, mean, logsumexp, prod, argmax...) and softmax along an
axis, surrounded by elementwise ops that read the same rows, each op its own
kernel (rmsnorm is 8 kernels, layernorm 10).
After: each maximal such group is one `rows` kernel: the reductions along
the row axes of one shape S, the elementwise ops before and after them whose
dims map onto S consistently, and further reductions along the same axes
that depend on earlier ones (layernorm's variance after its mean). The row
axes are the seed's axis, or its axes: a reduction over several axes (one op
per axis from sema, `legality.continues_reduction`) is one reduction over a
row of their elements, adjacent or not (batch norm's axes 0, 2 and 3 of
NCHW, one program per channel). Values used outside the group are stored by
the kernel too.

Refused, with a recorded rule: a reduction along another axis or of another
shape, or along some of the row axes only, an op that reads a group value at another index (a reduced row
broadcast along the row, a transpose) or does not fit S ("other-index",
"tile"), a value used outside the group that does not vary along the rows
("tile": every row would store it), and anything that would create a cycle;
and, as not worth it ("profit"), a group past `MAX_ROW_PHASES` dependent
reductions or `MAX_ROW_OPS` ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.indexing import permuted_axis
from tiledsl.ir import Graph, Op, Region, walk
from tiledsl.passes.fusion.grow import (
    Admission,
    broadcast_axes,
    candidate_kind,
    computed_view,
    fuse_groups,
    outputs_of,
)
from tiledsl.passes.fusion.legality import (
    PASS_OPS,
    ROW_OPS,
    GroupPlan,
    RowSpace,
    across_reductions,
    continues_reduction,
    gathers_within,
    partial_reductions,
    reduced_axes,
    row_layouts,
    selected,
    short_across,
)
from tiledsl.passes.fusion.profitability import MAX_ROW_OPS, MAX_ROW_PHASES
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.fusion.spec import RowSpec
from tiledsl.passes.regions import outline
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class FuseRows(Pass):
    name = "fuse-rows"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def consider(node: int) -> bool:
            kind = graph.op(node).kind
            return candidate_kind(graph, node) and (ops.is_elementwise(kind) or kind in ROW_OPS
                                                    or _permuted_put(graph, node)) \
                or computed_view(graph, node) and _read_by_row_ops(graph, node)

        def admit_for(plan: GroupPlan, seed: int) -> Admission:
            x = graph.result_type(*graph.operand_edges(seed)[0])
            if graph.op(seed).kind in ROW_OPS:
                chain = [graph.op(seed), *_continuing(graph, seed, plan)]
                space = RowSpace(x.shape, _row_axes(x.shape, chain))
            else:  # an elementwise op reading a computed value broadcast along `axes`
                space = RowSpace(graph.op(seed).shape, broadcast_axes(graph, seed))
            # reductions whose continuation did not join, views read outside (`settle`)
            unjoined: set[int] = set()

            def admit(group: set[int], cand: int) -> Refusal | None:
                if cand in unjoined and ops.category(graph.op(cand).kind) is ops.Category.LAYOUT:
                    return Refusal(Rule.OP, f"{graph.op(cand).kind} is read outside the row program, "
                                   "which reads the value it views through its strides")
                if cand in unjoined:
                    return Refusal(Rule.TILE, f"{graph.op(cand).kind} reduces some of the row program's "
                                   "axes only, and the rest of its reduction did not join it")
                return _admit(graph, plan, group, cand, space)

            def settle(members: list[int]) -> set[int]:
                found = _unjoined(graph, plan, members, space) - {seed}
                unjoined.update(found)
                return found

            return Admission(admit, lambda members: RowSpec(space), settle)

        _unshare_reductions(graph)

        def along_the_row(node: int) -> bool:
            """Not a column sum (a reduction along the leading dim alone, no part of one over
            several axes: a weight's or bias's gradient), which is seeded last: grown first
            from a cast of the gradient it reads, it would take the ops a norm's backward
            along the row needs (split, that row program sums the columns too)."""
            op = graph.op(node)
            if isinstance(op, Op) and op.kind not in ROW_OPS:  # a broadcast join: after every reduction's
                return False
            if not isinstance(op, Op) or ops.category(op.kind) is not ops.Category.REDUCTION:
                return True
            source = graph.operand_edges(node)[0]
            return graph.result_type(*source).rank < 2 or op.attr("axis") != 0 \
                or continues_reduction(graph.op(source[0]), op) \
                or any(continues_reduction(op, graph.op(u)) for u, _ in graph.users(node))

        def is_seed(node: int) -> bool:
            return graph.op(node).kind in ROW_OPS or bool(broadcast_axes(graph, node))

        fuse_groups(graph, ctx.remarks, self.name, is_seed, consider, admit_for, first=along_the_row,
                    related=lambda node: _same_sort(graph, node))


def _read_by_row_ops(graph: Graph, node: int) -> bool:
    """Is a view read, through views, by an op a row program may hold (an elementwise op, a
    reduction)? One that only a matmul or an attention reads is read through its strides."""
    def views(n: int) -> list[int]:
        return [u for u, _ in graph.users(n)
                if isinstance(op := graph.op(u), Op) and ops.category(op.kind) is ops.Category.LAYOUT]

    return any(isinstance(op := graph.op(u), Op) and (ops.is_elementwise(op.kind) or op.kind in ROW_OPS)
               for n in walk([node], views) for u, _ in graph.users(n))


def _permuted_put(graph: Graph, node: int) -> bool:
    """A put at a sort's positions along a row (each element once): a row program holding the
    sort stores its values there."""
    op = graph.op(node)
    return op.kind == "put" and not op.attr("accumulate") \
        and permuted_axis(graph, graph.operand_edges(node)[1:], op.shape) is not None


def _same_sort(graph: Graph, node: int) -> list[int]:
    """The other selections of one sort (topk's values and argtopk's positions of one row and
    attributes): a row program holding one computes the others from the same keys, so they
    are its candidates though they share no value (top-p's sorted values and the positions it
    scatters them back to); and beside the positions, the other indices of the puts at them
    (each row's own index), which such a put reads before it can join."""
    op = graph.op(node)
    if not isinstance(op, Op) or op.kind not in ("topk", "argtopk"):
        return []
    source = graph.operand_edges(node)[0]
    out = [u for u, slot in graph.users(source[0]) if u != node and slot == 0
           and graph.operand_edges(u)[0] == source and isinstance(o := graph.op(u), Op)
           and o.kind in ("topk", "argtopk") and o.attr_map == op.attr_map]
    for put, _ in graph.users(node):
        if _permuted_put(graph, put):
            out += [i for i in graph.operands(put)[1:] if i != node]
    return out


def _unshare_reductions(graph: Graph) -> None:
    """A reduction that several reductions continue (cse shares the first op of
    `sum(x, axis=(0, 2))` and of `sum(x, axis=None)`) gets a copy per continuing user:
    each is then one reduction over its own axes, not partial sums stored between two (in
    a half dtype, rounded twice). Users first: a copy's operand may be shared in turn."""
    for node in reversed(graph.topo_order()):
        op = graph.op(node)
        if not isinstance(op, Op) or op.kind not in ROW_OPS or len(users := graph.users(node)) < 2:
            continue
        continuing = [u for u, _ in users if continues_reduction(op, graph.op(u))]
        for user in continuing[1:] if len(continuing) == len(users) else continuing:
            graph.set_operands(user, [graph.add(op, graph.operand_edges(node))])


def _admit(graph: Graph, plan: GroupPlan, group: set[int], cand: int,
           space: RowSpace) -> Refusal | None:
    # the rest of a reduction over several axes always joins: what it reduces is never stored
    continuing = any(continues_reduction(graph.op(x), graph.op(cand)) for x in graph.operands(cand)
                     if x in group)
    if len(group) >= MAX_ROW_OPS and not continuing:
        return Refusal(Rule.PROFIT, f"a row program holds at most {MAX_ROW_OPS} ops")
    if (gather := gathers_within(graph, cand, group)) is not None:
        return Refusal(Rule.OTHER_INDEX, gather)
    members = sorted(group | {cand}, key=plan.order.__getitem__)
    region, _, _ = outline(graph, members, members)
    layouts = row_layouts(region, space)
    if isinstance(layouts, Refusal):
        return layouts
    across_dim, across = across_reductions(region, space, layouts)
    value = region.outputs[members.index(cand)]
    if value in across and _continuing(graph, cand, plan):
        return Refusal(Rule.TILE, f"{graph.op(cand).kind} begins a reduction over several axes across the "
                       "row program's rows: a row program of its own reduces them all")
    if _phases(region, across) > MAX_ROW_PHASES:
        return Refusal(Rule.PROFIT, f"a row program reads its rows at most {MAX_ROW_PHASES + 1} times "
                       f"({MAX_ROW_PHASES} dependent reductions); storing an intermediate costs less")
    # a value that does not vary along the dim reductions run across the rows of is stored by
    # the first of those rows
    kept = [d for d in range(len(space.shape))
            if d not in space.axes and space.shape[d] != 1 and d != across_dim]
    outputs = set(outputs_of(graph, members))
    partial = partial_reductions(region, space, layouts)
    for node, value in zip(members, region.outputs, strict=True):  # outputs = members, in order
        if node in outputs and value in partial:  # stored unless the rest of its reduction joins
            layout, chain = layouts[value], _continuing(graph, node, plan)
            if not space.runs & set(layout) <= {layout[a] for a in reduced_axes(len(layout), chain)}:
                return Refusal(Rule.TILE, f"{graph.op(node).kind} is used outside the row program but "
                               "reduces only some of its axes")
        elif node in outputs and not set(kept) <= set(layouts[value]):
            return Refusal(Rule.TILE, f"{graph.op(node).kind} is used outside the row program but does "
                           "not vary along every row dim, so every row would store it")
    return None


def _unjoined(graph: Graph, plan: GroupPlan, members: list[int], space: RowSpace) -> set[int]:
    """The reductions of a grown group that reduce only some of its axes, are used outside
    it, and whose continuing reductions (`_admit` admitted them for) did not all join: the
    kernel would store a value it never computes; and the views read outside it, which the
    kernel would store beside the value they view (that reader reads the value through the
    view's strides, as before the view joined)."""
    views = {node for node in outputs_of(graph, members)
             if ops.category(graph.op(node).kind) is ops.Category.LAYOUT}
    if views:
        return views
    region, _, _ = outline(graph, members, members)
    layouts = row_layouts(region, space)
    if isinstance(layouts, Refusal):
        return set()
    partial = partial_reductions(region, space, layouts)
    inside, outputs = set(members), set(outputs_of(graph, members))
    return {node for node, value in zip(members, region.outputs, strict=True)
            if node in outputs and value in partial
            and not set(_continuing_nodes(graph, node, plan)) <= inside}


def _row_axes(shape: tuple, chain: list) -> tuple[int, ...]:
    """The axes a row program's rows run along, for a seed reduction and the reductions that
    continue it (one over several axes): all of them, except that the last one of a
    reduction of every axis (a global norm, a loss's mean: `axis=None`, which sema writes
    last axis first) reduces the leading dim across the rows when the call sizes it, split
    over programs (`legality.short_across`), not along one row of every element that a
    single program walks."""
    axes = reduced_axes(len(shape), chain)
    if len(chain) < 2 or len(axes) != len(shape):
        return axes
    inner = reduced_axes(len(shape), chain[:-1])
    if 0 in inner or short_across(RowSpace(shape, inner), 0):
        return axes
    return inner


def _continuing(graph: Graph, node: int, plan: GroupPlan) -> list:
    """The reductions (ops) of `_continuing_nodes`."""
    return [graph.op(n) for n in _continuing_nodes(graph, node, plan)]


def _continuing_nodes(graph: Graph, node: int, plan: GroupPlan) -> list[int]:
    """The reductions that reduce what the reduction `node` leaves, one after another (the
    rest of a reduction over several axes), each the only user of the one before and in no
    row program yet (one that another seed's group took is no longer this one's to reduce)."""
    chain = []
    while len(users := graph.users(node)) == 1 and not plan.grouped(user := users[0][0]) \
            and continues_reduction(graph.op(node), graph.op(user)):
        node = user
        chain.append(node)
    return chain


def _phases(region: Region, across: frozenset[int]) -> int:
    """The longest chain of reductions that each need the one before (layernorm: 2); the
    reductions of one over several axes count once, those `across` the rows not at all."""
    n_in = len(region.inputs)
    phase = [0] * (n_in + len(region.ops))
    chosen = selected(region)  # a reduction of a selection reads no row
    for i, rop in enumerate(region.ops):
        p = max((phase[o] for o in rop.operands), default=0)
        continued = len(rop.operands) == 1 and rop.operands[0] >= n_in and continues_reduction(
            region.ops[rop.operands[0] - n_in].op, rop.op)
        own = rop.op.kind in PASS_OPS and not continued and rop.operands[0] not in chosen \
            and n_in + i not in across
        phase[n_in + i] = p + 1 if own else p
    return max(phase, default=0)
