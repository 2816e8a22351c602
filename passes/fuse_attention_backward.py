"""fuse-attention-backward: the backward of attention as FlashAttention-2's two kernels.

Before (what autodiff derives for `softmax(mod(q @ k.T)) @ v`, `tiledsl/autodiff.py`):
the scores recomputed from q and k, the score modification, the probabilities
`exp(z - lse)` from the saved logsumexp, `dp = do @ v.T`, the score gradient
`ds = mod'(p * (dp - delta))`, then the products `dv = p.T @ do`, `dk = ds.T @ q`
(or `(q.T @ ds).T`) and `dq = ds @ k`: every [.., M, N] value stored and read
back, in five or more kernels.
After: one kernel that walks the query blocks for each key block and
accumulates the products summed over the queries (dk, dv), and one that walks
the key blocks for each query block and accumulates those summed over the keys
(dq). Each recomputes the score tiles it needs; nothing [.., M, N] is stored.
The row pre-pass `delta = rowsum(do * o)` stays a rows kernel (fuse-rows).

The score spaces are those the analysis recorded (`passes/fusion/score_space.py`, which
says what a space, its products, stored values, sums and prologues are), each derived
again from its marks on the graph as it is now, the refused ones reported, and the marks
cleared. The ops both kernels need are cloned, so each kernel is a group. The plan
(`attention_backward_plan`) adds the mask bound whose blocks the walk skips.

The earlier passes shape a space for its kernels and are not needed for a correct one:
without widen-score-sums, a space whose values f16 or bf16 sums read is refused ("profit":
the atomic adds would round); without own-prologues, a prologue another op reads too is
refused (the shared prologue rule: it is stored anyway); without sink-transposes, a scale
after a product's transpose runs after the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.builder import Builder
from tiledsl.ir import Graph
from tiledsl.passes.fusion import score_space
from tiledsl.passes.fusion.admission import prologue_op_refusal
from tiledsl.passes.fusion.grow import rewrite_groups
from tiledsl.passes.fusion.legality import GroupPlan, describe_node
from tiledsl.passes.fusion.remarks import FusionRemark
from tiledsl.passes.fusion.score_space import ScoreSpace, is_op, prologue_ops
from tiledsl.passes.fusion.spec import AttentionBackwardSpec, ProductSpec
from tiledsl.passes.registry import Pass, PassContext, register

NAME = "fuse-attention-backward"


@register
@dataclass(frozen=True)
class FuseAttentionBackward(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        refusals = []
        for rec in score_space.recorded(graph):
            found, refused = score_space.derive(graph, rec, narrow_sums=False)
            refused = refused or _shared_prologue(graph, found)
            if refused is not None:
                refusals.append(FusionRemark.refused(NAME, *refused))
                continue
            ctx.remarks.append(_remark(graph, found))
            groups = _split(graph, found)  # adds the keys kernel's copies first
            plan = GroupPlan(graph)
            for members, spec in groups:
                plan.add_group(members, spec)
            rewrite_groups(plan)
        ctx.remarks.extend(refusals)
        score_space.clear(graph)


def _shared_prologue(graph: Graph, found: ScoreSpace):
    """A prologue op of a dot's or product's operand that an op outside the kernels reads
    too (own-prologues gives each matmul its own copy): refused by the prologue rule."""
    members = set(found.members(graph, "queries")) | set(found.members(graph, "keys"))
    for m in sorted(members):
        if not is_op(graph, m, "matmul"):
            continue
        for o in graph.operands(m):
            for n in prologue_ops(graph, o):
                if any(u not in members for u, _ in graph.users(n)):
                    return prologue_op_refusal(graph, n, users_outside=True), graph.op(n), graph.op(m)
    return None


def _remark(graph: Graph, found: ScoreSpace) -> FusionRemark:
    products = found.products
    sums = [f"over the {over}: " + ", ".join(describe_node(graph, p.matmul) for p in products
                                             if p.over == over)
            for over in ("queries", "keys") if any(p.over == over for p in products)]
    plural = "s" if len(found.dots) != 1 else ""
    if found.stored:
        sums.append("stored per tile: " + ", ".join(describe_node(graph, n) for n in found.stored))
    if found.reduced:
        sums.append("summed per tile: " + ", ".join(describe_node(graph, chain[-1])
                                                    for _, chain in found.reduced))
    detail = f"flash attention backward ({len(found.dots)} score dot{plural}; {'; '.join(sums)})"
    return FusionRemark(NAME, True, None, graph.op(found.dots[0]), graph.op(products[-1].matmul), detail)


def _spec(found: ScoreSpace, over: str, members: list[int], copy: dict[int, int]) -> AttentionBackwardSpec:
    """The roles in the kernel of `members` whose products sum over `over`, read through
    `copy` (the keys kernel's copies of the ops both kernels need)."""
    inside = set(members)

    def own(nodes) -> tuple[int, ...]:
        return tuple(copy.get(n, n) for n in nodes if copy.get(n, n) in inside)

    products = tuple(ProductSpec(p.matmul, copy.get(p.x, p.x), p.view,
                                 tuple(found.batch_sums.get(p.matmul, ())))
                     for p in found.products if p.over == over)
    if over != found.storer:
        return AttentionBackwardSpec(over, own(found.dots), products, (), ())
    reduced = tuple((copy.get(x, x), *chain) for x, chain in found.reduced)
    return AttentionBackwardSpec(over, own(found.dots), products, own(found.stored), reduced)


def _split(graph: Graph, found: ScoreSpace) -> list[tuple[list[int], AttentionBackwardSpec]]:
    """One group per kernel, with its spec; the keys kernel gets its own copy of the score ops."""
    kinds = {p.over for p in found.products}
    if len(kinds) == 1:
        over = kinds.pop()
        members = found.members(graph, over)
        return [(members, _spec(found, over, members, {}))]
    shared = set(found.members(graph, "queries"))
    mine = found.members(graph, "keys")
    clones: dict[int, int] = {}
    order = {n: i for i, n in enumerate(graph.topo_order())}
    b = Builder(graph)
    for n in sorted((n for n in mine if n in shared), key=order.__getitem__):
        clones[n] = b.copy(graph.op(n), [(clones.get(s, s), r) for s, r in graph.operand_edges(n)])
    for n in mine:  # the keys kernel's own ops read the copies
        edges = graph.operand_edges(n)
        if n not in shared and any(s in clones for s, _ in edges):
            graph.set_operands(n, [(clones.get(s, s), r) for s, r in edges])
    keys = [clones.get(n, n) for n in mine]
    queries = sorted(shared)
    return [(queries, _spec(found, "queries", queries, {})), (keys, _spec(found, "keys", keys, clones))]
