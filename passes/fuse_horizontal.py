"""fuse-horizontal: independent kernels over one iteration space become one kernel with
several outputs.

Before: kernels that share inputs but no value (RoPE's q and k rotations, reading the same
cos and sin tables; `max(x)` and `min(x)` of the same rows), each launched on its own and
each reading the shared inputs again.
After: one kernel per set of them, computing every output; a shared input is read once.

Merged: pointwise kernels over the same shape, and row programs over the same space and
axis (their merged region must still be a row program: `legality.row_layouts`), when
- neither depends on the other, through any path (legality: "cycle");
- they share a tensor input (the merged kernel reads it once: the modelled saving), or
  both are small and fixed in size (`profitability.LAUNCH_BOUND_BYTES`), so each would be
  launch-bound, or both are reductions (row programs whose every output is reduced along
  their axis: a bias's and a weight's gradient, column sums of different tensors), whose
  merged loop costs nothing and saves a launch;
- the merged row program stays within `MAX_ROW_OPS` ops and `MAX_ROW_PHASES` phases.
Then, in a second walk, such kernels over different spaces (q-norm and k-norm with H and KH
heads; RoPE of q and k with H != KH; several feature normalizations of one loss) become one
launch of the merged template (`plans.MergedPlan`): its programs are partitioned among them,
each running its own code and plan, so nothing is read once that was read twice, but a launch
is saved. Merged on the same rules (independent; a shared input, launch-bound, or reductions),
while the launch stays within `MAX_ROW_OPS` ops (its source and compile time); a kernel over
a space another member has is left to the first walk, and a dependent pair to vertical
fusion's remarks, except a split row program whose combine alone reads 0-d results of the
members (a global norm over several tensors: the last sum of squares adds the others' in its
combine, which runs after every member's programs and the combines before it).
Each merge is a fused remark; kernels that share an input but may not merge get a refusal.
Must run after the other fusion passes, which form the kernels it merges.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import cost, ops
from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.passes.fusion.legality import (
    Group,
    GroupPlan,
    RowSpace,
    across_reductions,
    row_layouts,
    short_across,
    split_tail,
    view_dims,
)
from tiledsl.passes.fusion.profitability import LAUNCH_BOUND_BYTES, MAX_ROW_OPS, MAX_ROW_PHASES
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.fusion.spec import PointwiseSpec, RowSpec
from tiledsl.passes.regions import merge_kernels, merged_region
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.plans import PointwisePlan, RowPlan
from tiledsl.types import format_shape

NAME = "fuse-horizontal"


@register
@dataclass(frozen=True)
class FuseHorizontal(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for key, members in _groups(graph, ctx, _spaces, _refusal):
            merge_kernels(graph, members, _spec(key))
        for _, members in _groups(graph, ctx, _launch, _launch_refusal):
            merge_kernels(graph, members)


def _groups(graph: Graph, ctx: PassContext, keys_of, refusal_of) -> list[tuple[tuple, list[int]]]:
    """The groups of kernels to merge, each with the key it merged over and its members in
    program order, with a fused remark each: a kernel joins the first group that
    `refusal_of` allows among those over one of its `keys_of` (the first its own plan's, any
    other a space it may be planned over too) that it shares an input with (or, launch-bound,
    groups of launch-bound kernels; a reduction, the last group of reductions). A group is
    over every key of its seed until a kernel joins it over one. Refusals of kernels that
    share an input are remarks too; `SKIP` passes a group over silently."""
    plan = GroupPlan(graph)
    groups: list[Group] = []
    group_keys: list[tuple[tuple, ...]] = []  # the keys each group may still merge over
    by_input: dict[tuple, dict[int, None]] = {}  # (key, input edge) -> groups reading it
    small: dict[tuple, dict[int, None]] = {}  # key -> groups of launch-bound kernels
    reducing: dict[tuple, int] = {}  # key -> the last group of reductions over it
    for node in graph.topo_order():
        op = graph.op(node)
        keys = keys_of(op) if isinstance(op, KernelOp) else ()
        if not keys:
            continue
        # only groups that share an input with the kernel (or, for a launch-bound kernel,
        # groups of launch-bound ones) are tried: merging stays linear in the program
        inputs = _inputs(graph, node)
        tried: dict[tuple[int, tuple], None] = {}
        for key in keys:
            tried.update(dict.fromkeys((g, key) for e in inputs for g in by_input.get((key, e), {})))
            if _launch_bound(graph, node):
                tried.update(dict.fromkeys((g, key) for g in small.get(key, {})))
            if _reduces(op) and key in reducing:
                tried[reducing[key], key] = None
        for gid, key in tried:
            group = groups[gid]
            if key not in group_keys[gid]:
                continue
            refusal = refusal_of(graph, plan, group, node, key)
            if refusal is None:
                group.add(node)
                plan.groups[gid].append(node)
                plan.group_of[node] = gid
                group_keys[gid] = (key,)
                break
            if refusal is not SKIP and _shared(graph, group, node):
                ctx.remarks.append(FusionRemark.refused(NAME, refusal, _first_op(graph, group.seed),
                                                        _first_op(graph, node)))
        else:
            gid = len(groups)
            groups.append(Group(plan, node))
            group_keys.append(keys)
            plan.add_group([node])
        for key in group_keys[gid]:
            for e in inputs:
                by_input.setdefault((key, e), {})[gid] = None
            if _launch_bound(graph, node) and all(_launch_bound(graph, m) for m in groups[gid]):
                small.setdefault(key, {})[gid] = None
            if all(_reduces(graph.op(m)) for m in groups[gid]):
                reducing[key] = gid
    merged = []
    for gid, group in enumerate(groups):
        if len(group) > 1:
            members = sorted(group, key=plan.order.__getitem__)
            key = group_keys[gid][0]
            ctx.remarks.append(FusionRemark(NAME, True, None, _first_op(graph, members[0]),
                                            _first_op(graph, members[-1]), _saving(graph, members, key)))
            merged.append((key, members))
    return merged


def _space(kernel: KernelOp) -> tuple | None:
    """The iteration space kernels must share to merge (None: a template not merged here)."""
    if isinstance(kernel.plan, PointwisePlan):
        return (kernel.template, kernel.plan.shape)
    if isinstance(kernel.plan, RowPlan):
        return (kernel.template, kernel.plan.shape, kernel.plan.axes)
    return None


def _spaces(kernel: KernelOp) -> tuple[tuple, ...]:
    """The spaces a kernel may merge over: its own, and for a row program reducing along
    one dim that is not the last (column sums: a bias's gradient), the space whose rows run
    along the last dim, where its reductions are across the rows, split (so it merges with
    the split row program of a norm's backward reading the same gradient)."""
    own = _space(kernel)
    if own is None:
        return ()
    plan = kernel.plan
    if not isinstance(plan, RowPlan) or plan.split or len(plan.axes) != 1 \
            or plan.axes[0] == len(plan.shape) - 1 or not _reduces(kernel):
        return (own,)
    return (own, (kernel.template, plan.shape, (len(plan.shape) - 1,)))


def _spec(key: tuple) -> PointwiseSpec | RowSpec:
    """The spec of kernels merged over their one space (`_space`): the space itself."""
    if len(key) == 3:
        return RowSpec(RowSpace(key[1], key[2]))
    return PointwiseSpec(key[1])


def _launch(kernel: KernelOp) -> tuple[tuple, ...]:
    """What kernels merged into one launch over different spaces share: a pointwise or row
    program whose results are all computed (a copy of an input is not merged)."""
    n_in = len(kernel.region.inputs)
    if _space(kernel) is None or any(v < n_in for v in kernel.region.outputs):
        return ()
    if isinstance(kernel.plan, RowPlan) and kernel.plan.long_selections(kernel.region):
        return ()  # a long sort's workspace rows are sized for one program per row
    return ((),)


SKIP = Refusal(Rule.PROFIT, "one iteration space: the kernels' own merge decides")


def _independent_and_worth_it(graph: Graph, plan: GroupPlan, group: Group, node: int) -> Refusal | None:
    direct = any(m in graph.operands(node) for m in group)  # a path of one edge is no cycle
    if direct or plan.creates_cycle(group, node):
        return Refusal(Rule.CYCLE, "one reads what the other computes")
    if not _shared(graph, group, node) and not all(_launch_bound(graph, m) for m in (*group, node)) \
            and not all(_reduces(graph.op(m)) for m in (*group, node)):
        return Refusal(Rule.PROFIT, "they share no input and are not both launch-bound or reductions")
    return None


def _launch_refusal(graph: Graph, plan: GroupPlan, group: Group, node: int, key: tuple) -> Refusal | None:
    """Kernels over different spaces: one launch, its programs partitioned among them. Each
    keeps its own code, so what bounds the merge is the launch's source: `MAX_ROW_OPS` ops."""
    if _read_in_combine(graph, group, node) and not plan.creates_cycle(group, node):
        refusal = None  # (each member's partials; its combine, a launch after, reads the others)
    elif _space(graph.op(node)) in {_space(graph.op(m)) for m in group}:
        return SKIP  # merged by the first walk if at all
    else:
        refusal = _independent_and_worth_it(graph, plan, group, node)
        if refusal is not None and refusal.rule is Rule.CYCLE:
            return SKIP  # a kernel reading another's result: vertical fusion's remarks say why
    if refusal is None and sum(len(graph.op(m).region.ops) for m in (*group, node)) > MAX_ROW_OPS:
        return Refusal(Rule.PROFIT, f"the merged launch would exceed {MAX_ROW_OPS} ops")
    return refusal


def _read_in_combine(graph: Graph, group: Group, node: int) -> bool:
    """Does the split row program `node` read results of the group, all of them 0-d and
    only in its combine (its tail: a sum of squares adding the others' in a global norm)?
    Merged, its combine launch follows every member's programs and earlier combines."""
    kernel = graph.op(node)
    if not isinstance(kernel.plan, RowPlan) or not kernel.plan.split:
        return False
    read = {i for i, e in enumerate(graph.operand_edges(node)) if e[0] in group}
    region, n_in = kernel.region, len(kernel.region.inputs)
    return bool(read) and all(region.inputs[i].type.rank == 0 for i in read) and all(
        n_in + j in kernel.plan.tail for j, r in enumerate(region.ops) if read & set(r.operands))


def _refusal(graph: Graph, plan: GroupPlan, group: Group, node: int, key: tuple) -> Refusal | None:
    refusal = _independent_and_worth_it(graph, plan, group, node)
    if refusal is not None:
        return refusal
    kernel = graph.op(node)
    if isinstance(kernel.plan, RowPlan):
        regions = [graph.op(m).region for m in (*group, node)]
        if sum(len(r.ops) for r in regions) > MAX_ROW_OPS:
            return Refusal(Rule.PROFIT, f"the merged row program would exceed {MAX_ROW_OPS} ops")
        if max(max(graph.op(m).plan.phases, default=0) for m in (*group, node)) > MAX_ROW_PHASES:
            return Refusal(Rule.PROFIT, f"the merged row program would exceed {MAX_ROW_PHASES} phases")
        region, _, _ = merged_region(graph, [*sorted(group, key=plan.order.__getitem__), node])
        space = RowSpace(key[1], key[2])
        layouts = row_layouts(region, space)
        if not isinstance(layouts, dict):  # one input read along different dims, say
            return Refusal(layouts.rule, f"merged, {layouts.detail}")
        across, reducing = across_reductions(region, space, layouts)
        if across is not None and not short_across(space, across):
            tail = split_tail(region, layouts, reducing)
            if isinstance(tail, Refusal):
                return Refusal(tail.rule, f"merged, {tail.detail}")
    return None


def _reduces(kernel: KernelOp) -> bool:
    """A row program whose every output is reduced along its axes (size 1 or dropped)."""
    if not isinstance(kernel.plan, RowPlan):
        return False
    space, axes = kernel.plan.shape, kernel.plan.axes
    return all(len(t.shape) < len(space) or all(t.shape[a] == 1 for a in axes) for t in kernel.result_types)


def _inputs(graph: Graph, node: int) -> set[tuple[int, int]]:
    """The tensors a kernel reads that merging may share: those with elements, and the 0-d
    results of other kernels (a clipping coefficient every gradient's scale reads: merged,
    the scales are one launch, as torch's foreach kernels are)."""
    kernel = graph.op(node)
    return {_viewed(graph, e) for e, inp in zip(graph.operand_edges(node), kernel.region.inputs, strict=True)
            if not inp.scalar and (inp.type.rank > 0 or isinstance(graph.op(e[0]), KernelOp))}


def _viewed(graph: Graph, edge: tuple[int, int]) -> tuple[int, int]:
    """The tensor a view of all its elements reads (a transpose, size-1 dims: views of one
    tensor so share it, as q's and k's RoPE read one cos table viewed for H and for HK
    heads; a slice of part of it is an input of its own)."""
    while isinstance(op := graph.op(edge[0]), Op) and ops.category(op.kind) is ops.Category.LAYOUT \
            and view_dims(op, graph.result_type(*graph.operand_edges(edge[0])[0]).shape) is not None:
        edge = graph.operand_edges(edge[0])[0]
    return edge


def _shared(graph: Graph, group, node: int) -> set[tuple[int, int]]:
    mine = _inputs(graph, node)
    return {e for m in group for e in _inputs(graph, m) if e in mine}


def _launch_bound(graph: Graph, node: int) -> bool:
    traffic = cost.kernel_traffic(graph.op(node))
    return all(not mono for mono in traffic) and cost.evaluate(traffic, {}) <= LAUNCH_BOUND_BYTES


def _saving(graph: Graph, members: list[int], key: tuple) -> str:
    """What merging saves: launches, and the bytes of inputs read once instead of per kernel."""
    reads: dict[tuple[int, int], int] = {}
    for m in members:
        for e in _inputs(graph, m):
            reads[e] = reads.get(e, 0) + 1
    saved = cost.add(*({mono: c * (n - 1) for mono, c in cost.tensor_bytes(graph.result_type(*e)).items()}
                       for e, n in reads.items() if n > 1))
    kernel = graph.op(members[0])
    fewer = len(members) - 1
    launches = f"{fewer} launch{'es' if fewer > 1 else ''} fewer"
    if key == ():
        spaces = ", ".join(_space_text(graph.op(m).plan) for m in members)
        return (f"{len(members)} kernels over different iteration spaces ({spaces}) as one launch, "
                f"its programs partitioned among them: {launches}")
    shared = f"; shared inputs read once: saves {cost.format_poly(saved)} B" if saved else ""
    space = _spec(key).space if len(key) == 3 else None
    replanned = [m for m in members if _space(graph.op(m)) != key]
    across = "" if not replanned else (
        f" ({', '.join(_space_text(graph.op(m).plan) for m in replanned)} reduced across its rows)")
    text = _space_text(space) if space is not None else format_shape(key[1])
    return f"{len(members)} {kernel.template} kernels over {text} as one{across}: {launches}{shared}"


def _space_text(plan) -> str:
    """A pointwise or row plan's space (or a `RowSpace`) as text."""
    text = format_shape(plan.shape)
    if isinstance(plan, RowPlan | RowSpace):
        axes = plan.axes
        text += f" rows along axis {axes[0]}" if len(axes) == 1 else f" rows along axes {axes}"
    return text


def _first_op(graph: Graph, node: int):
    """The op a remark names for a kernel: its first (constants aside)."""
    return next(r.op for r in graph.op(node).region.ops if r.op.kind != "const")
