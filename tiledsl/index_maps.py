"""Index maps: integer index expressions read as affine functions of one position, and the
positions where a value may be nonzero.

An index sema builds for a concat piece, a flip or a pad (`reindex`) is `sign * i + offset`,
`i` the result's position along one axis and `offset` a dim expression (`Lin`): rotate-half's
second piece reads `x[..., i - (D - D // 2)]`, a flip `x[..., D - 1 - i]`. Such a gather's
gradient is the gradient read back at the inverse map (`i = sign * (j - offset)`), masked
to the positions the gather covers: an index map in the kernel that reads it, never a
scatter into a zero-filled buffer (`ops.structure._d_take`).

A gather wraps a negative index (NumPy's semantics), so a position read at `v < 0` reads
`x[v + n]`; a concat's piece is read so at the positions the other pieces own, which the
concat's `where` discards. `support` finds where a gradient may be nonzero (a `where` of 0
outside a condition on positions), so the inverse map includes the wrapped preimage only
where the gradient may be nonzero there: exact whatever the index, and one read for a
concat, a flip or a pad.

Axes are counted from the right (-1 the last), so values of different ranks that broadcast
together name the same axis alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tiledsl.dims import Lin, nonnegative
from tiledsl.ir import Graph, Op


@dataclass(frozen=True, slots=True)
class Affine:
    """An index's value: `sign * i + offset`, i the position along `axis` (counted from
    the right); a constant (`axis` None, `sign` 0) is `offset` everywhere."""

    axis: int | None
    sign: int
    offset: Lin

    def __add__(self, other: Affine) -> Affine | None:
        if self.axis is not None and other.axis is not None:
            return None  # (two positions: not one axis' map)
        axis = self.axis if self.axis is not None else other.axis
        return Affine(axis, self.sign + other.sign, self.offset + other.offset)

    def __neg__(self) -> Affine:
        return Affine(self.axis, -self.sign, -self.offset)


def affine(graph: Graph, node: int) -> Affine | None:
    """`node`'s value as an `Affine` of one position, or None when it is not one (a
    loaded index, a product of positions, a division of one)."""
    op = graph.op(node)
    if not isinstance(op, Op) or not op.dtype.is_int:
        return None
    kind = op.kind
    if kind == "const":
        return Affine(None, 0, Lin((), int(op.attr("value"))))
    if kind == "dim":
        return Affine(None, 0, Lin.of(op.attr("symbol")))
    if kind == "index":
        axis, shape = op.attr("axis"), op.attr("shape")
        if shape[axis] == 1:
            return Affine(None, 0, Lin())
        return Affine(axis - len(shape), 1, Lin())
    operands = [affine(graph, o) for o in graph.operands(node)]
    if any(a is None for a in operands):
        return None
    if kind == "cast" or kind == "neg":
        (a,) = operands
        return a if kind == "cast" else -a
    if kind in ("add", "sub"):
        a, b = operands
        out = a + (b if kind == "add" else -b)
        return None if out is None or abs(out.sign) > 1 or (out.sign == 0) != (out.axis is None) else out
    if kind in ("mul", "floordiv", "mod"):
        a, b = operands
        if a.axis is None and b.axis is None:
            combine = {"mul": Lin.__mul__, "floordiv": Lin.__floordiv__, "mod": Lin.__mod__}[kind]
            try:
                return Affine(None, 0, combine(a.offset, b.offset))
            except ZeroDivisionError:
                return None
        if kind == "mul":  # a position times -1 or 1
            k = a if a.axis is None else b
            x = b if a.axis is None else a
            if k.offset.is_const and k.offset.const in (-1, 1):
                return Affine(x.axis, x.sign * k.offset.const, x.offset.scale(k.offset.const))
    return None


@dataclass(frozen=True, slots=True)
class Bounds:
    """Where a condition holds or a value may be nonzero along one axis: every position i
    with `lo <= i` for each lo and `i < hi` for each hi (bounds that may not compare)."""

    lo: tuple[Lin, ...] = ()
    hi: tuple[Lin, ...] = ()

    def __and__(self, other: Bounds) -> Bounds:
        return Bounds(self.lo + other.lo, self.hi + other.hi)

    def complement(self) -> Bounds | None:
        """Where one bound fails (None for a box of two: not a box)."""
        if len(self.lo) + len(self.hi) != 1:
            return None
        return Bounds(hi=self.lo) if self.lo else Bounds(lo=self.hi)


Box = dict[int, Bounds]  # per axis (from the right); an axis absent is unbounded


def meet(a: Box, b: Box) -> Box:
    return {axis: a.get(axis, Bounds()) & b.get(axis, Bounds()) for axis in a.keys() | b.keys()}


_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def condition(graph: Graph, node: int) -> Box | None:
    """Where a bool value holds, as a box of positions, when it is a conjunction of
    comparisons of one position's map with a constant (`i < D - D // 2`, `i - s >= 0`);
    None otherwise."""
    op = graph.op(node)
    if not isinstance(op, Op):
        return None
    if op.kind == "and":
        boxes = [condition(graph, o) for o in graph.operands(node)]
        return None if None in boxes else meet(*boxes)
    if op.kind not in _FLIPPED:
        return None
    a, b = (affine(graph, o) for o in graph.operands(node))
    if a is None or b is None or (a.axis is None) == (b.axis is None):
        return None
    kind = op.kind
    if a.axis is None:
        a, b, kind = b, a, _FLIPPED[kind]
    # sign * i + offset  <kind>  c
    c = b.offset - a.offset
    if a.sign < 0:  # -i <kind> c  is  i <flipped> -c
        kind, c = _FLIPPED[kind], -c
    one = Lin((), 1)
    bounds = {"lt": Bounds(hi=(c,)), "le": Bounds(hi=(c + one,)),
              "gt": Bounds(lo=(c + one,)), "ge": Bounds(lo=(c,))}[kind]
    return {a.axis: bounds}


def support(graph: Graph, node: int, resolve: Callable[[int], tuple[Graph, int] | None]) -> Box:
    """A box holding every position where `node` may be nonzero: a `where` selecting 0
    outside a condition on positions bounds it, a product or a sign change keeps its
    operands' bounds; anything else may be nonzero anywhere (the empty box). `resolve`
    names the graph and node a placeholder stands for (a backward's primal values)."""
    op = graph.op(node)
    if not isinstance(op, Op):
        return {}
    kind = op.kind
    operands = graph.operands(node)
    if kind in ("neg", "cast", "expand"):
        return support(graph, operands[0], resolve)
    if kind == "mul":
        return meet(*(support(graph, o, resolve) for o in operands))
    if kind == "where":
        cond, a, b = operands
        at = resolve(cond) or (graph, cond)
        box = condition(*at)
        if box is None:
            return {}
        if _zero(graph, b):
            return meet(box, support(graph, a, resolve))
        if _zero(graph, a) and len(box) == 1:
            ((axis, bounds),) = box.items()
            flipped = bounds.complement()
            return {} if flipped is None else meet({axis: flipped}, support(graph, b, resolve))
    return {}


def _zero(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind == "const" and op.attr("value") == 0


def gather_adjoint(d) -> int | None:
    """The gradient of `take(x, e_0, ..., e_{r-1})` (the op of the `Adjoint` d) as an index map,
    when each result position reads its own element of x: each index is an `Affine` of its
    own axis of the result, a constant, or a loaded index (a label) along axes of the result
    the affine ones map. x's element j gets g at the one position i that may read it (along
    an affine axis `i = sign * (j - offset)`, and the wrapped position for `j - n` where g may
    be nonzero there), where the loaded indices at i equal j (a one-hot term: the gradient of
    `gather(x, label)` computed in the row program that reads x), 0 where none does. None
    when the indices are not such a map (two along one axis; x read alike along an axis of
    the result, whose gradient is a sum; a loaded index along an axis no affine one maps):
    the caller scatters then. An index selecting between two maps (rotate-half's halves
    read by one gather) gives each map the gradient where its side is selected."""
    forward = d.forward
    rank = d.x_type(0).rank
    maps = [affine(forward, d.operand(k)) for k in range(1, rank + 1)]
    for k in range(rank):  # an index selected between two maps (`SelectOfGathers`): each its share
        op = forward.op(d.operand(k + 1))
        if maps[k] is None and op.kind == "where":
            cond, a, b = forward.operands(d.operand(k + 1))
            branches = [affine(forward, a), affine(forward, b)]
            if None in branches:
                continue
            c = d.primal(cond)
            shares = [d.where(c, d.g, d.c(0.0)), d.where(c, d.c(0.0), d.g)]
            at, on_first = _shared_position(d, k, branches, condition(forward, cond)) or (None, None)
            parts = [_inverse_read(d, maps[:k] + [m] + maps[k + 1:], g, at) for m, g in zip(branches, shares,
                                                                                             strict=True)]
            if None in parts:
                return None
            # sides reading disjoint ranges: j takes the side whose range it is in (at the shared
            # position the other side's share may be nonzero: it is not j's)
            return d.add(*parts) if at is None else d.where(on_first, *parts)
    return _inverse_read(d, maps, d.g)


def _shared_position(d, k: int, branches: list[Affine], box: Box | None) -> tuple[dict, int] | None:
    """Where the two sides of a selected index read disjoint ranges of x's axis k (rotate-
    half: the first side, `i < h` read at `i + D // 2`, covers [D // 2, D); the second, the
    rest read at `i - h`, covers [0, D // 2)), x's element j gets g from one side only, at the
    position of that side's inverse map: both sides read g at that one position (one load).
    ({k: (result axis, position)}, whether j is in the first side's range), or None."""
    a, b = branches
    if box is None or len(box) != 1 or a.axis is None or a.axis != b.axis or a.sign != 1 or b.sign != 1:
        return None
    ((axis, bounds),) = box.items()
    if axis != a.axis or len(bounds.lo) + len(bounds.hi) != 1:
        return None
    size = Lin.of(d.op.shape[a.axis])
    # the first side where the condition holds, the second where it does not: ranges of i
    h = bounds.hi[0] if bounds.hi else bounds.lo[0]
    first, second = ((Lin(), h), (h, size)) if bounds.hi else ((h, size), (Lin(), h))
    image_a = (first[0] + a.offset, first[1] + a.offset)
    image_b = (second[0] + b.offset, second[1] + b.offset)
    j = d.call("index", axis=k, shape=tuple(n if q == k else 1 for q, n in enumerate(d.x_type(0).shape)))
    if nonnegative(image_a[0] - image_b[1]):  # the first side's range above the second's
        on_a = d.call("ge", j, d.size(image_a[0].dim()))
    elif nonnegative(image_b[0] - image_a[1]):
        on_a = d.call("lt", j, d.size(image_a[1].dim()))
    else:
        return None

    def inverse(m: Affine) -> int:
        return d.sub(j, d.size(m.offset.dim())) if m.offset != Lin() else j

    return {k: (a.axis, d.where(on_a, inverse(a), inverse(b)))}, on_a


def _inverse_read(d, maps: list, g: int, shared: dict | None = None) -> int | None:
    """`gather_adjoint` with the indices' maps `maps` (None: a loaded index) and gradient g."""
    from itertools import product

    x_shape = d.x_type(0).shape
    out = d.op.shape
    used = [m.axis for m in maps if m is not None and m.axis is not None]
    if len(set(used)) != len(used):
        return None
    box = support(d.backward, g, d.primal_of)
    one = Lin((), 1)
    # a result axis no index reads along: x's gradient sums g over it, unless g may be nonzero
    # at one position of it only (a concat's one-row piece, `x[N - 1:]`): g read there
    fixed_at: dict[int, Lin] = {}
    for a in range(-len(out), 0):
        if a in used or out[a] == 1:
            continue
        bounds = box.get(a, Bounds())
        at = [lo for lo in bounds.lo + (Lin(),) for hi in bounds.hi + (Lin.of(out[a]),) if hi - lo == one]
        if not at:
            return None
        fixed_at[a] = at[0]

    def index(k: int) -> int:
        return d.call("index", axis=k, shape=tuple(n if q == k else 1 for q, n in enumerate(x_shape)))

    choices = []  # per affine axis of x: [(result axis, position of g read, [conditions])]
    fixed = []  # conditions on x's other axes
    for k, m in enumerate(maps):
        n = Lin.of(x_shape[k])
        if shared and k in shared:  # the position both sides of a selected index read
            axis, i = shared[k]
            size = d.size(out[axis])
            choices.append([(axis, i, [d.call("ge", i, d.c(0)), d.call("lt", i, size)])])
            continue
        if m is None:
            continue  # a loaded index: compared with j at the position read
        if m.axis is None:  # x's axis k is read at one position only
            c = m.offset
            at = c if nonnegative(c) else c + n if nonnegative(-c - one) else None
            if at is None:
                return None
            if x_shape[k] != 1 or at != Lin():
                fixed.append(d.call("eq", index(k), d.size(at.dim())))
            continue
        s, c, size = m.sign, m.offset, Lin.of(out[m.axis])
        bounds = box.get(m.axis, Bounds())
        reads = []
        for shift in (Lin(), n):  # x[j] is read at v = j and, wrapped, at v = j - n
            if shift != Lin() and (
                    s > 0 and any(nonnegative(lo + c) for lo in bounds.lo + (Lin(),))
                    or s < 0 and any(nonnegative(c - hi + one) for hi in bounds.hi + (size,))):
                continue  # no position where g may be nonzero reads a negative index
            base = shift + c  # i = s * (j - base)
            j = index(k)
            i = d.sub(j, d.size(base.dim())) if base != Lin() else j
            i = i if s > 0 else d.neg(i)
            low = -base if s > 0 else base - n + one  # the least i over j in [0, n)
            high = n - one - base if s > 0 else base  # the greatest
            conds = []
            if not nonnegative(low):
                conds.append(d.call("ge", i, d.c(0)))
            if not nonnegative(size - one - high):
                conds.append(d.call("lt", i, d.size(size.dim())))
            reads.append((m.axis, i, conds))
        choices.append(reads)
    if not all(choices) or math.prod(map(len, choices)) > 4:
        return None
    total = None
    for choice in product(*choices):
        at = {axis: i for axis, i, _ in choice}
        at.update({a: d.size(p.dim()) for a, p in fixed_at.items()})

        def read(v: int, at: dict = at) -> int:
            """Backward value v (broadcast to the result) at the position that reads j."""
            shape = d.shape(v)
            return d.reread(v, [None if shape[a] == 1 else at[a] for a in range(-len(shape), 0)])

        conds = fixed + [c for _, _, cs in choice for c in cs]
        for k, m in enumerate(maps):
            if m is None:  # j along axis k is the label (negative: from the end)
                label = read(d.x(k + 1))
                n = d.size(x_shape[k])
                label = d.where(d.call("lt", label, d.c(0)), d.add(label, n), label)
                conds.append(d.call("eq", index(k), label))
        term = read(g)
        if conds:
            term = d.where(d.all(conds), term, d.c(0.0))
        total = term if total is None else d.add(total, term)
    if d.shape(total) != tuple(x_shape):
        total = d.call("expand", total, shape=tuple(x_shape))
    return total
