"""Fusion legality: may these ops share one kernel without changing the program?

A fusion is illegal when
- it would create a cycle between kernels (`GroupPlan.creates_cycle`);
- a consumer reads a producer at another index: through a transpose, or a
  producer broadcast into a larger consumer (`reads_other_index`), or, in a
  row program, a value whose dims do not map onto the row space the way its
  consumer reads them (`row_layouts`);
- the kernel's tile cannot hold the op (its result does not live in the
  group's iteration space).

Passes plan groups on the unmodified graph (`GroupPlan`), so one topological
numbering stays valid for every check, and rewrite the groups into kernels
at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op, Region, walk
from tiledsl.plans import SELECT_LIMIT, may_be_long, sorts_whole_row
from tiledsl.types import Shape, format_shape

from .remarks import Refusal, Rule

Layout = tuple  # per dim of a value: the index of the row-space dim it is read along, or None


class GroupPlan:
    """Groups being formed by one pass, over a graph that is not modified meanwhile."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = {n: i for i, n in enumerate(graph.topo_order())}
        self.group_of: dict[int, int] = {}
        self.groups: list[list[int]] = []
        # each group's kernel spec (`fusion.spec`); None where the pass merges kernels itself
        self.specs: list = []
        self.first: list[int] = []  # each planned group's earliest position
        self.last: list[int] = []  # ... and its latest

    def grouped(self, node: int) -> bool:
        return node in self.group_of

    def add_group(self, members: Iterable[int], spec=None) -> None:
        ordered = sorted(set(members), key=self.order.__getitem__)
        gid = len(self.groups)
        self.groups.append(ordered)
        self.specs.append(spec)
        self.first.append(self.order[ordered[0]])
        self.last.append(self.order[ordered[-1]])
        for n in ordered:
            self.group_of[n] = gid

    def creates_cycle(self, group: set[int], candidate: int) -> bool:
        """Would `group` plus `candidate` depend on itself through nodes outside it?

        Other planned groups count as single nodes (they will be contracted).
        Only nodes ordered before the group's last member can lead back into it, or
        before the last member of a planned group that starts before that (`reach_back`).
        """
        return self.cycle_through(group, candidate) is not None

    def cycle_refusal(self, group: set[int], candidate: int) -> Refusal | None:
        """A "cycle" refusal naming the node outside the group that the cycle runs through,
        and why that node could not join (a read at another index), or None."""
        between = self.cycle_through(group, candidate)
        if between is None:
            return None
        graph = self.graph
        op = graph.op(between)
        why = None
        if isinstance(op, Op) and ops.is_elementwise(op.kind):
            why = reads_other_index(graph, between, set(group) | {candidate})
        elif isinstance(op, Op) and op.kind != "return":
            why = f"a {ops.category(op.kind).name.lower()} op, which this kernel does not compute"
        return Refusal(Rule.CYCLE, f"{describe_node(graph, between)} lies between them outside the "
                       "group" + (f": {why}" if why else ""))

    def cycle_through(self, group: set[int], candidate: int) -> int | None:
        """The node outside `group` through which `group` plus `candidate` would depend on
        itself (the last one before the path re-enters), or None (see `creates_cycle`)."""
        if isinstance(group, Group):
            limit, starts = group.limit, set(group.frontier)
        else:
            limit = max(self.order[n] for n in group)
            starts = {s for m in group for s in self.graph.nx.successors(m)}
        members = group | {candidate}
        limit = self.reach_back(max(limit, self.order[candidate]))
        starts.update(self.graph.nx.successors(candidate))
        succ = self.graph.nx.successors
        stack = [s for s in starts if s not in members]
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            gid = self.group_of.get(n)
            # a planned group is contracted to its earliest member: entered at a late one, it
            # can still lead back through an early one
            at = self.first[gid] if gid is not None else self.order.get(n, limit + 1)
            if n in seen or at > limit:
                continue
            seen.add(n)
            nexts = list(succ(n))
            if gid is not None:  # a planned group: leaving it from any member
                for m in self.groups[gid]:
                    seen.add(m)
                    nexts.extend(succ(m))
            for s in nexts:
                if s in members:
                    return n
                stack.append(s)
        return None


    def reach_back(self, limit: int) -> int:
        """The latest position from which a path can still return to one at or before
        `limit`: a planned group is contracted to its earliest member, so a path that enters
        one at a later member than `limit` leaves it from its first (a row program of a
        statistic whose later ops read a sum of another group's output: found by the
        gradient fuzzer, seed 2801 program 237)."""
        spans = sorted(zip(self.first, self.last, strict=True))
        for first, last in spans:
            if first > limit:
                break
            limit = max(limit, last)
        return limit


class Group(set):
    """A group being grown, with what the cycle check needs kept up to date:
    its latest member's position and the nodes just outside it."""

    def __init__(self, plan: GroupPlan, seed: int) -> None:
        super().__init__([seed])
        self.plan = plan
        self.seed = seed
        self.limit = plan.order[seed]
        self.frontier = set(plan.graph.nx.successors(seed))

    def add(self, node: int) -> None:
        super().add(node)
        self.limit = max(self.limit, self.plan.order[node])
        self.frontier.update(self.plan.graph.nx.successors(node))
        self.frontier -= self


def view_source(graph: Graph, node: int) -> int | None:
    """The node a view (`transpose`, `slice`, `reshape`) reads, or None for anything else."""
    op = graph.op(node)
    if isinstance(op, Op) and ops.category(op.kind) is ops.Category.LAYOUT:
        return graph.operands(node)[0]
    return None


def is_elementwise(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and ops.is_elementwise(op.kind)


def gathers_within(graph: Graph, consumer: int, group: set[int]) -> str | None:
    """Why `consumer` and `group` cannot be one kernel because one gathers from the other
    (a gathered operand is read through its pointer: it must be stored), or None."""
    for slot, src in enumerate(graph.operands(consumer)):
        if src in group and ops.gathers_at(graph.op(consumer).kind, slot):
            return f"it gathers from {describe_node(graph, src)} at computed indices"
    for user, slot in graph.users(consumer):
        if user in group and ops.gathers_at(graph.op(user).kind, slot):
            return f"{describe_node(graph, user)} gathers from it at computed indices"
    return None


def reads_other_index(graph: Graph, consumer: int, group: set[int]) -> str | None:
    """Why `consumer` cannot read group values element for element (None if it can)."""
    out = graph.op(consumer).shape
    if (gather := gathers_within(graph, consumer, group)) is not None:
        return gather
    for src in graph.operands(consumer):
        source = view_source(graph, src)
        if source is not None and (source in group or view_source(graph, source) in group):
            return f"it reads {describe_node(graph, source)} {_through(graph, src)}"
        if src in group:
            shape = graph.result_type(src).shape
            if shape and shape != out:
                return (f"it broadcasts {describe_node(graph, src)} from {format_shape(shape)} "
                        f"to {format_shape(out)}")
    for user, _ in graph.users(consumer):
        if view_source(graph, user) == consumer:  # the group reads it through a view
            for reader, _ in graph.users(user):
                if reader in group:
                    return f"{describe_node(graph, reader)} reads it {_through(graph, user)}"
    return None


def _through(graph: Graph, view: int) -> str:
    return {"transpose": "transposed", "slice": "through a slice"}.get(graph.op(view).kind,
                                                                      "through a reshape")


def describe_node(graph: Graph, node: int) -> str:
    op = graph.op(node)
    if isinstance(op, KernelOp):
        return f"kernel @{op.name}"
    return op.kind + (f" (line {op.span.line})" if op.span is not None else "")


# --- row programs -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowSpace:
    """The iteration space of a row program: a shape and the axes its reductions run along
    (one, or several: a reduction over several axes, which sema writes as one reduction
    per axis, `continues_reduction`)."""

    shape: Shape
    axes: tuple[int, ...]

    @property
    def runs(self) -> frozenset[int]:
        """The axes a row really runs along (not of literal size 1)."""
        return frozenset(a for a in self.axes if self.shape[a] != 1)

    def default_layout(self, shape: Shape) -> Layout | None:
        """Right-aligned broadcasting onto the space; failing that, one value per row (the
        shape of the rows without the reduced axes, as a reduction's result), or the space
        without one of its dims, the only one whose dropping gives the shape (a reduction
        across the rows' result: Mamba's [B, L, D] skip term beside its sum over the state
        dim N of [B, L, D, N]); None when it does not fit."""
        right = self._right_aligned(shape)
        kept = tuple(d for d in range(len(self.shape)) if d not in self.axes)
        if right is None and shape and shape == tuple(self.shape[d] for d in kept):
            return tuple(None if shape[k] == 1 else d for k, d in enumerate(kept))
        if right is None and len(shape) == len(self.shape) - 1:
            rank = len(self.shape)
            dropped = [tuple(d for d in range(rank) if d != gone) for gone in range(rank)]
            fits = {dims for dims in dropped if shape == tuple(self.shape[d] for d in dims)}
            if len(fits) == 1:
                (dims,) = fits
                return tuple(None if shape[k] == 1 else d for k, d in enumerate(dims))
        return right or self._by_size(shape)

    def _by_size(self, shape: Shape) -> Layout | None:
        """Each dim of `shape` along the one dim of the space of its size, where each size is
        the space's once and no two dims of `shape` take one: [H, T] in a [T, H, D] space
        (vLLM's lse per head and token) runs along (1, 0), [B, H, S, D] in [B, S, H, D] along
        (0, 2, 1, 3). None where a size is missing or repeated."""
        out = []
        for d in shape:
            if d == 1:
                out.append(None)
                continue
            dims = [j for j, e in enumerate(self.shape) if e == d]
            if len(dims) != 1 or dims[0] in out:
                return None
            out.append(dims[0])
        return tuple(out)

    def _right_aligned(self, shape: Shape) -> Layout | None:
        lead = len(self.shape) - len(shape)
        if lead < 0:
            return None
        out = []
        for i, d in enumerate(shape):
            if d == 1:
                out.append(None)
            elif self.shape[lead + i] == d:
                out.append(lead + i)
            else:
                return None
        return tuple(out)


def continues_reduction(op: Op, user: Op) -> bool:
    """Does `user` reduce what the reduction `op` left, the two being one reduction over
    several axes? sema writes `sum(x, axis=(0, 2))` (and `axis=None`) as one reduction per
    axis, and a nested `mean(mean(x, -1), -1)` is the same: of one kind and dtype, whose
    partials combine (a mean of equal-sized means is the mean), so not argmax's positions."""
    red = ops.OPS[op.kind].reduction if op.kind in ops.OPS else None
    return (isinstance(user, Op) and user.kind == op.kind and red is not None and not red.index
            and user.dtype is op.dtype)


def reduced_axes(rank: int, chain: list[Op]) -> tuple[int, ...]:
    """The axes of the first reduction's operand (of rank `rank`) that a chain of reductions,
    each reading the one before, reduces."""
    positions, axes = list(range(rank)), set()
    for op in chain:
        axis = op.attr("axis")
        axes.add(positions[axis])
        if not op.attr("keepdims"):
            del positions[axis]
    return tuple(sorted(axes))


ROW_OPS = ops.ROW_KINDS
# row ops that need a pass over the row of their own (a scan is computed in whichever pass
# reads it)
PASS_OPS = tuple(k for k in ROW_OPS if ops.category(k) is not ops.Category.SCAN)


def row_layouts(region: Region, space: RowSpace) -> dict[int, Layout] | Refusal:
    """How every value of a region maps onto the row space, or why it cannot.

    Returns value id -> layout (inputs and ops), or a refusal naming the op
    that reads a value at another index ("other-index") or does not fit the
    space ("tile"). In a space of several axes, a reduction reduces them all through the
    reductions reading it (`continues_reduction`); what it leaves (`partial_reductions`)
    only they may read.
    """
    n_in = len(region.inputs)
    layouts: dict[int, Layout] = {}
    partial = set()  # reductions that leave some of the row's axes to the ones reading them
    if refusal := scan_directions(region):
        return refusal

    sorted_values, positions = selections(region)
    chosen = sorted_values | positions
    across = None  # the kept dim the region's reductions across rows reduce

    def fit(v: int, layout: Layout) -> Refusal | None:
        if v in layouts and layouts[v] != layout:
            return Refusal(Rule.OTHER_INDEX, "one value is read along two different dims")
        layouts[v] = layout
        return None

    for i, rop in enumerate(region.ops):
        op, vid = rop.op, n_in + i
        if op.kind == "const":
            layouts[vid] = ()
            continue
        if any(v >= n_in and region.ops[v - n_in].op.kind == "put" for v in rop.operands):
            return Refusal(Rule.OP, f"{op.kind} reads a put, which the row program completes only when "
                           "it ends")
        if op.kind in ROW_OPS:
            x = rop.operands[0]  # (linear_scan's b has a's shape, so its layout)
            xt = region.value_type(x)
            lx = layouts.get(x) or space.default_layout(xt.shape)
            axis = op.attr("axis")
            continued = x >= n_in and continues_reduction(region.ops[x - n_in].op, op)
            along = lx is not None and (lx[axis] in space.axes or (
                xt.shape[axis] == 1 and (not space.runs or continued)))
            if not along:
                if refusal := _across_refusal(region, space, rop, lx, across, chosen | partial):
                    return refusal
                across = lx[axis]
                if x not in layouts and (err := fit(x, lx)):
                    return err
                layouts[vid] = lx[:axis] + ((None,) if op.attr("keepdims") else ()) + lx[axis + 1:]
                continue
            if x not in partial and lx[axis] is not None and not space.runs <= set(lx):
                return Refusal(Rule.TILE, f"{op.kind} runs along some of the row program's axes only")
            if x in partial and not continued:
                return Refusal(Rule.TILE, f"{op.kind} reads a {region.ops[x - n_in].op.kind} over some of "
                               "the row program's axes only")
            if ops.category(op.kind) is not ops.Category.REDUCTION and len(space.runs) > 1:
                return Refusal(Rule.TILE, f"{op.kind} runs along one of the row program's axes only")
            if x in chosen and ops.category(op.kind) is ops.Category.SCAN and op.attr("reverse"):
                return Refusal(Rule.TILE, f"{op.kind} runs backward along the elements a topk or sort "
                               "selected (a row program of its own)")
            if x in sorted_values and ops.category(op.kind) is not ops.Category.SCAN \
                    and (refusal := _reduces_long_selection(region, rop, sorted_values)):
                return refusal
            if x not in layouts and (err := fit(x, lx)):
                return err
            for other in rop.operands[1:]:
                if err := fit(other, lx):
                    return err
            if ops.category(op.kind) is not ops.Category.REDUCTION:  # softmax, cumsum
                layouts[vid] = lx
            elif op.attr("keepdims"):
                layouts[vid] = lx[:axis] + (None,) + lx[axis + 1:]
            else:
                layouts[vid] = lx[:axis] + lx[axis + 1:]
            if ops.category(op.kind) is ops.Category.REDUCTION and space.runs & set(layouts[vid]):
                partial.add(vid)  # the reductions reading it reduce the rest of the row
            continue
        if op.kind == "put" and vid in chosen:
            if refusal := _row_put(region, rop, vid, layouts, fit):
                return refusal
            continue
        if ops.category(op.kind) is ops.Category.LAYOUT:
            (src,) = rop.operands
            dims = view_dims(op, region.value_type(src).shape)
            if dims is None:
                return Refusal(Rule.OTHER_INDEX, f"a row program reads through a {op.kind} only a "
                               "transpose or size-1 dims")
            if src in chosen or src in partial:
                return Refusal(Rule.TILE, f"{op.kind} views a value along some of the row program's axes")
            if src >= n_in:  # the view of a value it computes: its source's dims
                layout = tuple(None if k is None else layouts[src][k] for k in dims)
            elif (layout := space.default_layout(op.shape)) is None:
                return Refusal(Rule.TILE, f"{op.kind} of shape {format_shape(op.shape)} does not fit the "
                               "row space")
            elif err := fit(src, _source_layout(dims, layout, region.value_type(src).rank)):
                return err  # (an input read through the view: at the dims its reader wants)
            if err := fit(vid, layout):
                return err
            continue
        if not ops.is_elementwise(op.kind):
            return Refusal(Rule.TILE, f"{op.kind} is not part of a row program")
        shape = op.shape
        result: list[int | None] = [None] * len(shape)
        read = [v for slot, v in enumerate(rop.operands) if not ops.gathers_at(op.kind, slot)]
        if any(v in partial for v in read):
            return Refusal(Rule.TILE, f"{op.kind} reads a reduction over some of the row program's axes only")
        for v in read:
            if v not in layouts:
                continue
            lead = len(shape) - len(layouts[v])
            for k, dim in enumerate(layouts[v]):
                if dim is None:
                    continue
                if result[lead + k] not in (None, dim):
                    return Refusal(Rule.OTHER_INDEX, f"{op.kind} combines values read along different dims")
                result[lead + k] = dim
        default = space.default_layout(shape)
        if default is None and vid in chosen:  # along a selection's k, not the row's length
            lead = len(space.shape) - len(shape)
            default = space.default_layout(tuple(space.shape[lead + j] if lead + j in space.runs and d != 1
                                                 else d for j, d in enumerate(shape)))
        for j, d in enumerate(shape):
            if result[j] is None and d != 1:
                if default is None or default[j] is None:
                    return Refusal(Rule.TILE, f"{op.kind} of shape {format_shape(shape)} does not fit "
                                   "the row space")
                result[j] = default[j]
        if vid in chosen:  # along the row: the k selected, not the row's positions
            for v in read:
                t = region.value_type(v)
                along = {result[len(shape) - t.rank + k] for k in range(t.rank) if t.shape[k] != 1}
                if v not in chosen and space.runs & along:
                    return Refusal(Rule.OTHER_INDEX, f"{op.kind} combines the elements a topk or sort "
                                   "selected with values along the row")
            if len({region.value_type(v).shape for v in read if v in sorted_values}) > 1:
                return Refusal(Rule.OTHER_INDEX, f"{op.kind} combines two selections")
        for j, dim in enumerate(result):
            if dim is not None and space.shape[dim] != shape[j] and not (vid in chosen and dim in space.runs):
                return Refusal(Rule.OTHER_INDEX, f"{op.kind} reads a value at another index")
        if len({d for d in result if d is not None}) < sum(d is not None for d in result):
            return Refusal(Rule.TILE, f"{op.kind} reads one row-space dim twice")
        layouts[vid] = tuple(result)
        for v in read:  # external inputs take the layout their consumer reads them with
            if v < n_in:
                t = region.value_type(v)
                lead = len(shape) - t.rank
                want = tuple(None if t.shape[k] == 1 else result[lead + k] for k in range(t.rank))
                if err := fit(v, want):
                    return err
    if across is not None and not short_across(space, across):
        tail = split_tail(region, layouts, across_reductions(region, space, layouts)[1])
        if isinstance(tail, Refusal):
            return tail
        if long := _long_selection(region):  # its rows sorted in a workspace of one program's own
            return Refusal(Rule.TILE, f"{long} may keep more than a tile of each row (sorted in memory): "
                           "its row program does not also split a reduction across its rows")
    return layouts


# the most rows a program owns to reduce across them (`across_reductions`): one tile of 4k
# elements on a GPU holds 256 rows of 16 elements
ACROSS_LIMIT = 256


def short_across(space: RowSpace, dim: int) -> bool:
    """Does a program own every row along the kept dim `dim` (a literal size of at most
    `ACROSS_LIMIT`: Mamba's state dim 16, the experts a token was routed to), reducing
    across them in registers? Along any other dim (a batch of thousands, tokens, a size
    only the call decides) the reductions are split: each program sums a chunk of the rows
    into a partial and a combine launch merges the partials (`split_tail`)."""
    return isinstance(space.shape[dim], int) and space.shape[dim] <= ACROSS_LIMIT


def _across_refusal(region: Region, space: RowSpace, rop, lx: Layout | None, across: int | None,
                    apart: set[int]) -> Refusal | None:
    """Why the reduction `rop`, along a dim that is not the row program's, cannot reduce
    across the program's rows (None: it can): a plain reduction (not online, not a
    position) can, along one kept dim (`short_across` says how)."""
    op = rop.op
    red = ops.OPS[op.kind].reduction
    dim = None if lx is None else lx[op.attr("axis")]
    if red is None or red.online or red.index or ops.category(op.kind) is not ops.Category.REDUCTION \
            or dim is None or rop.operands[0] in apart:
        why = " (across its rows: only a reduction whose partials merge, not a position, a " \
            "softmax or a logsumexp)" if dim is not None and ops.category(op.kind) is not ops.Category.SCAN \
            else ""
        return Refusal(Rule.TILE, f"{op.kind} runs along another axis than the row program{why}")
    if across is not None and dim != across:
        return Refusal(Rule.TILE, f"{op.kind} reduces across the row program's rows along a second dim")
    return None


def split_tail(region: Region, layouts: dict[int, Layout], across_reducing: frozenset[int]) \
        -> frozenset[int] | Refusal:
    """The values a split row program's combine launch computes: the reductions across its
    rows (merged from the partials) and the elementwise ops computed from them (a loss's
    final division, a mean's scale), or why the region cannot split. The combine computes
    one element per position along the row (or one, where nothing varies along it), so an
    op there reads only such values, constants, scalars and inputs it reads at its own
    positions (Mamba's skip term `u * Dp` added to its sum over the state dim), and
    elementwise ops of those; nothing of the row program reads what the combine computes
    (it runs after it)."""
    n_in = len(region.inputs)
    tail = set(across_reducing)
    # the dim the reductions run across, which the combine merges
    apart = set().union(*(_dims(layouts.get(region.ops[r - n_in].operands[0])) - _dims(layouts.get(r))
                          for r in tail))
    for i, rop in enumerate(region.ops):
        v = n_in + i
        if v in tail or not any(o in tail for o in rop.operands):
            continue
        if not ops.is_elementwise(rop.op.kind) or rop.op.kind == "index":
            return Refusal(Rule.TILE, f"{rop.op.kind} reads a reduction across the rows that a combine "
                           "launch merges from partials (only elementwise ops follow one there)")
        for o in rop.operands:
            if o not in tail and not _recomputed(region, layouts, o, apart):
                return Refusal(Rule.TILE, f"{rop.op.kind} combines a reduction across the rows with a "
                               "value of the rows (a combine launch merges that reduction after them)")
        if not _dims(layouts.get(v)) <= set().union(*(_dims(layouts.get(o)) for o in rop.operands)):
            return Refusal(Rule.TILE, f"{rop.op.kind} broadcasts a reduction across the rows along the "
                           "program's dims (a combine launch computes one value per position along the row)")
        tail.add(v)
    return frozenset(tail)


def view_dims(op: Op, source: Shape) -> tuple[int | None, ...] | None:
    """For each dim of a view, the dim of its source it reads (None: a size-1 dim it
    inserts), where the view is a transpose or only inserts or drops size-1 dims (a
    `[:, :, None]`, `x[0]` of a size-1 dim, a reshape to the same dims but size-1 ones);
    None for any other view (a slice of part of a dim, a reshape merging or splitting)."""
    if op.kind == "transpose":
        a, b = (d % len(source) for d in op.attr("dims"))
        out = list(range(len(source)))
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    if op.kind == "reshape":
        if [d for d in source if d != 1] != [d for d in op.shape if d != 1]:
            return None
        places = iter(k for k, d in enumerate(source) if d != 1)
        return tuple(None if d == 1 else next(places) for d in op.shape)
    if op.kind != "slice":
        return None
    out, axis = [], 0
    for item in op.attr("items"):
        if item[0] == "new":
            out.append(None)
            continue
        if item[0] == "at" and not (source[axis] == 1 and item[1] == 0):
            return None
        if item[0] == "range":
            if item[1] != 0 or item[3] != 1 or item[4] != source[axis]:
                return None
            out.append(axis)
        axis += 1
    return tuple(out)


def _source_layout(dims: tuple[int | None, ...], layout: Layout, rank: int) -> Layout:
    """The layout of a view's source of `rank`, for the view's `layout` (`view_dims`)."""
    source: list[int | None] = [None] * rank
    for j, k in enumerate(dims):
        if k is not None:
            source[k] = layout[j]
    return tuple(source)


def _dims(layout: Layout | None) -> set[int]:
    """The space dims a value's layout runs along."""
    return {d for d in layout or () if d is not None}


def _long_selection(region: Region) -> str | None:
    """The kind of a topk or sort whose k may pass `SELECT_LIMIT` (not a literal up to it)."""
    for r in region.ops:
        if r.op.kind in ops.OPS and ops.category(r.op.kind) is ops.Category.SELECT and may_be_long(r.op):
            return r.op.kind
    return None


def _reduces_long_selection(region: Region, rop, sorted_values: frozenset[int]) -> Refusal | None:
    """A reduction of the elements a selection holds reads them in registers, which a
    selection whose k may pass `SELECT_LIMIT` sorts in memory: it is a row program of its
    own, reading them stored (a scan streams them; a softmax of a whole row's sort scales
    them by the row's statistics, `plans.sorts_whole_row`)."""
    n_in = len(region.inputs)

    def selected_operands(v: int) -> list[int]:  # (a selection's own operand is the row)
        sel = region.ops[v - n_in].op
        return [] if ops.category(sel.kind) is ops.Category.SELECT \
            else [o for o in region.ops[v - n_in].operands if o in sorted_values]

    for v in walk([rop.operands[0]], selected_operands):
        sel = region.ops[v - n_in].op
        if ops.category(sel.kind) is not ops.Category.SELECT or not may_be_long(sel) \
                or rop.op.kind == "softmax" and rop.operands[0] == v and sorts_whole_row(region, v):
            continue
        return Refusal(Rule.TILE, f"{rop.op.kind} reduces the elements a {sel.kind} selected, which a "
                       f"row longer than {SELECT_LIMIT} sorts in memory (a row program of its own "
                       "reads them)")
    return None


def _recomputed(region: Region, layouts: dict[int, Layout], v: int, across: set[int]) -> bool:
    """Can a combine launch compute `v` again at its positions: a constant, a scalar, an
    input that does not vary along the dims `across` (read where the combine stores), and
    elementwise ops of those?"""
    n_in = len(region.inputs)
    if v < n_in:
        return region.inputs[v].scalar or region.inputs[v].type.rank == 0 or (
            v in layouts and not region.gathered(v) and not _dims(layouts[v]) & across)
    rop = region.ops[v - n_in]
    if rop.op.kind == "const":
        return True
    return ops.is_elementwise(rop.op.kind) and rop.op.kind != "index" \
        and not _dims(layouts.get(v)) & across \
        and all(_recomputed(region, layouts, o, across) for o in rop.operands)


def across_reductions(region: Region, space: RowSpace,
                      layouts: dict[int, Layout]) -> tuple[int | None, frozenset[int]]:
    """The kept dim a row program reduces across its rows along (None: none) and the
    reductions that do (`row_layouts` admits them along one short dim): each reduces a
    tile's rows, a chunk of the row at a time, in the program that owns all of them."""
    n_in = len(region.inputs)
    dims, out = set(), set()
    for i, r in enumerate(region.ops):
        if r.op.kind in ROW_OPS and ops.category(r.op.kind) is ops.Category.REDUCTION \
                and (layout := layouts.get(r.operands[0])) is not None:
            dim = layout[r.op.attr("axis")]
            if dim is not None and dim not in space.axes:
                dims.add(dim)
                out.add(n_in + i)
    assert len(dims) <= 1, "row_layouts admits reductions across rows along one dim"
    return next(iter(dims), None), frozenset(out)


def _row_put(region: Region, rop, vid: int, layouts: dict[int, Layout], fit) -> Refusal | None:
    """A put in a row program: its values selected from the row by a sort, written at the
    sort's positions (each of the row's elements once: `indexing.permuted_axis`), so the row
    program stores the selected tile there. Its layout is its values'; the other indices are
    their own dims' positions."""
    n_in = len(region.inputs)
    src, *indices = rop.operands
    shape = rop.op.shape
    if rop.op.attr("accumulate") or src not in layouts or region.value_type(src).shape != shape:
        return Refusal(Rule.OP, "a row program puts only the elements a sort selected, at its positions")
    for k, v in enumerate(indices):
        i_op = region.ops[v - n_in].op if v >= n_in else None
        if i_op is None:
            return Refusal(Rule.OP, "a row program puts only at the positions of a sort it computes")
        if i_op.kind == "argtopk":
            if i_op.type.shape != shape or i_op.attr("axis") != k or i_op.attr("k") != shape[k] \
                    or layouts.get(v) != layouts[src]:
                return Refusal(Rule.OP, "a row program puts only at the positions of a sort of the row")
        elif not (i_op.kind == "index" and i_op.attr("axis") == k and i_op.shape[k] == shape[k]):
            return Refusal(Rule.OP, "a row program puts only along the row it sorts")
        elif err := fit(v, tuple(layouts[src][d] if d == k else None for d in range(len(shape)))):
            return err
    if sum(region.ops[v - n_in].op.kind == "argtopk" for v in indices) != 1:
        return Refusal(Rule.OP, "a row program puts only at the positions of a sort of the row")
    layouts[vid] = layouts[src]
    return None


def selected(region: Region) -> frozenset[int]:
    """The values along the elements a topk or sort selected (`selections`), with the
    values of positions only they read."""
    chosen, positions = selections(region)
    return chosen | positions


def selections(region: Region) -> tuple[frozenset[int], frozenset[int]]:
    """The values along the elements a topk or sort selected, not along the row: the
    selections, the elementwise ops, softmax and scans reading them (a reduction of one is
    per row), a put of them at the sort's positions (stored along the row from the selected
    tile, `row_put`); and apart, the values computed from positions alone that only these
    read (the j-th selected element's position along the row is j: `index(x, -1) < 1`, the
    first)."""
    n_in = len(region.inputs)
    out: set[int] = set()
    for i, rop in enumerate(region.ops):
        kind = rop.op.kind
        category = ops.category(kind) if kind in ops.OPS else None
        if category is ops.Category.SELECT:
            out.add(n_in + i)
        elif (ops.is_elementwise(kind) or kind == "put") and any(
                v in out for slot, v in enumerate(rop.operands) if not ops.gathers_at(kind, slot)):
            out.add(n_in + i)
        elif category in (ops.Category.SOFTMAX, ops.Category.SCAN) and rop.operands[0] in out:
            out.add(n_in + i)
    # values of positions alone (index ops, and elementwise ops of them and of scalars)
    positional = {n_in + i for i, rop in enumerate(region.ops) if rop.op.kind == "index"}
    users: dict[int, set[int]] = {}
    for i, rop in enumerate(region.ops):
        for v in rop.operands:
            users.setdefault(v, set()).add(n_in + i)
        if ops.is_elementwise(rop.op.kind) and region.value_type(n_in + i).rank and all(
                v in positional or not region.value_type(v).rank for v in rop.operands):
            positional.add(n_in + i)
    # (a selection reads its operand along the row: a value of positions it sorts is no lane)
    selects = {v for v in out if ops.category(region.ops[v - n_in].op.kind) is ops.Category.SELECT}
    outputs, positions = set(region.outputs), set()
    for v in sorted(positional - out - outputs, reverse=True):  # users first
        if users.get(v) and users[v] <= (out - selects) | positions:
            positions.add(v)
    return frozenset(out), frozenset(positions)


def scan_directions(region: Region) -> Refusal | None:
    """A row longer than a chunk is walked from its end when a program scans in reverse, so
    its scans all run one way, and it has no argmax/argmin (whose chunks keep the first
    position of equal values by walking from the start)."""
    scans = [r.op for r in region.ops if r.op.kind in ops.OPS and ops.OPS[r.op.kind].scan is not None]
    if not any(op.attr("reverse") for op in scans):
        return None
    if not all(op.attr("reverse") for op in scans):
        return Refusal(Rule.TILE, "scans run both ways along the row")
    for r in region.ops:
        red = ops.OPS[r.op.kind].reduction if r.op.kind in ops.OPS else None
        if red is not None and red.index:
            return Refusal(Rule.TILE, f"{r.op.kind} reads a row that a reverse scan walks from its end")
    return None


def partial_reductions(region: Region, space: RowSpace, layouts: dict[int, Layout]) -> frozenset[int]:
    """The reductions of a row program that leave some of its axes to the reductions reading
    them (`mean(x, axis=3)` in `mean(x, axis=(0, 2, 3))`): their values are never computed."""
    n_in = len(region.inputs)
    _, across = across_reductions(region, space, layouts)
    return frozenset(n_in + i for i, r in enumerate(region.ops)
                     if ops.category(r.op.kind) is ops.Category.REDUCTION
                     and space.runs & set(layouts[n_in + i]) and n_in + i not in across)
