"""recompute: cheap values of a smaller shape are computed again by every kernel that reads them.

Before: `sqrt(abs(y))` with `y: [N]` read by an `[M, N]` chain, or document ids compared as
`dq == dk` (`[M, 1]` and `[1, N]`) in the mask of an attention over `[H, M, N]`. Fusion
refuses a producer that its consumer reads broadcast ("other-index"), so each became a
kernel of its own, writing its result for the next kernel to read.
After: such values are marked recomputed (the IR prints `// recomputed by each reader`).
Fusion passes leave them alone, and every kernel that reads one clones its expression, as
it does scalar and index expressions (`regions.is_clonable`), reading the expression's
inputs at its own tile.

A value is recomputed when
- it is an elementwise op of rank > 0 whose operands are parameters, dims, constants,
  scalar or index expressions, or recomputed values, so that a clone needs no other
  kernel's result (a gathered operand must be a parameter);
- every reader is an elementwise op, a reduction or a softmax that reads it broadcast to a
  larger shape, a scatter reading it as an index broadcast over the values it writes, or a
  recomputed value; it is not returned, not gathered from, and does not
  reach a matmul operand through ops read once each (such a chain may become a dot
  prologue, which reads tensors, not tiles of an index space);
- its expression costs at most `profitability.RECOMPUTE_BUDGET` operation units per element.
Each decision is a fused remark; a value refused for its cost is a "profit" refusal.

First, a slice of a computed elementwise value (`qn[..., D // 2:]`, RoPE's rotate_half of a
normalised q; `cos(ang)[:, None]`) is computed from slices of its operands instead: the
slice moves up the chain to parameters (views, read through strides) and to values it does
not restrict (constants, scalar and index expressions), and the chain's ops are computed
again at the slice's elements: `cos(ang)[:, None]` becomes an elementwise value its readers
can recompute. Moved when every op on the way is elementwise (not `index`, whose value is a
position, nor a gather), it reaches no other value (a row statistic: the moved ops would
run over the slice's shape, where no row program reads them), and the chain costs at most
`RECOMPUTE_BUDGET` operation units per element. Not moved: a view inserting size-1 dims
that elementwise ops read broadcast along their trailing dims, of a value whose chain feeds
another value too (`a[..., None]` of a merge of attention states, whose `a` also gives the
merged lse), which seeds a row program computing both once a row
(`fusion.grow.broadcast_axes`).
Runs before the fusion passes, which read its marks. After one, it leaves the kernels
formed as they are: a slice of a kernel's result is a view of a stored tensor, a chain
reading one is not moved (a kernel's result is no value a clone reads as it is), and a
value a kernel reads is not recomputed (its reader is no elementwise op).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.ops.structure import format_items
from tiledsl.passes.fusion.grow import broadcast_axes, computed_view, shared_chain
from tiledsl.passes.fusion.profitability import RECOMPUTE_BUDGET, recompute_refusal
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.regions import feeds_dot, is_clonable
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import broadcasts_to, format_shape

NAME = "recompute"


@register
@dataclass(frozen=True)
class Recompute(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for node in graph.topo_order():
            if node in graph.nx and graph.op(node).kind == "slice":
                _move_slice(graph, node, ctx)
        order = graph.topo_order()
        too_costly: dict[int, int] = {}  # value -> its units when it was refused
        while True:
            chosen = _decide(graph, order, too_costly)
            units = _units(graph, order, chosen)
            over = {n: units[n] for n in chosen if recompute_refusal(units[n])}
            if not over:
                break
            too_costly.update(over)
        for n in order:
            readers = list(dict.fromkeys(u for u, _ in graph.users(n) if u not in chosen))
            if n in chosen:
                graph.set_recomputed(n)
                cost = f"{_plural(units[n], 'operation unit')} per element, within {RECOMPUTE_BUDGET}"
                for u in readers:
                    ctx.remarks.append(FusionRemark(
                        NAME, True, None, graph.op(n), graph.op(u),
                        f"computed again at each {format_shape(graph.op(u).shape)} element of its "
                        f"reader ({cost}) instead of stored as {format_shape(graph.op(n).shape)} by a "
                        "kernel of its own"))
            elif n in too_costly and readers:
                refusal = Refusal(Rule.PROFIT, recompute_refusal(too_costly[n]))
                ctx.remarks.append(FusionRemark.refused(NAME, refusal, graph.op(n), graph.op(readers[0])))


def _decide(graph: Graph, order: list[int], excluded) -> set[int]:
    """The values to recompute, given those refused for their cost."""
    memo: dict[int, bool] = {}
    chosen = {n for n in _candidates(graph, order) if n not in excluded and _computable(graph, n, memo)}
    # readers and operands must agree: drop values until both conditions hold, revisiting
    # the neighbours of each value dropped
    work = list(chosen)
    while work:
        n = work.pop()
        if n in chosen and not (_readers_ok(graph, n, chosen) and _operands_ok(graph, n, chosen, memo)):
            chosen.discard(n)
            work.extend(o for o in graph.operands(n) if o in chosen)
            work.extend(u for u, _ in graph.users(n) if u in chosen)
    return chosen


def _candidates(graph: Graph, order: list[int]) -> set[int]:
    """Elementwise values some elementwise reader reads broadcast, and the elementwise
    values they are computed from: the only ones worth the checks (a program whose
    elementwise ops all share one shape has none)."""
    def elementwise(n: int) -> bool:
        op = graph.op(n)
        return isinstance(op, Op) and ops.is_elementwise(op.kind) and op.shape != ()

    stack = [n for n in order if elementwise(n) and any(
        elementwise(u) and graph.op(u).shape != graph.op(n).shape for u, _ in graph.users(n))]
    found: set[int] = set()
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(o for o in graph.operands(n) if elementwise(o))
    return found


def _units(graph: Graph, order: list[int], chosen: set[int]) -> dict[int, int]:
    """Operation units per element of each chosen value's expression, its recomputed
    operands included."""
    units: dict[int, int] = {}
    for n in order:
        if n in chosen:
            units[n] = ops.units(graph.op(n).kind) + sum(
                units[o] for o in set(graph.operands(n)) if o in chosen)
    return units


def _computable(graph: Graph, n: int, memo: dict[int, bool]) -> bool:
    op = graph.op(n)
    return (isinstance(op, Op) and ops.is_elementwise(op.kind) and op.shape != ()
            and not is_clonable(graph, n, memo))


def _leaf(graph: Graph, n: int, memo: dict[int, bool]) -> bool:
    """A value a clone reads as it is: a parameter or a view of one (read through its
    strides), a dim, a constant, or a scalar or index expression."""
    op = graph.op(n)
    while isinstance(op, Op) and ops.category(op.kind) is ops.Category.LAYOUT:
        n = graph.operands(n)[0]
        op = graph.op(n)
        if not isinstance(op, Op) or op.kind != "param" and ops.category(op.kind) is not ops.Category.LAYOUT:
            return False  # (a view of a kernel's result, or of a computed value)
    return isinstance(op, Op) and (op.kind in ("param", "dim", "const") or is_clonable(graph, n, memo))


def _operands_ok(graph: Graph, n: int, chosen: set[int], memo: dict[int, bool]) -> bool:
    kind = graph.op(n).kind
    for slot, o in enumerate(graph.operands(n)):
        if ops.gathers_at(kind, slot):
            if graph.op(o).kind != "param":
                return False
        elif o not in chosen and not _leaf(graph, o, memo):
            return False
    return True


def _readers_ok(graph: Graph, n: int, chosen: set[int]) -> bool:
    """Every reader is recomputed too, or is an elementwise op that reads `n` broadcast to a
    larger shape (not gathering from it); and `n` does not reach a matmul operand."""
    shape = graph.op(n).shape
    users = graph.users(n)
    if not users or _feeds_prologue(graph, n):
        return False
    for u, slot in users:
        if u in chosen:
            continue
        op = graph.op(u)
        if isinstance(op, Op) and op.kind in ops.WRITTEN and slot > ops.WRITTEN[op.kind]:
            # an index of a scatter, read broadcast over the values it writes
            space = graph.result_type(*graph.operand_edges(u)[ops.WRITTEN[op.kind]]).shape
            if space == shape or not broadcasts_to(shape, space):
                return False
            continue
        if not isinstance(op, Op) or not ops.is_elementwise(op.kind) or ops.gathers_at(op.kind, slot):
            return False
        if op.shape == shape or not broadcasts_to(shape, op.shape):
            return False
    return True


def _feeds_prologue(graph: Graph, n: int) -> bool:
    """Could `n` end up in a matmul operand's prologue: does it reach a matmul operand
    through elementwise ops each read by one op only? (A value read twice on the way is
    stored by a kernel of its own, which can clone `n` like any kernel.)"""
    if not feeds_dot(graph, n):
        return False
    stack = [u for u, _ in graph.users(n)]
    while stack:
        u = stack.pop()
        op = graph.op(u)
        if isinstance(op, Op) and op.kind == "matmul":
            return True
        if isinstance(op, Op) and ops.is_elementwise(op.kind) and len(graph.users(u)) == 1:
            stack.extend(v for v, _ in graph.users(u))
    return False


def _move_slice(graph: Graph, node: int, ctx: PassContext) -> None:
    """Compute a slice of an elementwise value from slices of its operands (see the module)."""
    (src,) = graph.operands(node)
    if not _movable(graph, src):  # (a kernel's result is stored: its slice is a view)
        return
    if computed_view(graph, node) and shared_chain(graph, src) \
            and all(broadcast_axes(graph, u) for u, _ in graph.users(node)):
        return  # read per row by the row program its readers seed (`fuse_rows`): computed once a row
    items = _items_for(graph.op(node).attr("items"), graph.op(src).shape)
    chain: dict[int, None] = {}  # the elementwise ops computed again, in dependency order
    if items is None or not _slice_plan(graph, src, items, chain):
        return
    units = sum(ops.units(graph.op(n).kind) for n in chain)
    if recompute_refusal(units):
        refusal = Refusal(Rule.PROFIT, recompute_refusal(units))
        ctx.remarks.append(FusionRemark.refused(NAME, refusal, graph.op(src), graph.op(node)))
        return
    moved = _sliced(graph, src, items, {})
    assert graph.op(moved).type == graph.op(node).type, "a moved slice keeps its type"
    ctx.remarks.append(FusionRemark(
        NAME, True, None, graph.op(src), graph.op(node),
        f"computed again at the elements of its slice [{format_items(graph.op(node).attr('items'))}] "
        f"({_plural(units, 'operation unit')} per element, within {RECOMPUTE_BUDGET}) from slices of "
        f"its operands, instead of read through a slice of a stored {format_shape(graph.op(src).shape)}"))
    graph.replace_uses(node, moved)
    stack = [node]
    while stack:  # the slice, and what only it read
        n = stack.pop()
        if n in graph.nx and not graph.users(n) and graph.output != n \
                and graph.op(n).kind not in ("param", "dim"):
            stack.extend(graph.operands(n))
            graph.remove(n)


def _movable(graph: Graph, n: int) -> bool:
    op = graph.op(n)
    return (isinstance(op, Op) and ops.is_elementwise(op.kind) and op.shape != ()
            and "shape" not in op.attr_map  # `index`, `expand`: a shape of their own
            and not any(ops.gathers_at(op.kind, slot) for slot in range(len(graph.operands(n)))))


def _items_for(items, shape) -> tuple | None:
    """The items of a slice of a value broadcast from `shape` (right-aligned), taking the
    same elements of it (None: none restricted). An axis the value lacks or has of size 1 is
    not restricted; a new axis before all of its own is left to broadcasting."""
    rank = sum(1 for i in items if i[0] != "new")
    lead = rank - len(shape)
    out, axis, trivial = [], 0, True
    for item in items:
        if item[0] == "new":
            if axis > lead or lead == 0:
                out.append(item)
                trivial = False
            continue
        a, axis = axis - lead, axis + 1
        if a < 0:
            continue
        d = shape[a]
        if d == 1:
            out.append(("range", 0, 1, 1, 1) if item[0] == "range" else ("at", 0))
            trivial = trivial and item[0] == "range"
        else:
            out.append(item)
            trivial = trivial and item == ("range", 0, d, 1, d)
    return None if trivial else tuple(out)


def _slice_plan(graph: Graph, n: int, items, chain: dict[int, None]) -> bool:
    """Can the slice `items` of `n` (None: all of it) be computed from slices of parameters
    and values read as they are, that a clone may read? Collects in `chain` the elementwise
    ops it computes again."""
    op = graph.op(n)
    if items is None:
        return _leaf(graph, n, graph.memo("clonable"))
    if isinstance(op, Op) and op.kind in ("param", "slice"):
        return _leaf(graph, n, graph.memo("clonable"))
    if not _movable(graph, n):
        return False
    # (an operand a kernel computes is no leaf: `_slice_plan` of it is False)
    if not all(_slice_plan(graph, o, _items_for(items, graph.result_type(o, r).shape), chain)
               for o, r in graph.operand_edges(n)):
        return False
    chain[n] = None
    return True


def _sliced(graph: Graph, n: int, items, memo: dict) -> int:
    """The node computing the slice `items` of `n` (`_slice_plan` said it can be)."""
    if (n, items) not in memo:
        op, b = graph.op(n), Builder(graph)
        if op.kind in ("param", "slice"):
            memo[(n, items)] = b.op("slice", [n], op.span, items=items)
        else:
            memo[(n, items)] = b.copy(op, [o if (loc := _items_for(items, graph.op(o).shape)) is None
                                            else _sliced(graph, o, loc, memo) for o in graph.operands(n)])
    return memo[(n, items)]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
