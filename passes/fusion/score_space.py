"""Score spaces: the analysis the attention backward's passes share (widen-score-sums,
own-prologues, sink-transposes, fuse-attention-backward).

Recognised by the algebra of the graph, not by a pattern of the derivation: a
*score space* is a set of elementwise ops of one shape [.., M, N] computed from
one or more matmuls of that shape whose operands come from outside ("score
dots", recomputed per tile from their operand tiles), and read outside only by
*products* that contract one of its two axes with a tensor: `x.T @ y` or
`y.T @ x` (summed over the queries M) and `x @ y` (summed over the keys N), each of
the scores' batch (not one reading them broadcast along a batch axis of y).
A score-space value read any other way (a bias gradient, returned
probabilities) is stored per tile by one of the kernels, or, read by a chain of
sums (a broadcast bias's gradient), summed per tile and added into the result;
a score dot read otherwise refuses it ("materialize"). Elementwise ops on a
product that read nothing else but constants and scalars (a cast, a scale)
join it as its epilogue; sums of the products over batch axes (GQA's dk, dv
over a group's query heads) make the kernel walk those axes too; elementwise
ops with scalars on a dot's loaded operand (`(q * scale) @ k.T`, a widening
cast) are its prologue, computed on the tiles.

Decided once per pipeline run: the first of those passes to run finds the spaces
(`recorded`) and records the decision in the IR, a `Mark` on every score dot and
score op of a space (on the first dot of a refused one, with why), which the
printer shows; the later passes read the marks and derive from them what reads
each space (`derive`, a walk over the space's readers), and fuse-attention-backward,
which consumes them, clears them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from tiledsl import ops
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion.admission import grouped_dot, keys_are_data
from tiledsl.passes.fusion.attention import reduction_axes
from tiledsl.passes.fusion.legality import GroupPlan, describe_node
from tiledsl.passes.fusion.remarks import Refusal, Rule, describe
from tiledsl.passes.regions import is_by_value, is_clonable
from tiledsl.types import DType, format_shape

VIEWS = ("transpose", "slice", "reshape")  # the runtime's views (`ViewStep`), no kernel
NARROW = (DType.F16, DType.BF16)


@dataclass(frozen=True)
class Mark:
    """What the analysis decided about a node (`Graph.score_space`): it is a score dot,
    score op or product (`over`: what it sums over) of space `space` (numbered in the order
    found), at position `at` of the topological order the analysis saw (the order the
    passes after it keep, whatever nodes they add); on the first dot of a refused space,
    the refusal and the two ops it names."""

    space: int
    at: int
    over: str | None = None
    refused: tuple[Refusal, Op, Op] | None = None

    def __str__(self) -> str:
        role = f", product over the {self.over}" if self.over else ""
        return f"score space {self.space}{role}" + (
            f", refused [rule: {self.refused[0].rule}]" if self.refused else "")


@dataclass
class Product:
    matmul: int
    x: int  # the score-space value
    over: str  # "queries" (x.T @ y, y.T @ x) or "keys" (x @ y)
    view: int | None  # the transpose of x the matmul reads (x.T @ y)


@dataclass
class ScoreSpace:
    dots: list[int]
    space: set[int]  # elementwise ops of the score shape
    products: list[Product]
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
        out |= {n for m in out if is_op(graph, m, "matmul") for o in graph.operands(m)
                for n in prologue_ops(graph, o)}
        if mine:
            out |= {s for _, chain in self.reduced for s in chain}
        for p in chosen:
            chain = self.batch_sums.get(p.matmul, [])
            out |= set(chain) | set(epilogue(graph, chain[-1] if chain else p.matmul))
        return sorted(out)

    @property
    def storer(self) -> str:
        """The kernel that stores the score-space values read outside: the queries kernel's
        programs cover every tile once, as the keys kernel's do."""
        return "queries" if any(p.over == "queries" for p in self.products) else "keys"


class Recorded(NamedTuple):
    """One space as the marks record it."""

    space: int
    dots: list[int]
    ops: set[int]
    products: dict[int, str]  # matmul -> what it sums over
    refused: tuple[Refusal, Op, Op] | None


def recorded(graph: Graph) -> list[Recorded]:
    """The score spaces the marks record, in the order found. A graph with no mark is
    analysed first (`_find`) and marked."""
    if not any(graph.score_space(n) is not None for n in graph.nodes()):
        at = {n: i for i, n in enumerate(graph.topo_order())}
        for k, (dots, space, found, refused) in enumerate(_find(graph)):
            if refused is not None:
                graph.set_score_space(dots[0], Mark(k, at[dots[0]], refused=refused))
                continue
            for n in [*dots, *space]:
                graph.set_score_space(n, Mark(k, at[n]))
            for p in found.products:
                graph.set_score_space(p.matmul, Mark(k, at[p.matmul], p.over))
    marks = sorted(((m.at, n, m) for n in graph.nodes() if (m := graph.score_space(n)) is not None),
                   key=lambda t: t[:2])
    out: dict[int, Recorded] = {}
    for _, n, m in marks:
        rec = out.setdefault(m.space, Recorded(m.space, [], set(), {}, None))
        if m.refused is not None:
            out[m.space] = rec = rec._replace(refused=m.refused)
        if m.over is not None:
            rec.products[n] = m.over
        elif is_op(graph, n, "matmul"):
            rec.dots.append(n)
        else:
            rec.ops.add(n)
    return [out[k] for k in sorted(out)]


def clear(graph: Graph) -> None:
    """Drop the marks: the spaces are fused or refused, and nothing reads them after."""
    for n in list(graph.nodes()):
        if graph.score_space(n) is not None:
            graph.set_score_space(n, None)


def derive(graph: Graph, rec: Recorded, narrow_sums: bool = True
           ) -> tuple[ScoreSpace | None, tuple[Refusal, Op, Op] | None]:
    """The space `rec` records, with what reads it in the graph as it is now: the values
    stored or summed per tile, the products' sums over batch axes; or why the kernels
    cannot serve a reader. `narrow_sums=False`: a chain of f16 or bf16 sums (not widened to
    f32, `widen-score-sums`) refuses the space."""
    if rec.refused is not None:
        return None, rec.refused
    return _derive(graph, rec.dots, rec.ops, {n: (graph.score_space(n).at, n) for n in [*rec.dots, *rec.ops]},
                   lambda user: _recorded_product(graph, user, rec), narrow_sums)


def spaces(graph: Graph) -> Iterator[ScoreSpace]:
    """The recorded spaces the kernels can serve, each derived from the graph as it is when
    reached (a rewrite of one may change what reads the next), for the passes that prepare
    them; fuse-attention-backward reports the refused ones."""
    for rec in recorded(graph):
        found = derive(graph, rec)[0]
        if found is not None:
            yield found


def _recorded_product(graph: Graph, node: int, rec: Recorded) -> Product | None:
    over = rec.products.get(node)
    if over is None:
        return None
    a, b = graph.operands(node)
    if over == "keys":
        return Product(node, a, over, None)
    if swaps_last(graph, a) and graph.operands(a)[0] in rec.ops:
        return Product(node, graph.operands(a)[0], over, a)
    return Product(node, b, over, None)


def _derive(graph: Graph, dots: list[int], space: set[int], order: dict[int, int | tuple[int, int]],
            product: Callable[[int], Product | None], narrow_sums: bool = True
            ) -> tuple[ScoreSpace | None, tuple[Refusal, Op, Op] | None]:
    """`derive` of the dots and score ops given, in `order`, with the products `product`
    recognises: `_product` while the analysis runs, the marks after it."""
    dots = sorted(dots, key=order.__getitem__)
    dot_set = set(dots)
    products, stored, reduced, refusal = [], [], [], None
    for n in sorted(space | dot_set, key=order.__getitem__):
        for user, _ in graph.users(n):
            if user in space or user in dot_set:
                continue
            p = product(user)
            if p is None and swaps_last(graph, user):
                readers = graph.users(user)
                p = product(readers[0][0]) if len(readers) == 1 else None
            chain = _sum_chain(graph, user)
            if chain is not None and not narrow_sums and graph.op(chain[-1]).dtype in NARROW:
                last = graph.op(chain[-1])
                return None, (Refusal(Rule.PROFIT, (
                    f"{describe(last)} sums the scores in {last.dtype}, which the kernels' atomic adds "
                    "would round at every add (widen-score-sums sums them in f32)")), graph.op(n), last)
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
        if is_op(graph, user, "matmul") and _broadcasts_scores(graph, user, n):
            return None, (Refusal(Rule.OTHER_INDEX, (
                f"{describe_node(graph, user)} reads {describe_node(graph, n)} of the attention backward's "
                f"scores broadcast from {format_shape(graph.op(n).shape)} to the batch of its "
                f"{format_shape(graph.op(user).shape)}, and the kernels run one program per batch "
                "element of the scores")), graph.op(n), graph.op(user))
        return None, (Refusal(Rule.MATERIALIZE, (
            f"{describe_node(graph, user)} reads {describe_node(graph, n)} of the attention backward's "
            "scores, and is neither a product summed over the queries or the keys nor a return or "
            "reduction, which a tile stored by the kernels would serve")), graph.op(n), graph.op(user))
    if dot_set & set(stored):
        n = min(dot_set & set(stored), key=order.__getitem__)
        user = next(u for u, _ in graph.users(n) if u not in space)
        return None, (Refusal(Rule.MATERIALIZE, (
            f"{describe_node(graph, user)} reads the raw scores {describe_node(graph, n)}, which the "
            "attention backward kernels recompute per tile and never store")), graph.op(n), graph.op(user))
    for _, chain in reduced:
        # the kernels add each tile's sum into the chain's result as they walk: it is
        # complete only after them, so a score op reading it (`o * sum(o)` of a product
        # `o = p @ v` taken for a dot when no fuse-attention ran first) cannot be computed
        reader = next((u for u, _ in graph.users(chain[-1]) if u in space or u in dot_set), None)
        if reader is not None:
            return None, (Refusal(Rule.CYCLE, (
                f"{describe_node(graph, reader)} reads {describe_node(graph, chain[-1])}, a sum of the "
                "attention backward's scores that the kernels add their tiles into, complete only "
                "after them")), graph.op(chain[-1]), graph.op(reader))
    found = ScoreSpace(dots, space, products, stored, reduced, _batch_sums(graph, products, dots))
    # (prologues are copied into the kernels, `own-prologues`: they read loaded tensors)
    members = [n for n in found.members(graph, "queries") + found.members(graph, "keys")
               if not is_prologue(graph, n)]
    if GroupPlan(graph).creates_cycle(set(members[1:]), members[0]):
        return None, (Refusal(Rule.CYCLE, "a value the attention backward kernels read depends on what "
                              "they compute"), graph.op(dots[0]), graph.op(products[-1].matmul))
    return found, None


def _find(graph: Graph) -> list[tuple[list[int], set[int], ScoreSpace | None, tuple[Refusal, Op, Op] | None]]:
    """The score spaces, in topological order of their first dots, each with what reads it
    or the refusal of one the kernels cannot serve. A space is the union of the products'
    closures that share an op or a dot."""
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
    out = []
    for dot_set, space in sorted(spaces, key=lambda sp: min(order[n] for n in sp[0])):
        if not any(graph.op(n).kind == "exp" for n in space) and not keys_are_data(
                *(graph.result_type(*graph.operand_edges(d)[1]) for d in dot_set)):
            continue
        if any(grouped_dot(graph, d) for d in dot_set):  # experts' MLPs per token
            continue
        _grow(graph, space, dot_set, order)
        dots = sorted(dot_set, key=order.__getitem__)
        out.append((dots, space, *_derive(graph, dots, space, order, lambda user: _product(graph, user))))
    return out


def _op(graph: Graph, node: int) -> Op | None:
    op = graph.op(node)
    return op if isinstance(op, Op) else None


def is_op(graph: Graph, node: int, kind: str) -> bool:
    op = _op(graph, node)
    return op is not None and op.kind == kind


def swaps_last(graph: Graph, node: int) -> bool:
    """Is `node` a transpose of its last two dims (`x.T`)?"""
    op = _op(graph, node)
    if op is None or op.kind != "transpose":
        return False
    rank = op.type.rank
    return {d % rank for d in op.attr("dims")} == {rank - 2, rank - 1}


def _sum_chain(graph: Graph, node: int) -> list[int] | None:
    """`sum`s of a float value (and `reshape`s merging two of their axes, canonicalize's
    merged reductions), each the only reader of the one before: the kernel sums its tiles
    over their axes and adds them into the last sum's result."""
    chain, x = [], graph.operands(node)[0] if _op(graph, node) is not None else None
    while is_op(graph, node, "sum") and graph.op(node).dtype in (DType.F32, *NARROW) \
            or is_op(graph, node, "reshape"):
        chain.append(node)
        users = graph.users(node)
        if len(users) != 1:
            break
        node = users[0][0]
    while chain and not is_op(graph, chain[-1], "sum"):
        chain.pop()
    if not chain or reduction_axes(graph.op(x).shape, [graph.op(n) for n in chain]) is None:
        return None
    return chain


def _batch_sums(graph: Graph, products: list[Product], dots: list[int]) -> dict[int, list[int]]:
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


def _product(graph: Graph, node: int) -> Product | None:
    """A matmul that contracts a computed value x of rank >= 2 with a tensor read as it is:
    `x.T @ y` and `y.T @ x` sum over x's rows, `x @ y` over its columns. Not one that reads
    x broadcast along a batch axis (`_broadcasts_scores`)."""
    if not is_op(graph, node, "matmul"):
        return None
    a, b = graph.operands(node)
    if swaps_last(graph, a) and _computed(graph, x := graph.operands(a)[0]) and _outside(graph, b, x):
        found = Product(node, x, "queries", a)
    elif _computed(graph, b) and swaps_last(graph, a) and _outside(graph, a, b):
        found = Product(node, b, "queries", None)
    elif _computed(graph, a) and _outside(graph, b, a):
        found = Product(node, a, "keys", None)
    else:
        return None
    return None if _broadcasts_scores(graph, node, found.x) else found


def _broadcasts_scores(graph: Graph, matmul: int, x: int) -> bool:
    """Does `matmul` read score value `x` broadcast along a batch axis, its result having
    batch elements x lacks (`exp(x @ w) @ wb` with x: [M, N], wb: [H, N, N])? The kernels
    run one program per batch element of the scores and a block of its rows or keys, and
    accumulate one product tile there; a product over more batch elements would need the
    scores recomputed for each of them."""
    return graph.op(matmul).shape[:-2] != graph.op(x).shape[:-2]


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
        and not is_clonable(graph, node) and not is_prologue(graph, node)


def _loaded(graph: Graph, node: int) -> bool:
    """A tensor a dot can load its tiles from: a parameter, a stored kernel result, or a
    view of one (a transpose, slice or reshape, read through its strides), or a prologue
    on one (`is_prologue`), or a transpose of that."""
    if is_op(graph, node, "transpose") and is_prologue(graph, graph.operands(node)[0]):
        return True
    if is_prologue(graph, node):
        return True
    while any(is_op(graph, node, kind) for kind in VIEWS):
        (node,) = graph.operands(node)
    op = graph.op(node)
    return not isinstance(op, Op) or op.kind == "param"


def scalar(graph: Graph, node: int) -> bool:
    """A scalar a kernel computes or is passed by value."""
    op = graph.op(node)
    return isinstance(op, Op) and op.type.rank == 0 and (is_by_value(op) or is_clonable(graph, node))


def is_prologue(graph: Graph, node: int) -> bool:
    """An elementwise op of one loaded tensor (or of another prologue) and scalars: `q *
    scale`, an f16 tensor cast to f32 (mixed precision). The kernel computes it on the
    tiles it loads (in f32, rounded to the op's dtype before the dot)."""
    op = _op(graph, node)
    if op is None or op.type.rank < 2 or not ops.is_elementwise(op.kind) or is_clonable(graph, node):
        return False
    tensors = [(o, r) for o, r in graph.operand_edges(node) if not scalar(graph, o)]
    if len(tensors) != 1 or graph.result_type(*tensors[0]).shape != op.shape:
        return False
    (src, _), = tensors
    return _loaded(graph, src)


def prologue_ops(graph: Graph, node: int) -> list[int]:
    """The prologue ops a dot operand is computed by (through a transpose of them)."""
    if is_op(graph, node, "transpose"):
        (node,) = graph.operands(node)
    out = []
    while is_prologue(graph, node):
        out.append(node)
        node = next(o for o in graph.operands(node) if not scalar(graph, o))
    return out


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


def epilogue(graph: Graph, product: int) -> list[int]:
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
                o != node and not scalar(graph, o) for o in graph.operands(user)):
            return out
        out.append(user)
        node = user
