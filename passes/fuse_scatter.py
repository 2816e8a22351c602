"""fuse-scatter: a scatter (`put`, `put_into`) and the elementwise ops computing what it
writes.

Before: each `put` (what scatter_add, index_add and a gather's gradient build; scatter
and index_copy are a `put_into`, x the result starts as) is a kernel of its own,
reading values that pointwise kernels stored.
After: one `scatter` kernel per `put`, with the elementwise producers of its
values and indices that nothing else reads (an embedding bag's gathered rows
times their weights; the index expressions), computed over the written values'
space in registers and stored or added at the indices; `put`s over that space
that read one of its values join it (two index_copy appends at one position).
A put_into's x is not computed in the kernel: the launch copies it into the result.
The result of a `put` is a kernel boundary: what reads it (x + the sum) is
another kernel.

Refused, with a recorded rule: a producer some op outside the kernel reads too
("materialize": it would have to be stored over the space of another kernel; a `put`
of the space reading it counts as inside, since it joins, unless another scatter kernel
took it already or it writes values computed from a put's result of the space: that put
cannot join a kernel whose result it waits for, a chain of scatters sharing indices), a
producer the kernel would read through a view or broadcast ("other-index"), a
reader of a `put`'s result ("op"). Runs before fuse-elementwise, which would
otherwise store the producers.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph
from tiledsl.passes.fusion.grow import Admission, elementwise_candidate, fuse_groups
from tiledsl.passes.fusion.legality import Group, GroupPlan, describe_node, reads_other_index
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.fusion.spec import ScatterSpec
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import broadcasts_to, format_shape


@register
@dataclass(frozen=True)
class FuseScatter(Pass):
    name = "fuse-scatter"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def is_put(node: int) -> bool:
            return graph.op(node).kind in ops.WRITTEN

        def consider(node: int) -> bool:
            return is_put(node) or elementwise_candidate(graph, node)

        def admit_for(plan: GroupPlan, seed: int) -> Admission:
            space = _space(graph, seed)
            # what is computed from a put's result of the space (the graph is not changed
            # while groups are planned)
            after = _computed_after(graph, [n for n in graph.nx if is_put(n) and _space(graph, n) == space])
            return Admission(lambda group, cand: _admit(graph, group, cand, space, after),
                             lambda members: ScatterSpec(space))

        fuse_groups(graph, ctx.remarks, self.name, is_put, consider, admit_for)


def _space(graph: Graph, put: int) -> tuple:
    return graph.result_type(*graph.operand_edges(put)[ops.WRITTEN[graph.op(put).kind]]).shape


def adds_onto(graph: Graph, node: int) -> bool:
    """Does `node` add atomically onto the result of a put of its space that only it reads
    (`put_into(put(a, I) {accumulate}, b, J) {accumulate}`: the gradients of two gathers of
    one weight, summed)? Then both add into one buffer in one kernel: the order of atomic
    adds is unspecified anyway."""
    op = graph.op(node)
    if op.kind != "put_into" or not op.attr("accumulate"):
        return False
    base = graph.operands(node)[0]
    b = graph.op(base)
    return (b.kind in ops.WRITTEN and b.attr("accumulate") and b.type == op.type
            and _space(graph, base) == _space(graph, node) and len(graph.users(base)) == 1)


def _computed_after(graph: Graph, puts: list[int]) -> set[int]:
    """What is computed from the results of `puts`, but through a put that adds onto one of
    them (`adds_onto`), which joins their kernel."""
    out: set[int] = set()
    stack = list(puts)
    while stack:
        n = stack.pop()
        for u, slot in graph.users(n):
            if u not in out and not (slot == 0 and n in puts and adds_onto(graph, u)):
                out.add(u)
                stack.append(u)
    return out


def _joins(graph: Graph, group: Group, node: int, space, after: set[int]) -> bool:
    """Will `node`, a reader outside the group, join it next? A `put` of the space does,
    unless another kernel of this pass took it already, or what it writes or where is
    computed from a put's result of the space (one of the group's, or one that joins with
    it; `after` holds what is computed from those): the kernel would wait for its own result
    (the scatter_add of a scatter_add sharing its indices; fuzz finding 0:13094). Decided
    from the graph, not from the group grown so far, since a put joining later can close
    the cycle."""
    if graph.op(node).kind not in ops.WRITTEN or _space(graph, node) != space or group.plan.grouped(node):
        return False
    return node not in after


def _admit(graph: Graph, group: Group, cand: int, space, after: set[int]) -> Refusal | None:
    reads = [o for o in graph.operands(cand) if o in group]
    if graph.op(cand).kind in ops.WRITTEN:
        if _space(graph, cand) != space:
            return Refusal(Rule.TILE, f"it writes values of shape {format_shape(_space(graph, cand))}, "
                           f"not the kernel's {format_shape(space)}")
        written = [(slot, o) for slot, o in enumerate(graph.operands(cand))
                   if o in group and graph.op(o).kind in ops.WRITTEN]
        if written and (written != [(0, graph.operands(cand)[0])] or not adds_onto(graph, cand)):
            return Refusal(Rule.OP, f"it reads {describe_node(graph, written[0][1])}'s result, which the "
                           "scatter kernel completes only when it ends")
        return None
    if reads:
        return Refusal(Rule.OP, f"it reads {describe_node(graph, reads[0])}'s result, which the "
                       "scatter kernel completes only when it ends")
    outside = [u for u, _ in graph.users(cand)
               if u not in group and not _joins(graph, group, u, space, after)]
    if outside:
        why, u = "", outside[0]
        if graph.op(u).kind in ops.WRITTEN and _space(graph, u) == space:
            why = (", and is another scatter kernel's" if group.plan.grouped(u) else
                   ", and cannot join it: its values or indices are computed from a scatter's result")
        return Refusal(Rule.MATERIALIZE, f"{describe_node(graph, outside[0])} outside the scatter "
                       f"reads it too{why}")
    if not broadcasts_to(graph.op(cand).shape, space):
        return Refusal(Rule.TILE, f"its shape {format_shape(graph.op(cand).shape)} does not "
                       f"broadcast to the scatter's {format_shape(space)}")
    why = reads_other_index(graph, cand, group)
    return Refusal(Rule.OTHER_INDEX, why) if why else None
