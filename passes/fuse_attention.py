"""fuse-attention: q @ k.T, score modification, softmax, @ v and epilogue as one kernel.

Before: `s = q @ k.T`, elementwise ops on the scores, `softmax(s)` over the
keys, `p @ v`, elementwise ops on the output: three or more kernels, with the
[.., M, N] score matrix written to memory and read back.
After: one `attention` kernel that never stores the scores.

Recognised by the algebra of the graph, not a list of patterns. From every
softmax whose result is the left operand of a matmul (`p @ v`):
- the score modification is every elementwise op of the score shape that the
  softmax's input is computed from, walking back to the one matmul that
  produced the scores (`q @ kt`): scales, biases of any broadcastable shape,
  `where` masks built from `index`/`causal`, tanh soft-capping, scalar
  params and dims. Side values computed without the scores stay outside
  and are read at the score tile;
- a cheap elementwise prologue on either matmul operand (`(q * scale) @ k.T`,
  `q @ (k * scale).T`) is applied to each loaded tile; k and v may be gathers at index
  expressions (a paged KV cache, `k_cache[block_table[b, j // P], j % P]`), loaded
  through the index the kernel computes over each tile;
- `logsumexp` of the same scores over the keys (directly, or of their widening to
  f32: what a training forward saves for the flash backward) is stored by the kernel too;
- a cast of the probabilities to the dtype of `v` (`cast(softmax(s), f16) @ v`)
  is the narrowing of P the kernel does before its second dot;
- the epilogue is every elementwise op that consumes the output element for
  element, and the elementwise producers of its other operands at the output's
  shape (a gate `o * sigmoid(g)`), as in fuse-epilogue.

Refused, with a recorded rule: softmax along another axis than the keys
("tile"), scores or probabilities that something else needs whole (a
reduction over the keys other than the softmax, a second consumer, a
transposed read: "materialize"), scores that come from two matmuls ("op"),
and anything that would create a cycle, such as probabilities modified by a
statistic of their own row (a sink's factor `sigmoid(logsumexp(s) - sink)`
still on p, where hoist-row-scale did not run: the kernel modifies each key
block's p before the row's logsumexp is known). The ops are then left to the other
fusion passes and the program still runs correctly. Must run before
fuse-epilogue and fuse-rows, which would otherwise take the pieces.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import networkx as nx

from tiledsl import ops
from tiledsl.ir import Graph, Op, walk
from tiledsl.passes.fusion.admission import (
    epilogue_refusal,
    grouped_dot,
    keys_are_data,
    prologue_op_refusal,
    prologue_units,
)
from tiledsl.passes.fusion.grow import elementwise_candidate, rewrite_groups
from tiledsl.passes.fusion.legality import Group, GroupPlan, describe_node
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.fusion.spec import AttentionSpec
from tiledsl.passes.regions import is_clonable
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import DType, broadcasts_to

NAME = "fuse-attention"


@register
@dataclass(frozen=True)
class FuseAttention(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        plan = GroupPlan(graph)
        refused: set[int] = set()  # softmaxes whose attention a recorded refusal explains
        for node in graph.topo_order():
            if plan.grouped(node):
                continue
            found, said = None, len(ctx.remarks)
            if _is(graph, node, "softmax"):
                found = _Match(graph, plan, node, ctx.remarks).members()
                if found is None and len(ctx.remarks) > said:
                    refused.add(node)
            elif _is(graph, node, "matmul"):
                found = _Match(graph, plan, node, ctx.remarks).chain()
            if found is not None:
                plan.add_group(*found)
        _unmatched(graph, plan, ctx.remarks, refused)
        rewrite_groups(plan)


def _unmatched(graph: Graph, plan: GroupPlan, remarks: list, refused: set[int]) -> None:
    """Say why a matmul whose left operand is computed from a softmax is not attention: the
    pattern looked for is `softmax(scores) @ v` (through ops linear in p), and the probabilities
    reach this matmul through other ops. Not for a softmax whose refusal is recorded already."""
    for mm in graph.topo_order():
        if not _is(graph, mm, "matmul") or plan.grouped(mm):
            continue
        a = graph.operands(mm)[0]
        stack, seen, via = [a], set(), None
        while stack:
            n = stack.pop()
            op = graph.op(n)
            if n in seen or not isinstance(op, Op):
                continue
            seen.add(n)
            if op.kind == "softmax" and not plan.grouped(n) and n != a:
                if n in refused:
                    break
                refusal = Refusal(Rule.OP, f"attention is softmax(scores) @ v, the softmax along the "
                                  f"keys read by the matmul directly or through ops linear in it (casts, "
                                  f"products, where(c, p, 0)); here it "
                                  f"reaches the matmul through {describe_node(graph, via)}, which is not "
                                  "distributed over the product")
                remarks.append(FusionRemark.refused(NAME, refusal, op, graph.op(mm)))
                break
            if ops.is_elementwise(op.kind):
                via = via if via is not None else n
                stack.extend(graph.operands(n))


def _is(graph: Graph, node: int, kind: str) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind == kind


class _Match:
    """The attention structure around one softmax, or the reason there is none."""

    def __init__(self, graph: Graph, plan: GroupPlan, seed: int, remarks: list) -> None:
        # the op the score chain ends in: the softmax, or (with no softmax) p @ v itself
        self.graph, self.plan, self.seed, self.remarks = graph, plan, seed, remarks

    def refuse(self, rule: Rule, producer: int, consumer: int, detail: str) -> None:
        self.remarks.append(FusionRemark.refused(NAME, Refusal(rule, detail), self.graph.op(producer),
                                                 self.graph.op(consumer)))

    def members(self) -> tuple[list[int], AttentionSpec] | None:
        graph, sm = self.graph, self.seed
        p, p_ops = self._probabilities(sm)
        pv = [u for u, slot in graph.users(p) if slot == 0 and _is(graph, u, "matmul")]
        if not pv:
            return None  # not attention: fuse-rows takes the softmax
        pv = pv[0]
        op = graph.op(sm)
        if op.attr("axis") != len(op.shape) - 1:
            return self.refuse(Rule.TILE, sm, pv, f"the softmax runs along axis {op.attr('axis')}, not "
                               "along the keys (the last axis), so p @ v cannot consume it block by block")
        if p != sm and graph.op(p).dtype is not graph.op(pv).dtype:
            return self.refuse(Rule.OP, p, pv, f"the probabilities are cast to {graph.op(p).dtype}, not to "
                               f"the {graph.op(pv).dtype} that p @ v multiplies in")
        # returned as they are, the probabilities are stored by a second walk over the keys
        other = [u for u, slot in graph.users(p) if (u, slot) != (pv, 0) and u != graph.output]
        if other:
            return self.refuse(Rule.MATERIALIZE, sm, other[0], self._whole("the probabilities", other[0]))
        (x,) = graph.operands(sm)
        found = self._scores(x, op.shape)
        if found is None:
            return None
        qk, chain = found
        late = self._from_the_scores(p_ops, sm, x)
        if late is not None:
            n, o = late
            return self.refuse(Rule.CYCLE, o, n, (
                f"{describe_node(graph, n)} modifies the probabilities by {describe_node(graph, o)}, which "
                "is computed from a reduction of the scores over the keys (a row statistic such as their "
                "logsumexp, final only after the last key block); the kernel modifies each key block's "
                "probabilities as it walks the keys"))
        lse = self._logsumexps(x, len(op.shape) - 1)
        sums = self._key_sums([qk, *chain], len(op.shape) - 1)
        if p_ops:
            p_ops = p_ops + self._p_side(p_ops, {qk, sm, *chain})
        return self._group(qk, chain, pv, sm, p, lse, sums, "flash attention", "score modification", p_ops)

    def chain(self) -> tuple[list[int], AttentionSpec] | None:
        """With no softmax: `f(q @ k.T) @ v` for any elementwise score function `f` (a
        causal mask `where(causal(s), s, 0)`, a decay `s * gamma ** (i - j)`, a feature
        product), summed over the keys as it is, with sums of the score function over the
        keys kept beside it (a normaliser `sum(f(s), -1)`)."""
        graph, pv = self.graph, self.seed
        (p, res), v = graph.operand_edges(pv)
        shape = graph.result_type(p, res).shape
        # (a kernel an earlier pass formed computes no scores: `_scores` finds none in it)
        found = self._scores(p, shape)
        if found is None:
            return None
        qk, chain = found
        if not keys_are_data(graph.result_type(*graph.operand_edges(qk)[1]), graph.result_type(*v)) \
                or grouped_dot(graph, qk) or grouped_dot(graph, pv):  # experts' MLPs per token
            return None
        sums = self._key_sums([qk, *chain], len(shape) - 1)
        return self._group(qk, chain, pv, None, None, [], sums, "chained matmuls", "score function")

    def _group(self, qk: int, chain: list[int], pv: int, sm: int | None, p: int | None, lse: list[int],
               sums: list[int], what: str, mod: str,
               p_ops: list[int] = ()) -> tuple[list[int], AttentionSpec] | None:
        """The kernel's members and their roles: the scores' matmul and chain, what else reads
        the scores inside it (the softmax `sm` and its cast `p`, the logsumexps `lse` and the
        widenings they read, the sums over the keys and the side ops they read), p @ v, the
        operand prologues and the epilogue; or a refusal when something outside needs the
        scores."""
        graph = self.graph
        extra = {n for n in (sm, p) if n is not None} | set(lse) | set(sums) | set(p_ops)
        inside = set(chain) | extra | {pv}
        for n in [qk, *chain]:
            for u, _ in graph.users(n):
                if u not in inside:
                    return self.refuse(Rule.MATERIALIZE, n, u, self._whole("the scores", u))
        prologues = self._prologue(qk, 0, pv) | self._prologue(qk, 1, pv)
        members = {qk, pv, *chain, *extra, *prologues}
        # v read through an index map (a paged cache), by p @ v and the operand loads alone
        if self._gather(graph.operands(pv)[1], {pv, *prologues}):
            members.add(graph.operands(pv)[1])
        if self.plan.creates_cycle(members - {qk}, qk):
            return self.refuse(Rule.CYCLE, qk, pv, "a value the attention needs depends on its result")
        group = Group(self.plan, qk)
        for n in members - {qk}:
            group.add(n)
        self._epilogue(group, pv)
        n_mod = len(chain) + len(self._index_expressions(chain))
        mods = [f"{mod}: {n_mod} op{'s' if n_mod != 1 else ''}"] if chain else []
        if p_ops:
            mods.append(f"probability modification: {len(p_ops)} op{'s' if len(p_ops) != 1 else ''}")
        detail = what + (f" ({'; '.join(mods)})" if mods else "")
        self.remarks.append(FusionRemark(NAME, True, None, graph.op(qk), graph.op(pv), detail))

        def ordered(nodes) -> tuple[int, ...]:
            return tuple(sorted(nodes, key=self.plan.order.__getitem__))

        side = [n for n in sums if not _is(graph, n, "sum")]
        p_cast = p if p != sm and not p_ops else None
        spec = AttentionSpec(qk, pv, sm, p_cast, ordered([*chain, *side]),
                             ordered(n for n in lse if _is(graph, n, "logsumexp")),
                             ordered(n for n in lse if _is(graph, n, "cast")),
                             ordered(n for n in sums if _is(graph, n, "sum")),
                             ordered(n for n in group if n not in members), ordered(p_ops))
        return list(group), spec

    def _key_sums(self, values: list[int], axis: int) -> list[int]:
        """`sum`s over the keys of score-space values, and the elementwise ops of the score
        shape between them (`sum(cast(s, f32), -1)`) that nothing else reads: accumulated
        beside p @ v."""
        graph = self.graph
        shape = graph.op(values[0]).shape  # the scores' (values[0] is q @ k.T)
        values = [v for v in values if graph.op(v).shape == shape]  # not the chain's scalars
        side: list[int] = []
        sums: list[int] = []
        seen = set(values)
        work = deque(values)
        while work:
            for u, _ in graph.users(work.popleft()):
                op = graph.op(u)
                if u in seen or self.plan.grouped(u) or not isinstance(op, Op):
                    continue
                seen.add(u)
                if op.kind == "sum" and op.attr("axis") == axis and op.dtype.is_float:
                    sums.append(u)
                elif elementwise_candidate(graph, u) and op.shape == shape:
                    side.append(u)
                    work.append(u)
        # a side op read by anything but the sums and other side ops stays outside
        kept = set(side)
        changed = True
        while changed:
            changed = False
            for n in side:
                if n in kept and any(u not in kept and u not in sums for u, _ in graph.users(n)):
                    kept.discard(n)
                    changed = True
        inside = set(values) | kept
        return [n for n in side if n in kept] + [n for n in sums if graph.operands(n)[0] in inside]

    def _logsumexps(self, x: int, axis: int) -> list[int]:
        """`logsumexp` of the scores over the keys, read directly or through a widening cast
        to f32 that only logsumexps read (the kernel computes it in f32 either way): the
        kernel stores it too."""
        graph = self.graph

        def lse(n: int) -> bool:
            return _is(graph, n, "logsumexp") and graph.op(n).attr("axis") == axis \
                and not self.plan.grouped(n)

        found = [u for u, _ in graph.users(x) if lse(u)]
        for c, _ in graph.users(x):
            readers = [u for u, _ in graph.users(c)]
            if _is(graph, c, "cast") and graph.op(c).dtype is DType.F32 and not self.plan.grouped(c) \
                    and readers and all(lse(u) for u in readers):
                found += [c, *readers]
        return found

    def _probabilities(self, sm: int) -> tuple[int, list[int]]:
        """The probabilities as p @ v reads them: the softmax, or its one cast (p, cast to the
        dtype of v, is what a flash kernel feeds the second dot anyway); or the end of a chain
        of ops linear in p, each the only reader of the last (dropout's `p * where(rand(p,
        seed) >= r, 1 / (1 - r), 0)`, a mask `where(c, p, 0)`, casts), and those ops with the
        side values only they read (the dropout mask, computed from positions and the seed).
        A kernel applies them to each key block's p once its sum is in the normaliser."""
        graph, shape = self.graph, self.graph.op(sm).shape
        p, chain = sm, []
        while len(graph.users(p)) == 1:
            (u, slot), = graph.users(p)
            op = graph.op(u)
            if not isinstance(op, Op) or self.plan.grouped(u) or op.shape != shape:
                break
            if not ops.linear_in(graph, u, slot):
                break
            chain.append(u)
            p = u
        if len(chain) == 1 and _is(graph, p, "cast"):
            return p, []  # the one cast the kernel's narrowing of P is
        return p, chain

    def _from_the_scores(self, p_ops: list[int], sm: int, x: int) -> tuple[int, int] | None:
        """An op on the probabilities and its other operand computed from a reduction of the
        scores `x` over the keys (a sink's factor sigmoid(logsumexp(x) - sink) left on p when
        hoist-row-scale did not move it past p @ v): the kernel applies the ops to each key
        block's p inside its loop, where such a row statistic is not known yet. Elementwise
        ops of the scores (`where(s > t, p, 0)`) it computes at the block."""
        graph = self.graph
        chain = {sm, *p_ops}

        below = nx.descendants(graph.nx, x)  # the values computed from the scores

        def from_scores(n: int) -> bool:
            return n in below

        def reduces_the_scores(o: int) -> bool:
            read = lambda n: [m for m in graph.operands(n) if from_scores(m)]  # noqa: E731
            return any(not ops.is_elementwise(graph.op(n).kind)
                       for n in walk([o] if from_scores(o) else [], read))

        for n in p_ops:
            for o in graph.operands(n):
                if o not in chain and reduces_the_scores(o):
                    return n, o
        return None

    def _p_side(self, p_ops: list[int], members: set[int]) -> list[int]:
        """The side values of the ops on the probabilities that only the kernel reads (a
        dropout mask from the positions and a seed; an index the score modification reads
        too, which the kernel then computes with the scores)."""
        graph = self.graph
        inside = set(p_ops) | members
        work = deque(o for n in p_ops for o in graph.operands(n) if o not in inside)
        side: list[int] = []
        while work:
            n = work.popleft()
            op = graph.op(n)
            if n in inside or not isinstance(op, Op) or op.shape == () or self.plan.grouped(n) \
                    or not (op.kind == "index" or elementwise_candidate(graph, n)) \
                    or any(u not in inside for u, _ in graph.users(n)):
                continue
            inside.add(n)
            side.append(n)
            work.extend(graph.operands(n))
        return side

    def _index_expressions(self, chain: list[int]) -> set[int]:
        """The index expressions (`causal`'s comparison) the chain reads: cloned into the
        kernel, not members, but part of the score modification it reports."""
        graph, out = self.graph, set()
        stack = [o for n in chain for o in graph.operands(n)]
        while stack:
            n = stack.pop()
            op = graph.op(n)
            if n in out or not isinstance(op, Op) or op.shape == () or not is_clonable(graph, n):
                continue
            out.add(n)
            stack.extend(graph.operands(n))
        return out

    def _whole(self, what: str, user: int) -> str:
        return (f"{what} are also used by {describe_node(self.graph, user)}, which needs them whole; "
                "the flash-attention kernel never stores them")

    def _scores(self, x: int, shape) -> tuple[int, list[int]] | None:
        """The matmul that computes the scores and the elementwise ops from it to `x`."""
        graph = self.graph
        reach: list[int] = []
        matmuls: list[int] = []
        seen: set[int] = set()
        work = deque([x])
        while work:
            n = work.popleft()
            if n in seen:
                continue
            seen.add(n)
            op = graph.op(n)
            if not isinstance(op, Op) or op.shape not in (shape, ()) or self.plan.grouped(n):
                continue
            if op.kind == "matmul" and op.shape == shape:
                matmuls.append(n)
            elif elementwise_candidate(graph, n):
                reach.append(n)
                work.extend(graph.operands(n))
        if not matmuls:
            return None  # softmax of something else: not attention
        if len(matmuls) > 1:
            first, second = sorted(matmuls, key=self.plan.order.__getitem__)[:2]
            if not _is(graph, self.seed, "softmax"):
                return None  # two matmuls meeting elementwise: a dual GEMM's, fuse-epilogue's
            return self.refuse(Rule.OP, second, self.seed,
                               f"the scores come from two matmuls ({describe_node(graph, first)} and "
                               f"{describe_node(graph, second)}); a flash kernel computes one")
        (qk,) = matmuls
        order = sorted(reach, key=self.plan.order.__getitem__)
        uses_qk: dict[int, bool] = {}
        for n in order:
            uses_qk[n] = any(o == qk or uses_qk.get(o, False) for o in graph.operands(n))
        if x != qk and not uses_qk.get(x):
            return None
        # Side values (a bias computed from other tensors, a scalar expression like `N - M`)
        # join when only the scores use them; ones that something else also needs stay
        # outside: they are stored anyway, and the kernel reads them at the score tile.
        chain = set(order)
        changed = True
        while changed:
            changed = False
            for n in order:
                if n in chain and not uses_qk[n] and any(
                        u not in chain and u != self.seed for u, _ in graph.users(n)):
                    chain.discard(n)
                    changed = True
        return qk, [n for n in order if n in chain]

    def _prologue(self, qk: int, slot: int, pv: int) -> set[int]:
        """Cheap elementwise ops on one matmul operand, from one tensor plus scalars, that only
        the matmul uses (through a transpose of the last two dims for k); a gather k shares
        with v (`kv = cache[table]`, `q @ kv.T`, `p @ kv`) loads through its index for both."""
        graph = self.graph
        out: set[int] = set()
        node, user = graph.operands(qk)[slot], qk
        spent = 0  # the prologue's units per element so far
        while not self.plan.grouped(node):
            op = graph.op(node)
            if self._gather(node, {user, pv} if slot == 1 else {user}):
                out.add(node)  # loaded through its index; what it gathers from is stored
                break
            if [u for u, _ in graph.users(node)] != [user]:
                break
            if isinstance(op, Op) and op.kind == "transpose" and slot == 1 and op.attr("dims") == (
                    op.type.rank - 2, op.type.rank - 1) and not any(
                    graph.op(n).kind == "transpose" for n in out):
                nxt = graph.operands(node)[0]
                if not elementwise_candidate(graph, nxt):
                    break  # a plain `k.T`: read in place through its strides
            elif elementwise_candidate(graph, node) and prologue_op_refusal(graph, node, False,
                                                                          spent=spent) is None:
                spent += prologue_units(graph, node)
                nxt = next(s for s, r in graph.operand_edges(node) if graph.result_type(s, r).rank > 0)
            else:
                break
            out.add(node)
            node, user = nxt, node
        return out

    def _gather(self, node: int, readers: set[int]) -> bool:
        """A gather only the operand loads `readers` read, at index expressions
        (`k_cache[block_table[b, j // P], j % P]`): the kernel loads the operand tile through
        the index it computes over the tile."""
        graph = self.graph
        return _is(graph, node, "take") and not self.plan.grouped(node) \
            and {u for u, _ in graph.users(node)} <= readers \
            and all(is_clonable(graph, o) for o in graph.operands(node)[1:])

    def _epilogue(self, group: Group, pv: int) -> None:
        """Elementwise consumers of the output, element for element, and the producers of
        their other operands, as in fuse-epilogue; first the values per query row computed
        from a stored logsumexp (a sink's `sigmoid(lse - sink)`), which the epilogue reads
        broadcast along the output's last dim."""
        graph = self.graph
        shape = graph.op(pv).shape
        # per query row: logsumexps and sums over the keys
        lse = {m for m in group if _is(graph, m, "logsumexp") or _is(graph, m, "sum")}
        # index expressions the score modification reads: outlining clones each once per
        # kernel, so the epilogue cannot read one too (it has the output's tile, not the
        # scores'); what reads one of them stays outside
        in_scores = self._index_expressions([m for m in group if m != pv])
        rows = self._row_values(group, lse, shape[:-1] + (1,), in_scores)
        epilogue: set[int] = set(rows)
        work = deque([pv])
        while work:
            member = work.popleft()
            # consumers of the output, and producers of the epilogue's other operands (a gate
            # `sigmoid(g)`), which the kernel computes at the output tile
            producers = graph.operands(member) if member in epilogue else []
            for cand in dict.fromkeys([u for u, _ in graph.users(member)] + producers):
                if cand in group or self.plan.grouped(cand) or not elementwise_candidate(graph, cand):
                    continue
                # the score modification is computed per block of keys, the epilogue at the
                # output: a value cannot be read in both
                inner = [o for o in graph.operands(cand) if o in group and o != pv and o not in epilogue
                         and o not in lse]
                inner += [u for u, _ in graph.users(cand) if u in group and u not in epilogue]
                inner += sorted(self._index_expressions([cand]) & in_scores, key=self.plan.order.__getitem__)
                why = epilogue_refusal(graph, group, cand, shape, "the attention output",
                                       epilogue - rows, broadcast=rows | lse)
                if inner:
                    why = Refusal(Rule.OTHER_INDEX, f"{describe_node(graph, inner[0])} is computed per "
                                  "block of keys, the epilogue at the output")
                if why is None:
                    why = self.plan.cycle_refusal(group, cand)
                if why is not None:
                    producer, consumer = (cand, member) if cand in graph.operands(member) else (member, cand)
                    self.refuse(why.rule, producer, consumer, why.detail)
                    continue
                group.add(cand)
                epilogue.add(cand)
                work.append(cand)

    def _row_values(self, group: Group, lse: set[int], row_shape, in_scores: set[int]) -> set[int]:
        """Elementwise ops of the rows' shape [..., M, 1] (or [..., M]) computed from the kernel's
        logsumexps and sums over the keys (a cast of the logsumexp to f32, returned) and from
        scalars and inputs that broadcast to the rows: the kernel has them once the recurrence
        is finished, per query row (one read by nothing else is stored per row). Not from an
        index expression the scores read (`in_scores`)."""
        graph, rows = self.graph, set()
        work = deque(lse)
        while work:
            member = work.popleft()
            for cand, _ in graph.users(member):
                op = graph.op(cand)
                if cand in group or self.plan.grouped(cand) or not elementwise_candidate(graph, cand) \
                        or op.shape not in (row_shape, row_shape[:-1]):
                    continue
                if not all(o in group or _row_input(graph, o, op.shape) for o in graph.operands(cand)) \
                        or self._index_expressions([cand]) & in_scores:
                    continue
                if self.plan.creates_cycle(group, cand):
                    continue
                group.add(cand)
                rows.add(cand)
                work.append(cand)
        return rows


def _row_input(graph: Graph, node: int, row_shape) -> bool:
    """A value from outside the kernel that an op per query row can read: a parameter,
    constant, dim or scalar expression broadcasting to the rows."""
    op = graph.op(node)
    if not isinstance(op, Op) or not (op.kind in ("param", "dim", "const") or is_clonable(graph, node)):
        return False
    return broadcasts_to(op.shape, row_shape)
