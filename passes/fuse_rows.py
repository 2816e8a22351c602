"""fuse-rows: row programs become one kernel each.

Before: reductions (sum, max, min, mean, logsumexp, prod, argmax...) and softmax along an
axis, surrounded by elementwise ops that read the same rows, each op its own
kernel (rmsnorm is 8 kernels, layernorm 10).
After: each maximal such group is one `rows` kernel: the reductions along
one axis of one shape S, the elementwise ops before and after them whose
dims map onto S consistently, and further reductions along the same axis
that depend on earlier ones (layernorm's variance after its mean). Values
used outside the group are stored by the kernel too.

Refused, with a recorded rule: a reduction along another axis or of another
shape, an op that reads a group value at another index (a reduced row
broadcast along the row, a transpose) or does not fit S ("other-index",
"tile"), a value used outside the group that does not vary along the rows
("tile": every row would store it), and anything that would create a cycle;
and, as not worth it ("profit"), a group past `MAX_ROW_PHASES` dependent
reductions or `MAX_ROW_OPS` ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph, Region
from tiledsl.passes.fusion.grow import candidate_kind, fuse_groups, outputs_of
from tiledsl.passes.fusion.legality import PASS_OPS, ROW_OPS, GroupPlan, RowSpace, gathers_within, row_layouts
from tiledsl.passes.fusion.profitability import MAX_ROW_OPS, MAX_ROW_PHASES
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.regions import outline
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.plans import RowPlan


@register
@dataclass(frozen=True)
class FuseRows(Pass):
    name = "fuse-rows"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def consider(node: int) -> bool:
            kind = graph.op(node).kind
            return candidate_kind(graph, node) and (ops.is_elementwise(kind) or kind in ROW_OPS)

        def admit_for(plan: GroupPlan, seed: int):
            x = graph.result_type(*graph.operand_edges(seed)[0])
            space = RowSpace(x.shape, graph.op(seed).attr("axis"))
            return lambda group, cand: _admit(graph, plan, group, cand, space)

        fuse_groups(graph, ctx.remarks, self.name, RowPlan.template,
                    lambda node: graph.op(node).kind in ROW_OPS, consider, admit_for)


def _admit(graph: Graph, plan: GroupPlan, group: set[int], cand: int,
           space: RowSpace) -> Refusal | None:
    if len(group) >= MAX_ROW_OPS:
        return Refusal(Rule.PROFIT, f"a row program holds at most {MAX_ROW_OPS} ops")
    if (gather := gathers_within(graph, cand, group)) is not None:
        return Refusal(Rule.OTHER_INDEX, gather)
    members = sorted(group | {cand}, key=plan.order.__getitem__)
    region, _ = outline(graph, members, members)
    if _phases(region) > MAX_ROW_PHASES:
        return Refusal(Rule.PROFIT, f"a row program reads its rows at most {MAX_ROW_PHASES + 1} times "
                       f"({MAX_ROW_PHASES} dependent reductions); storing an intermediate costs less")
    layouts = row_layouts(region, space)
    if isinstance(layouts, Refusal):
        return layouts
    kept = [d for d in range(len(space.shape)) if d != space.axis and space.shape[d] != 1]
    outputs = set(outputs_of(graph, members))
    for node, value in zip(members, region.outputs, strict=True):  # outputs = members, in order
        if node in outputs and not set(kept) <= set(layouts[value]):
            return Refusal(Rule.TILE, f"{graph.op(node).kind} is used outside the row program but does "
                           "not vary along every row dim, so every row would store it")
    return None


def _phases(region: Region) -> int:
    """The longest chain of reductions that each need the one before (layernorm: 2)."""
    n_in = len(region.inputs)
    phase = [0] * (n_in + len(region.ops))
    for i, rop in enumerate(region.ops):
        p = max((phase[o] for o in rop.operands), default=0)
        phase[n_in + i] = p + 1 if rop.op.kind in PASS_OPS else p
    return max(phase, default=0)
