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

Recognised by the algebra of the graph, not by a pattern of the derivation: a
*score space* is a set of elementwise ops of one shape [.., M, N] computed from
one or more matmuls of that shape whose operands come from outside ("score
dots", recomputed per tile from their operand tiles), and read outside only by
*products* that contract one of its two axes with a tensor: `x.T @ y` or
`y.T @ x` (summed over the queries M) and `x @ y` (summed over the keys N).
A score-space value read any other way (a bias gradient, returned
probabilities) is stored per tile by one of the kernels, or, read by a chain of
sums (a broadcast bias's gradient), summed per tile and added into the result;
a score dot read otherwise refuses it ("materialize"). Elementwise ops on a
product that read nothing else but constants and scalars (a cast, a scale)
join it as its epilogue; sums of the products over batch axes (GQA's dk, dv
over a group's query heads) make the kernel walk those axes too; elementwise
ops with scalars on a dot's loaded operand (`(q * scale) @ k.T`, a widening
cast) are its prologue, computed on the tiles. The ops both kernels need are
cloned, so each kernel is a group. The plan (`attention_backward_plan`) adds
the mask bound whose blocks the walk skips.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion.admission import keys_are_data
from tiledsl.passes.fusion.attention import reduction_axes
from tiledsl.passes.fusion.grow import rewrite_groups
from tiledsl.passes.fusion.legality import GroupPlan, describe_node
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.regions import is_by_value, is_clonable
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.plans import AttentionBackwardPlan
from tiledsl.types import DType

NAME = "fuse-attention-backward"
VIEWS = ("transpose", "slice", "reshape")  # the runtime's views (`ViewStep`), no kernel


@register
@dataclass(frozen=True)
class FuseAttentionBackward(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        while True:
            refusals: list[FusionRemark] = []
            match = _find(graph, refusals)
            if match is None:  # what is left now was refused once
                ctx.remarks.extend(refusals)
                return
            ctx.remarks.append(match.remark(graph))
            match.widen(graph)
            match.own_prologues(graph)
            match.sink_transposes(graph)
            groups = match.split(graph)
            plan = GroupPlan(graph)
            for members in groups:
                plan.add_group(members)
            rewrite_groups(plan, AttentionBackwardPlan.template)


def _op(graph: Graph, node: int) -> Op | None:
    op = graph.op(node)
    return op if isinstance(op, Op) else None


def _is(graph: Graph, node: int, kind: str) -> bool:
    op = _op(graph, node)
    return op is not None and op.kind == kind


def _swaps_last(graph: Graph, node: int) -> bool:
    op = _op(graph, node)
    if op is None or op.kind != "transpose":
        return False
    rank = op.type.rank
    return {d % rank for d in op.attr("dims")} == {rank - 2, rank - 1}


@dataclass
class _Product:
    matmul: int
    x: int  # the score-space value
    over: str  # "queries" (x.T @ y, y.T @ x) or "keys" (x @ y)
    view: int | None  # the transpose of x the matmul reads (x.T @ y)


@dataclass
class _Match:
    dots: list[int]
    space: set[int]  # elementwise ops of the score shape
    products: list[_Product]
    stored: list[int]  # score-space values read whole outside (a bias gradient): stored per tile
    # score-space values summed over some axes by a chain of sums (a broadcast bias's
    # gradient): the kernel adds its tiles' sums to the result
    reduced: list[tuple[int, list[int]]]
    # products summed over batch axes too (dk, dv of grouped-query attention, summed over
    # the query heads of a group): the chain of sums after each, which the kernel's walk
    # over those axes performs
    batch_sums: dict[int, list[int]]

    def members(self, graph: Graph, over: str) -> list[int]:
        """The ops of the kernel summing over `over`: what its products read of the space."""
        chosen = [p for p in self.products if p.over == over]
        mine = over == self.storer
        roots = [p.x for p in chosen] + (self.stored + [x for x, _ in self.reduced] if mine else [])
        need = _ancestors(graph, roots, self.space | set(self.dots))
        out = need | {p.matmul for p in chosen} | {p.view for p in chosen if p.view is not None}
        out |= {n for m in out if _is(graph, m, "matmul") for o in graph.operands(m)
                for n in _prologue_ops(graph, o)}
        if mine:
            out |= {s for _, chain in self.reduced for s in chain}
        for p in chosen:
            chain = self.batch_sums.get(p.matmul, [])
            out |= set(chain) | set(_epilogue(graph, chain[-1] if chain else p.matmul))
        return sorted(out)

    @property
    def storer(self) -> str:
        """The kernel that stores the score-space values read outside: the queries kernel's
        programs cover every tile once, as the keys kernel's do."""
        return "queries" if any(p.over == "queries" for p in self.products) else "keys"

    def remark(self, graph: Graph) -> FusionRemark:
        sums = [f"over the {over}: " + ", ".join(describe_node(graph, p.matmul) for p in self.products
                                                 if p.over == over)
                for over in ("queries", "keys") if any(p.over == over for p in self.products)]
        plural = "s" if len(self.dots) != 1 else ""
        if self.stored:
            sums.append("stored per tile: " + ", ".join(describe_node(graph, n) for n in self.stored))
        if self.reduced:
            sums.append("summed per tile: " + ", ".join(describe_node(graph, chain[-1])
                                                        for _, chain in self.reduced))
        detail = f"flash attention backward ({len(self.dots)} score dot{plural}; {'; '.join(sums)})"
        return FusionRemark(NAME, True, None, graph.op(self.dots[0]), graph.op(self.products[-1].matmul),
                            detail)

    def widen(self, graph: Graph) -> None:
        """Sum the reductions in f32: the kernels add their tiles' sums atomically, which in
        a narrow float would round at every add. A cast back to the reduction's dtype
        follows it."""
        for k, (x, chain) in enumerate(self.reduced):
            last = graph.op(chain[-1])
            if last.dtype not in (DType.F16, DType.BF16):
                continue
            b = Builder(graph)
            wide = b.op("cast", [x], graph.op(x).span, dtype=DType.F32)
            self.space.add(wide)
            graph.set_operands(chain[0], [wide])
            for n in chain:
                b.retype(n)
            narrow = b.op("cast", [chain[-1]], last.span, dtype=last.dtype)
            for user, slot in graph.users(chain[-1]):
                if user != narrow:
                    edges = graph.operand_edges(user)
                    edges[slot] = (narrow, 0)
                    graph.set_operands(user, edges)
            self.reduced[k] = (wide, chain)

    def own_prologues(self, graph: Graph) -> None:
        """Each dot and product gets its own copy of an operand's prologue (which other
        kernels may read too), a transpose of it moved onto the tensor it loads (a view and
        an elementwise op with scalars commute): the kernel computes it on the tiles it
        loads."""
        for m in self.dots + [p.matmul for p in self.products]:
            edges = graph.operand_edges(m)
            if any(_prologue_ops(graph, o) for o, _ in edges):
                graph.set_operands(m, [(_copy_prologue(graph, o), 0) if _prologue_ops(graph, o) else (o, r)
                                       for o, r in edges])
                _remove_dead(graph, [o for o, _ in edges])

    def sink_transposes(self, graph: Graph) -> None:
        """A transposed product scaled or cast after its transpose (`(q.T @ ds).T * c`) is
        scaled before it, `(q.T @ ds * c).T`: the scale joins the kernel's epilogue and the
        transpose stays a view, stored through the result's strides."""
        for p in self.products:
            chain = self.batch_sums.get(p.matmul, [])
            node = chain[-1] if chain else p.matmul
            while True:
                node = ([node] + _epilogue(graph, node))[-1]  # the epilogue's last op
                users = graph.users(node)
                if len(users) != 1 or not _is(graph, users[0][0], "transpose"):
                    break
                t = users[0][0]
                after = graph.users(t)
                op = _op(graph, after[0][0]) if len(after) == 1 else None
                if op is None or not ops.is_elementwise(op.kind) or any(
                        o != t and not _scalar(graph, o) for o in graph.operands(after[0][0])):
                    break
                e = after[0][0]
                b = Builder(graph)
                moved = b.copy(op, [(node, 0) if o == t else (o, r) for o, r in graph.operand_edges(e)])
                view = b.copy(graph.op(t), [moved])
                graph.replace_uses(e, view)
                graph.remove(e)
                graph.remove(t)

    def split(self, graph: Graph) -> list[list[int]]:
        """One group per kernel; the keys kernel gets its own copy of the score ops."""
        kinds = {p.over for p in self.products}
        if len(kinds) == 1:
            return [self.members(graph, kinds.pop())]
        shared = set(self.members(graph, "queries"))
        mine = self.members(graph, "keys")
        clones: dict[int, int] = {}
        order = {n: i for i, n in enumerate(graph.topo_order())}
        b = Builder(graph)
        for n in sorted((n for n in mine if n in shared), key=order.__getitem__):
            clones[n] = b.copy(graph.op(n), [(clones.get(s, s), r) for s, r in graph.operand_edges(n)])
        for n in mine:  # the keys kernel's own ops read the copies
            edges = graph.operand_edges(n)
            if n not in shared and any(s in clones for s, _ in edges):
                graph.set_operands(n, [(clones.get(s, s), r) for s, r in edges])
        return [sorted(shared), [clones.get(n, n) for n in mine]]


def _find(graph: Graph, refusals: list[FusionRemark]) -> _Match | None:
    """The first score space, in topological order, whose score dots nothing else reads; the
    refusals of those before it. A space is the union of the products' closures that share
    an op or a dot."""
    order = {n: i for i, n in enumerate(graph.topo_order())}
    spaces: list[tuple[set[int], set[int]]] = []  # (dots, ops)
    for node in order:
        product = _product(graph, node)
        found = _space(graph, product.x, order) if product is not None else None
        if found is None:
            continue
        dots, space = set(found[0]), found[1]
        for other in [sp for sp in spaces if (sp[0] | sp[1]) & (dots | space)]:
            spaces.remove(other)
            dots |= other[0]
            space |= other[1]
        spaces.append((dots, space))
    for dot_set, space in sorted(spaces, key=lambda sp: min(order[n] for n in sp[0])):
        if not any(graph.op(n).kind == "exp" for n in space) and not keys_are_data(
                *(graph.result_type(*graph.operand_edges(d)[1]) for d in dot_set)):
            continue
        _grow(graph, space, dot_set, order)
        dots = sorted(dot_set, key=order.__getitem__)
        products, stored, reduced, refusal = [], [], [], None
        for n in sorted(space | dot_set, key=order.__getitem__):
            for user, _ in graph.users(n):
                if user in space or user in dot_set:
                    continue
                p = _product(graph, user)
                if p is None and _swaps_last(graph, user):
                    readers = graph.users(user)
                    p = _product(graph, readers[0][0]) if len(readers) == 1 else None
                chain = _sum_chain(graph, user)
                if p is not None and p.x == n:
                    if p.matmul not in {q.matmul for q in products}:
                        products.append(p)
                elif chain is not None:
                    reduced.append((n, chain))
                elif not _needs_whole(graph, user):
                    refusal = refusal or (n, user)
                elif n not in stored:
                    stored.append(n)
        if refusal is not None:
            n, user = refusal
            refusals.append(FusionRemark.refused(NAME, Refusal(Rule.MATERIALIZE, (
                f"{describe_node(graph, user)} reads {describe_node(graph, n)} of the attention backward's "
                "scores, and is neither a product summed over the queries or the keys nor a return or "
                "reduction, which a tile stored by the kernels would serve")), graph.op(n), graph.op(user)))
            continue
        if dot_set & set(stored):
            n = min(dot_set & set(stored), key=order.__getitem__)
            user = next(u for u, _ in graph.users(n) if u not in space)
            refusals.append(FusionRemark.refused(NAME, Refusal(Rule.MATERIALIZE, (
                f"{describe_node(graph, user)} reads the raw scores {describe_node(graph, n)}, which the "
                "attention backward kernels recompute per tile and never store")),
                graph.op(n), graph.op(user)))
            continue
        match = _Match(dots, space, products, stored, reduced, _batch_sums(graph, products, dots))
        # (prologues are copied into the kernels, `own_prologues`: they read loaded tensors)
        members = [n for n in match.members(graph, "queries") + match.members(graph, "keys")
                   if not _prologue(graph, n)]
        if GroupPlan(graph).creates_cycle(set(members[1:]), members[0]):
            refusals.append(FusionRemark.refused(NAME, Refusal(Rule.CYCLE, (
                "a value the attention backward kernels read depends on what they compute")),
                graph.op(dots[0]), graph.op(products[-1].matmul)))
            continue
        return match
    return None


def _sum_chain(graph: Graph, node: int) -> list[int] | None:
    """`sum`s of a float value (and `reshape`s merging two of their axes, canonicalize's
    merged reductions), each the only reader of the one before: the kernel sums its tiles
    over their axes and adds them into the last sum's result."""
    chain, x = [], graph.operands(node)[0] if _op(graph, node) is not None else None
    while _is(graph, node, "sum") and graph.op(node).dtype in (DType.F32, DType.F16, DType.BF16) \
            or _is(graph, node, "reshape"):
        chain.append(node)
        users = graph.users(node)
        if len(users) != 1:
            break
        node = users[0][0]
    while chain and not _is(graph, chain[-1], "sum"):
        chain.pop()
    if not chain or reduction_axes(graph.op(x).shape, [graph.op(n) for n in chain]) is None:
        return None
    return chain


def _batch_sums(graph: Graph, products: list[_Product], dots: list[int]) -> dict[int, list[int]]:
    """The sums over batch axes (and canonicalize's reshapes merging them) that read the
    products summed over the queries, when every such product has them over the same axes
    and the key-side operands of the score dots, loaded once per program, are broadcast
    along those axes: the dk/dv kernel then walks them with the query blocks (MQA/GQA's
    sum over the query heads sharing a key/value head). Otherwise none: the sums run
    after the kernel."""
    rank = graph.op(dots[0]).type.rank
    chains, found = {}, None
    for p in products:
        if p.over != "queries":
            continue
        users = graph.users(p.matmul)
        chain = (_sum_chain(graph, users[0][0]) if len(users) == 1 else None) or []
        summed = reduction_axes(graph.op(p.matmul).shape, [graph.op(n) for n in chain])
        if summed is None or graph.op(p.matmul).type.rank != rank or summed[1][-2:] != (rank - 2, rank - 1) \
                or any(a >= rank - 2 for a in summed[0]) or found is not None and summed[0] != found:
            return {}
        found = summed[0]
        chains[p.matmul] = chain
    if not found:
        return {}
    for d in dots:
        src, res = graph.operand_edges(d)[1]
        shape = graph.result_type(src, res).shape
        if any(shape[a - rank + len(shape)] != 1 for a in found if a - rank + len(shape) >= 0):
            return {}
    return chains


def _needs_whole(graph: Graph, user: int) -> bool:
    """Does `user` read a score-space value as a tensor the kernels can store per tile: the
    return, or a reduction (a broadcast bias's gradient)? Another op could instead join the
    space, or is one the space could not serve without storing its scores."""
    op = graph.op(user)
    return isinstance(op, Op) and (op.kind == "return" or ops.category(op.kind) is ops.Category.REDUCTION)


def _product(graph: Graph, node: int) -> _Product | None:
    """A matmul that contracts a computed value x of rank >= 2 with a tensor read as it is:
    `x.T @ y` and `y.T @ x` sum over x's rows, `x @ y` over its columns."""
    if not _is(graph, node, "matmul"):
        return None
    a, b = graph.operands(node)
    if _swaps_last(graph, a) and _computed(graph, x := graph.operands(a)[0]) and _outside(graph, b, x):
        return _Product(node, x, "queries", a)
    if _computed(graph, b) and _swaps_last(graph, a) and _outside(graph, a, b):
        return _Product(node, b, "queries", None)
    if _computed(graph, a) and _outside(graph, b, a):
        return _Product(node, a, "keys", None)
    return None


def _outside(graph: Graph, y: int, x: int) -> bool:
    """Is `y` a tensor the kernel can load beside score-space value `x`: one it loads anyway
    (not `_computed`), or one computed from no value of x's shape (`g * f` of a row factor
    f, which another kernel stores)?"""
    return not _computed(graph, y) or _external(graph, y, graph.op(x).shape)


def _external(graph: Graph, node: int, shape) -> bool:
    """Is `node` computed from no value of the score `shape` (so from none the attention
    backward kernels compute)? Another kernel stores it; theirs load it."""
    memo = graph.memo("attention-backward-external")
    key = (node, shape)
    if key not in memo:
        stack, seen, found = [node], set(), True
        while stack and found:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            op = graph.op(n)
            if isinstance(op, Op) and op.kind != "param":
                found = op.type.rank == 0 or op.shape != shape
                stack.extend(graph.operands(n))
        memo[key] = found
    return memo[key]


def _computed(graph: Graph, node: int) -> bool:
    """An elementwise op or matmul result (a value a kernel computes, not a tensor it loads)."""
    op = _op(graph, node)
    return op is not None and op.type.rank >= 2 and (ops.is_elementwise(op.kind) or op.kind == "matmul") \
        and not is_clonable(graph, node) and not _prologue(graph, node)


def _loaded(graph: Graph, node: int) -> bool:
    """A tensor a dot can load its tiles from: a parameter, a stored kernel result, or a
    view of one (a transpose, slice or reshape, read through its strides), or a prologue
    on one (`_prologue`), or a transpose of that."""
    if _is(graph, node, "transpose") and _prologue(graph, graph.operands(node)[0]):
        return True
    if _prologue(graph, node):
        return True
    while any(_is(graph, node, kind) for kind in VIEWS):
        (node,) = graph.operands(node)
    op = graph.op(node)
    return not isinstance(op, Op) or op.kind == "param"


def _scalar(graph: Graph, node: int) -> bool:
    """A scalar a kernel computes or is passed by value."""
    op = graph.op(node)
    return isinstance(op, Op) and op.type.rank == 0 and (is_by_value(op) or is_clonable(graph, node))


def _prologue(graph: Graph, node: int) -> bool:
    """An elementwise op of one loaded tensor (or of another prologue) and scalars: `q *
    scale`, an f16 tensor cast to f32 (mixed precision). The kernel computes it on the
    tiles it loads (in f32, rounded to the op's dtype before the dot)."""
    op = _op(graph, node)
    if op is None or op.type.rank < 2 or not ops.is_elementwise(op.kind) or is_clonable(graph, node):
        return False
    tensors = [(o, r) for o, r in graph.operand_edges(node) if not _scalar(graph, o)]
    if len(tensors) != 1 or graph.result_type(*tensors[0]).shape != op.shape:
        return False
    (src, _), = tensors
    return _loaded(graph, src)


def _prologue_ops(graph: Graph, node: int) -> list[int]:
    """The prologue ops a dot operand is computed by (through a transpose of them)."""
    if _is(graph, node, "transpose"):
        (node,) = graph.operands(node)
    out = []
    while _prologue(graph, node):
        out.append(node)
        node = next(o for o in graph.operands(node) if not _scalar(graph, o))
    return out


def _remove_dead(graph: Graph, nodes: list[int]) -> None:
    """Remove the ops among `nodes` that nothing reads now, and what only they read."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in graph.nx and isinstance(graph.op(n), Op) and graph.op(n).kind != "param" \
                and not graph.users(n):
            stack.extend(graph.operands(n))
            graph.remove(n)


def _copy_prologue(graph: Graph, node: int, transpose: Op | None = None) -> int:
    """A copy of the prologue `node` (of a transpose of one: the prologue of the transposed
    tensor, in its shape) for one dot's use."""
    if transpose is None and _is(graph, node, "transpose"):
        transpose, (node,) = graph.op(node), graph.operands(node)
    b = Builder(graph)
    edges = []
    for src, res in graph.operand_edges(node):
        if _prologue(graph, src):
            edges.append((_copy_prologue(graph, src, transpose), 0))
        elif transpose is not None and not _scalar(graph, src):  # the loaded tensor, transposed
            edges.append((b.copy(transpose, [(src, res)]), 0))
        else:
            edges.append((src, res))
    return b.copy(graph.op(node), edges)


def _space(graph: Graph, x: int, order: dict[int, int]) -> tuple[list[int], set[int]] | None:
    """The score dots and score-space ops `x` is computed from: elementwise ops of x's shape
    walked back to matmuls of that shape whose operands are loaded tensors. (`_find` keeps
    the spaces with probabilities, an `exp`, among their ops: attention's, and those whose
    dots multiply data (`admission.keys_are_data`: linear attention's, with no softmax); two
    GEMMs meeting in an activation, `relu(x @ w1) @ w2`, are left to the GEMM fusions.)"""
    shape = graph.op(x).shape
    stack, walked, dots = [x], set(), []
    while stack:
        n = stack.pop()
        op = _op(graph, n)
        if n in walked or op is None or op.shape != shape or is_clonable(graph, n):
            continue
        walked.add(n)
        if op.kind == "matmul":
            if not all(_loaded(graph, o) or _external(graph, o, shape) for o in graph.operands(n)):
                return None
            dots.append(n)
        elif ops.is_elementwise(op.kind):
            stack.extend(graph.operands(n))
    if not dots:
        return None
    # every elementwise op walked is computed at the tile: the path from the dots to x and
    # the side values it reads (a causal mask's comparison, ALiBi's `slopes * (j - i)`)
    return sorted(dots, key=order.__getitem__), {n for n in walked if ops.is_elementwise(graph.op(n).kind)}


def _grow(graph: Graph, space: set[int], dots: set[int], order: dict[int, int]) -> None:
    """Add the elementwise ops of the score shape computed from the space, its dots and values
    read at the tile (a bias gradient `ds * (j - i)` before its reduction; a decay's gradient
    `dp * s`, a product of two dots): stored per tile instead of the values they read."""
    shape = graph.op(next(iter(dots))).shape
    grown = True
    while grown:
        grown = False
        for n in sorted({u for m in space | dots for u, _ in graph.users(m)} - space - dots,
                        key=order.__getitem__):
            op = _op(graph, n)
            if op is None or op.shape != shape or not ops.is_elementwise(op.kind):
                continue
            if all(o in space or o in dots or graph.op(o).shape != shape or is_clonable(graph, o)
                   for o in graph.operands(n)):
                space.add(n)
                grown = True


def _ancestors(graph: Graph, roots: list[int], within: set[int]) -> set[int]:
    out, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n in out or n not in within:
            continue
        out.add(n)
        stack.extend(graph.operands(n))
    return out


def _epilogue(graph: Graph, product: int) -> list[int]:
    """Elementwise ops on the product alone (a cast, a scale by a scalar), one reader each,
    in order. Not one reading a tensor, even a value every reader recomputes (`y > s` with
    y: [N]): the kernel's epilogue loads no tensor (found by sweeping pipelines over
    generated programs: without cse a written-out attention is this pass's, an internal
    error)."""
    out, node = [], product
    while True:
        users = graph.users(node)
        if len(users) != 1:
            return out
        user = users[0][0]
        op = _op(graph, user)
        if op is None or not ops.is_elementwise(op.kind) or op.shape != graph.op(node).shape or any(
                o != node and not _scalar(graph, o) for o in graph.operands(user)):
            return out
        out.append(user)
        node = user
