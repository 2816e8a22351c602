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
fusion's remarks.
Each merge is a fused remark; kernels that share an input but may not merge get a refusal.
Must run after the other fusion passes, which form the kernels it merges.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import cost
from tiledsl.ir import Graph, KernelOp
from tiledsl.passes.fusion.legality import Group, GroupPlan, RowSpace, row_layouts
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
        for members in _groups(graph, ctx, _space, _refusal):
            merge_kernels(graph, members, _spec(graph.op(members[0])))
        for members in _groups(graph, ctx, _launch, _launch_refusal):
            merge_kernels(graph, members)


def _groups(graph: Graph, ctx: PassContext, key_of, refusal_of) -> list[list[int]]:
    """The groups of kernels to merge, each in program order, with a fused remark each: a
    kernel joins the first group that `refusal_of` allows among those over its `key_of`
    that it shares an input with (or, launch-bound, groups of launch-bound kernels; a
    reduction, the last group of reductions). Refusals of kernels that share an input are
    remarks too; `SKIP` passes a group over silently."""
    plan = GroupPlan(graph)
    groups: list[Group] = []
    by_input: dict[tuple, dict[int, None]] = {}  # (key, input edge) -> groups reading it
    small: dict[tuple, dict[int, None]] = {}  # key -> groups of launch-bound kernels
    reducing: dict[tuple, int] = {}  # key -> the last group of reductions over it
    for node in graph.topo_order():
        op = graph.op(node)
        key = key_of(op) if isinstance(op, KernelOp) else None
        if key is None:
            continue
        # only groups that share an input with the kernel (or, for a launch-bound kernel,
        # groups of launch-bound ones) are tried: merging stays linear in the program
        inputs = _inputs(graph, node)
        tried = dict.fromkeys(g for e in inputs for g in by_input.get((key, e), {}))
        if _launch_bound(graph, node):
            tried.update(small.get(key, {}))
        if _reduces(op) and key in reducing:
            tried[reducing[key]] = None
        for gid in tried:
            group = groups[gid]
            refusal = refusal_of(graph, plan, group, node)
            if refusal is None:
                group.add(node)
                plan.groups[gid].append(node)
                plan.group_of[node] = gid
                break
            if refusal is not SKIP and _shared(graph, group, node):
                ctx.remarks.append(FusionRemark.refused(NAME, refusal, _first_op(graph, group.seed),
                                                        _first_op(graph, node)))
        else:
            gid = len(groups)
            groups.append(Group(plan, node))
            plan.add_group([node])
        for e in inputs:
            by_input.setdefault((key, e), {})[gid] = None
        if _launch_bound(graph, node) and all(_launch_bound(graph, m) for m in groups[gid]):
            small.setdefault(key, {})[gid] = None
        if all(_reduces(graph.op(m)) for m in groups[gid]):
            reducing[key] = gid
    merged = []
    for group in groups:
        if len(group) > 1:
            members = sorted(group, key=plan.order.__getitem__)
            ctx.remarks.append(FusionRemark(NAME, True, None, _first_op(graph, members[0]),
                                            _first_op(graph, members[-1]), _saving(graph, members)))
            merged.append(members)
    return merged


def _space(kernel: KernelOp) -> tuple | None:
    """The iteration space kernels must share to merge (None: a template not merged here)."""
    if isinstance(kernel.plan, PointwisePlan):
        return (kernel.template, kernel.plan.shape)
    if isinstance(kernel.plan, RowPlan):
        return (kernel.template, kernel.plan.shape, kernel.plan.axes)
    return None


def _spec(kernel: KernelOp) -> PointwiseSpec | RowSpec:
    """The spec of kernels merged over their one space: the space itself."""
    plan = kernel.plan
    if isinstance(plan, RowPlan):
        return RowSpec(RowSpace(plan.shape, plan.axes))
    return PointwiseSpec(plan.shape)


def _launch(kernel: KernelOp) -> tuple | None:
    """What kernels merged into one launch over different spaces share: a pointwise or row
    program whose results are all computed (a copy of an input is not merged)."""
    n_in = len(kernel.region.inputs)
    if _space(kernel) is None or any(v < n_in for v in kernel.region.outputs):
        return None
    if isinstance(kernel.plan, RowPlan) and (kernel.plan.long_selections(kernel.region) or kernel.plan.split):
        return None  # a launch's members take no workspace (a long sort's, partials) and are one launch
    return ()


SKIP = Refusal(Rule.PROFIT, "one iteration space: the kernels' own merge decides")


def _independent_and_worth_it(graph: Graph, plan: GroupPlan, group: Group, node: int) -> Refusal | None:
    direct = any(m in graph.operands(node) for m in group)  # a path of one edge is no cycle
    if direct or plan.creates_cycle(group, node):
        return Refusal(Rule.CYCLE, "one reads what the other computes")
    if not _shared(graph, group, node) and not all(_launch_bound(graph, m) for m in (*group, node)) \
            and not all(_reduces(graph.op(m)) for m in (*group, node)):
        return Refusal(Rule.PROFIT, "they share no input and are not both launch-bound or reductions")
    return None


def _launch_refusal(graph: Graph, plan: GroupPlan, group: Group, node: int) -> Refusal | None:
    """Kernels over different spaces: one launch, its programs partitioned among them. Each
    keeps its own code, so what bounds the merge is the launch's source: `MAX_ROW_OPS` ops."""
    if _space(graph.op(node)) in {_space(graph.op(m)) for m in group}:
        return SKIP  # merged by the first walk if at all
    refusal = _independent_and_worth_it(graph, plan, group, node)
    if refusal is not None and refusal.rule is Rule.CYCLE:
        return SKIP  # a kernel reading another's result: vertical fusion's remarks say why
    if refusal is None and sum(len(graph.op(m).region.ops) for m in (*group, node)) > MAX_ROW_OPS:
        return Refusal(Rule.PROFIT, f"the merged launch would exceed {MAX_ROW_OPS} ops")
    return refusal


def _refusal(graph: Graph, plan: GroupPlan, group: Group, node: int) -> Refusal | None:
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
        layouts = row_layouts(region, RowSpace(kernel.plan.shape, kernel.plan.axes))
        if not isinstance(layouts, dict):  # one input read along different dims, say
            return Refusal(layouts.rule, f"merged, {layouts.detail}")
    return None


def _reduces(kernel: KernelOp) -> bool:
    """A row program whose every output is reduced along its axes (size 1 or dropped)."""
    if not isinstance(kernel.plan, RowPlan):
        return False
    space, axes = kernel.plan.shape, kernel.plan.axes
    return all(len(t.shape) < len(space) or all(t.shape[a] == 1 for a in axes) for t in kernel.result_types)


def _inputs(graph: Graph, node: int) -> set[tuple[int, int]]:
    kernel = graph.op(node)
    return {e for e, inp in zip(graph.operand_edges(node), kernel.region.inputs, strict=True)
            if not inp.scalar and inp.type.rank > 0}


def _shared(graph: Graph, group, node: int) -> set[tuple[int, int]]:
    mine = _inputs(graph, node)
    return {e for m in group for e in _inputs(graph, m) if e in mine}


def _launch_bound(graph: Graph, node: int) -> bool:
    traffic = cost.kernel_traffic(graph.op(node))
    return all(not mono for mono in traffic) and cost.evaluate(traffic, {}) <= LAUNCH_BOUND_BYTES


def _saving(graph: Graph, members: list[int]) -> str:
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
    if _space(kernel) != _space(graph.op(members[1])):
        spaces = ", ".join(_space_text(graph.op(m)) for m in members)
        return (f"{len(members)} kernels over different iteration spaces ({spaces}) as one launch, "
                f"its programs partitioned among them: {launches}")
    shared = f"; shared inputs read once: saves {cost.format_poly(saved)} B" if saved else ""
    return f"{len(members)} {kernel.template} kernels over {_space_text(kernel)} as one: {launches}{shared}"


def _space_text(kernel: KernelOp) -> str:
    text = format_shape(kernel.plan.shape)
    if isinstance(kernel.plan, RowPlan):
        axes = kernel.plan.axes
        text += f" rows along axis {axes[0]}" if len(axes) == 1 else f" rows along axes {axes}"
    return text


def _first_op(graph: Graph, node: int):
    """The op a remark names for a kernel: its first (constants aside)."""
    return next(r.op for r in graph.op(node).region.ops if r.op.kind != "const")
