"""Growing a fusion group: the driver the fusion passes share.

A pass supplies a seed and an `admit(group, candidate)` callback that returns
None (admit) or a (rule, detail) refusal. The driver visits the producers and
users of the group until nothing new is admitted, checks for cycles itself,
and records a remark for every refused neighbour. Passes then rewrite the
planned groups into kernels with `rewrite_groups`.
"""

from __future__ import annotations

from collections.abc import Callable

from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.passes.regions import replace_with_kernel

from .legality import GroupPlan
from .remarks import FusionRemark

Admit = Callable[[set[int], int], "tuple[str, str] | None"]


def candidate_kind(graph: Graph, node: int) -> bool:
    """Ops a fusion pass may consider at all (not params, dims, views, returns, kernels)."""
    op = graph.op(node)
    return isinstance(op, Op) and op.kind not in ("param", "dim", "const", "transpose", "return")


def grow(plan: GroupPlan, seed: int, admit: Admit, pass_name: str,
         remarks: list, consider: Callable[[int], bool]) -> set[int]:
    """The maximal group around `seed` that `admit` accepts and that creates no cycle."""
    graph = plan.graph
    group = {seed}
    refused: dict[int, tuple[int, str, str]] = {}
    changed = True
    while changed:
        changed = False
        for member in sorted(group, key=plan.order.__getitem__):
            neighbours = [(p, member) for p in graph.operands(member)]
            neighbours += [(member, u) for u, _ in graph.users(member)]
            for producer, consumer in neighbours:
                cand = producer if consumer == member else consumer
                if cand in group or plan.grouped(cand) or not consider(cand):
                    continue
                reason = admit(group, cand)
                if reason is None and plan.creates_cycle(group, cand):
                    reason = ("cycle", "a value between them is computed outside the group")
                if reason is None:
                    group.add(cand)
                    refused.pop(cand, None)
                    changed = True
                else:
                    refused[cand] = (member, *reason)
    for cand, (member, rule, detail) in refused.items():
        producer, consumer = (cand, member) if cand in graph.operands(member) else (member, cand)
        remarks.append(FusionRemark(pass_name, False, rule, _op(graph, producer), _op(graph, consumer),
                                    detail))
    return group


def _op(graph: Graph, node: int) -> Op:
    op = graph.op(node)
    return op.region.ops[0].op if isinstance(op, KernelOp) else op


def outputs_of(graph: Graph, members: list[int]) -> list[int]:
    """Members whose values are used outside the group (they must be stored)."""
    inside = set(members)
    return [n for n in members if any(u not in inside for u, _ in graph.users(n))]


def rewrite_groups(plan: GroupPlan, template: str, min_size: int = 1) -> list[int]:
    """Replace every planned group by one kernel node; returns the new kernel nodes."""
    kernels = []
    for members in plan.groups:
        if len(members) < min_size:
            continue
        kernels.append(replace_with_kernel(plan.graph, members, outputs_of(plan.graph, members), template))
    return kernels
