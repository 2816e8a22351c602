"""fuse-elementwise: chains of elementwise ops over one iteration space become one kernel.

Before: unary and binary ops, `where`, `cast`, comparisons and index/mask
expressions, each its own pointwise kernel.
After: each maximal connected group of them whose results all have the same
shape is one `pointwise` kernel; inputs of other shapes are broadcast into it
through their strides (bias `[N]`, row scales `[M, 1]`, scalars), scalar
(rank-0) ops are computed inside, and values used outside the group are
stored too.

Refused, with a recorded rule: a producer of a smaller shape broadcast into
a larger consumer or read through a transpose ("other-index": the consumer
would read it at another index), and anything that would create a cycle.
Must run after fuse-epilogue and fuse-rows, which claim the elementwise ops
around matmuls and reductions first.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ir import Graph
from tiledsl.passes.fusion.grow import Admission, elementwise_candidate, fuse_groups
from tiledsl.passes.fusion.legality import GroupPlan, describe_node, reads_other_index
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.fusion.spec import PointwiseSpec
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import format_shape


@register
@dataclass(frozen=True)
class FuseElementwise(Pass):
    name = "fuse-elementwise"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def elementwise(node: int) -> bool:
            return elementwise_candidate(graph, node)

        def admit_for(plan: GroupPlan, seed: int) -> Admission:
            space = graph.op(seed).shape
            return Admission(lambda group, cand: _admit(graph, group, cand, space),
                             lambda members: PointwiseSpec(space))

        fuse_groups(graph, ctx.remarks, self.name, elementwise, elementwise, admit_for)


def _admit(graph: Graph, group: set[int], cand: int, space) -> Refusal | None:
    shape = graph.op(cand).shape
    consumes = any(s in group for s in graph.operands(cand))
    if shape != space and not (not consumes and shape == ()):
        smaller, larger = (space, shape) if consumes else (shape, space)
        if len(smaller) <= len(larger):
            reader = describe_node(graph, cand) if consumes else "the group"
            value = "the group's values" if consumes else describe_node(graph, cand)
            return Refusal(Rule.OTHER_INDEX, f"{reader} reads {value} broadcast from "
                           f"{format_shape(smaller)} to {format_shape(larger)}")
        return Refusal(Rule.TILE, f"its shape {format_shape(shape)} is not the group's {format_shape(space)}")
    why = reads_other_index(graph, cand, group)
    return Refusal(Rule.OTHER_INDEX, why) if why else None
