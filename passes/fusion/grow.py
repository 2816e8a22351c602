"""Growing a fusion group: the driver the fusion passes share.

A pass supplies a seed and its `Admission`: an `admit(group, candidate)` callback that
returns None (admit) or a `Refusal` (its rule and why), and the kernel spec of the group
it grew (`fusion.spec`: what the pass decided each member is for). The driver visits the
producers and users of the group until nothing new is admitted, checks for cycles itself,
and records a remark for every refused neighbour. Passes then rewrite the planned groups
into kernels, each planned from its spec, with `rewrite_groups`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op, walk
from tiledsl.passes.regions import is_clonable, remove_dead_clonables, replace_with_kernel

from .legality import Group, GroupPlan, view_dims
from .remarks import FusionRemark, Refusal
from .spec import Spec

Admit = Callable[[set[int], int], "Refusal | None"]


class Admission(NamedTuple):
    """How one seed's group grows: which candidates join (`admit`), and the spec of the
    group it grew (`spec(members)`, the members in program order). `settle(members)`, where
    a pass has one, checks the grown group whole: it returns the members that must not join
    after all (a reduction admitted for a continuation that never joined), which `admit`
    then refuses as the group grows again from its seed; nothing when the group stands."""

    admit: Admit
    spec: Callable[[list[int]], Spec]
    settle: Callable[[list[int]], set[int]] | None = None


def candidate_kind(graph: Graph, node: int) -> bool:
    """Ops a fusion pass may consider at all: not params, dims, views, returns, kernels,
    nor constants and scalar expressions, which every kernel reading them clones."""
    op = graph.op(node)
    return (isinstance(op, Op) and op.kind not in ("param", "dim", "const", "return")
            and ops.category(op.kind) is not ops.Category.LAYOUT and not is_clonable(graph, node))


def computed_view(graph: Graph, node: int) -> bool:
    """A transpose, or a view inserting or dropping size-1 dims, of a value a kernel computes
    (elementwise, or a row's statistic: a view of an input is read through its strides): a
    row program reads it as its source, along the dims its layout names
    (`legality.view_dims`)."""
    op = graph.op(node)
    if not isinstance(op, Op) or ops.category(op.kind) is not ops.Category.LAYOUT:
        return False
    src = graph.operands(node)[0]
    s_op = graph.op(src)
    return isinstance(s_op, Op) and view_dims(op, s_op.shape) is not None \
        and (ops.is_elementwise(s_op.kind) or s_op.kind in ops.ROW_KINDS or computed_view(graph, src))


def broadcast_axes(graph: Graph, node: int) -> tuple[int, ...]:
    """The trailing axes along which an elementwise op reads a value computed elementwise
    over a smaller space from tensors (through transposes and size-1 views: vLLM's
    merge_attn_states scales [T, H, D] outputs by `p_scale.T[:, :, None]` of an [H, T]
    chain; FlashInfer's merge_state by `exp(s_a - s_max)[..., None]`), where that value
    would be stored by a kernel of its own (not recomputed), or is recomputed but its chain
    feeds another value too (`shared_chain`): a row program over the op's space with those
    axes computes it once per row, with that other value (empty: no such operand; a value
    recomputed by its readers alone, a gate `sigmoid(g)[:, :, None]`, stays so)."""
    op = graph.op(node)
    if not isinstance(op, Op) or not ops.is_elementwise(op.kind) or op.kind == "take" \
            or not candidate_kind(graph, node) or len(op.shape) < 2:
        return ()
    for edge in graph.operand_edges(node):
        # the cheap tests first: every elementwise op of a program is asked
        t = graph.result_type(*edge)
        lead = len(op.shape) - t.rank
        axes = tuple(j for j in range(len(op.shape))
                     if op.shape[j] != 1 and (j < lead or t.shape[j - lead] == 1))
        if not axes or axes != tuple(range(axes[0], len(op.shape))) or len(axes) == len(op.shape):
            continue
        src = edge[0]
        while computed_view(graph, src):
            src = graph.operands(src)[0]
        s_op = graph.op(src)
        if isinstance(s_op, Op) and ops.is_elementwise(s_op.kind) and s_op.kind != "take" \
                and (candidate_kind(graph, src) or graph.recomputed(src) and shared_chain(graph, src)) \
                and _reads_tensor(graph, src) and not _broadcast_later(graph, node):
            return axes
    return ()


def _broadcast_later(graph: Graph, node: int) -> bool:
    """Is the value of elementwise op `node` read, through elementwise ops and views, by an
    elementwise op over a larger space (YaRN's [B, 1, S, D] cos table scaling [B, H, S, D]
    queries)? A row program over its own space would then hold a value the larger one reads
    broadcast: the row program belongs to the larger space, or the value to its readers."""
    def readers(n: int) -> list[tuple[int, Op]]:
        return [(u, o) for u, _ in graph.users(n) if isinstance(o := graph.op(u), Op)
                and (ops.is_elementwise(o.kind) or ops.category(o.kind) is ops.Category.LAYOUT)]

    def onward(n: int) -> list[int]:  # (what reads n at its own shape, or views it)
        return [u for u, o in readers(n)
                if o.shape == graph.op(n).shape or not ops.is_elementwise(o.kind)]

    return any(ops.is_elementwise(o.kind) and o.shape != graph.op(n).shape
               for n in walk([node], onward) for _, o in readers(n))


def _elementwise_chain(graph: Graph, node: int) -> set[int]:
    """`node` and the elementwise ops (of tensors) it is computed from."""
    def chain(n: int) -> bool:
        op = graph.op(n)
        return isinstance(op, Op) and ops.is_elementwise(op.kind) and op.shape != ()

    return set(walk([node], lambda n: [o for o in graph.operands(n) if chain(o)]))


def shared_chain(graph: Graph, node: int) -> bool:
    """Is a value of the elementwise chain computing `node` read in its own shape by an op
    besides the chain (not broadcast, not through a view: FlashInfer's merge_state scales
    the values by `a[..., None]` of `a = exp(s_a - s_max)`, and `a + b` gives the merged
    lse)? A row program computing `node` per row then computes that reader's value too,
    where recomputing `node` at each element leaves that reader a kernel of its own."""
    chain = _elementwise_chain(graph, node)
    return any(u not in chain and isinstance(o := graph.op(u), Op) and o.shape == graph.op(n).shape
               and ops.category(o.kind) is not ops.Category.LAYOUT
               for n in chain for u, _ in graph.users(n))


def _reads_tensor(graph: Graph, node: int) -> bool:
    """Is the elementwise value `node` computed from a tensor (a parameter, a kernel's or a
    reduction's result; not positions and scalars alone: a mask of index expressions is no
    value worth a row program)?"""
    def computed(op: Op) -> bool:  # (an elementwise op or a view: walked through)
        return ops.is_elementwise(op.kind) or ops.category(op.kind) is ops.Category.LAYOUT

    def through(n: int) -> list[int]:
        op = graph.op(n)
        return graph.operands(n) if isinstance(op, Op) and (op.shape == () or computed(op)) else []

    return any(not isinstance(op := graph.op(n), Op)
               or op.shape != () and (op.kind == "param" or not computed(op)) for n in walk([node], through))


def elementwise_candidate(graph: Graph, node: int) -> bool:
    """An elementwise op a fusion pass may take (see `candidate_kind`)."""
    return candidate_kind(graph, node) and ops.is_elementwise(graph.op(node).kind)


def grow(plan: GroupPlan, seed: int, admit: Admit, pass_name: str,
         remarks: list, consider: Callable[[int], bool],
         related: Callable[[int], list[int]] | None = None) -> set[int]:
    """The maximal group around `seed` that `admit` accepts and that creates no cycle.

    A worklist visits each new member's producers and users once (and the nodes `related`
    names for it, which share no value with it: a sort's positions beside its values);
    candidates refused on the way are retried after the group has grown (a bigger group
    can absorb what made a cycle), until a round admits nothing.
    """
    graph = plan.graph
    group = Group(plan, seed)
    refused: dict[int, tuple[int, Refusal]] = {}
    work = deque([seed])

    def visit(member: int, cand: int) -> None:
        reason = admit(group, cand)
        if reason is None:
            reason = plan.cycle_refusal(group, cand)
        if reason is None:
            group.add(cand)
            refused.pop(cand, None)
            work.append(cand)
        else:
            refused[cand] = (member, reason)

    while work:
        while work:
            member = work.popleft()
            neighbours = graph.operands(member) + [u for u, _ in graph.users(member)]
            neighbours += related(member) if related is not None else []
            for cand in dict.fromkeys(neighbours):
                if cand not in group and not plan.grouped(cand) and consider(cand):
                    visit(member, cand)
        for cand, (member, _) in list(refused.items()):
            if cand not in group:
                visit(member, cand)
    for cand, (member, refusal) in refused.items():
        producer, consumer = (cand, member) if cand in graph.operands(member) else (member, cand)
        remarks.append(FusionRemark.refused(pass_name, refusal, _op(graph, producer), _op(graph, consumer)))
    return set(group)


def _op(graph: Graph, node: int) -> Op:
    op = graph.op(node)
    return op.region.ops[0].op if isinstance(op, KernelOp) else op


def outputs_of(graph: Graph, members: list[int]) -> list[int]:
    """Members whose values are used outside the group (they must be stored)."""
    inside = set(members)
    return [n for n in members if any(u not in inside for u, _ in graph.users(n))]


def fuse_groups(graph: Graph, remarks: list, pass_name: str, is_seed: Callable[[int], bool],
                consider: Callable[[int], bool], admit_for: Callable[[GroupPlan, int], Admission],
                first: Callable[[int], bool] | None = None,
                related: Callable[[int], list[int]] | None = None) -> None:
    """The driver of a fusion pass: grow a group from every seed not yet grouped
    (in topological order), then rewrite every group into one kernel of its spec.

    `admit_for(plan, seed)` gives the legality/profitability rule for that
    seed's group and its spec; `consider` says which neighbours are candidates at all.
    """
    plan = GroupPlan(graph)
    order = graph.topo_order()
    if first is not None:
        ahead = [first(n) for n in order]
        order = [n for n, a in zip(order, ahead, strict=True) if a] + \
            [n for n, a in zip(order, ahead, strict=True) if not a]
    for seed in order:
        if plan.grouped(seed) or not candidate_kind(graph, seed) or not is_seed(seed):
            continue
        admission = admit_for(plan, seed)
        said = len(remarks)
        members = grow(plan, seed, admission.admit, pass_name, remarks, consider, related)
        while admission.settle is not None and admission.settle(sorted(members, key=plan.order.__getitem__)):
            del remarks[said:]  # the last growth's remarks stand
            members = grow(plan, seed, admission.admit, pass_name, remarks, consider, related)
        plan.add_group(members, admission.spec(sorted(members, key=plan.order.__getitem__)))
    rewrite_groups(plan)


def rewrite_groups(plan: GroupPlan) -> list[int]:
    """Replace every planned group by one kernel node of its spec; returns the new kernel nodes.

    A group whose values nothing reads (dead code, in a pipeline without `dce`) is
    removed instead: a kernel with no results computes nothing anyone sees."""
    graph, kernels = plan.graph, []
    for members, spec in zip(plan.groups, plan.specs, strict=True):
        outputs = outputs_of(graph, members)
        if not outputs:
            operands = {o for m in members for o in graph.operands(m)} - set(members)
            graph.remove_all(members)
            remove_dead_clonables(graph, list(operands))
            continue
        kernels.append(replace_with_kernel(graph, members, outputs, spec))
    return kernels
