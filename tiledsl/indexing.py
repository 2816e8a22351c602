"""Indexing: subscripts, slices, gathers, concatenation and reshapes, lowered to views
(`slice`, `reshape`, `expand`) and gathers (`take` at index expressions).

Sema (`tiledsl/sema.py`) hands each such construct to `Indexing`, which lowers the
values it reads through sema's `expr` and emits its ops through the kernel's
`Builder`. Sizes that only a call knows are checked at every call
(`Graph.requires`), and `check_bounds` counts each gather's out-of-range indices
(`Indexing.checks`, returned by sema as extra outputs).
"""

from __future__ import annotations

from collections.abc import Callable

from tiledsl import ast, ops
from tiledsl import diagnostics as diag
from tiledsl.builder import Builder
from tiledsl.dims import Lin, exact, factors, floor_divisions, never_zero
from tiledsl.ir import Op, walk
from tiledsl.ops.structure import index_dtype_message
from tiledsl.source import Span
from tiledsl.types import (
    MAX_RANK,
    BroadcastMismatch,
    DType,
    Shape,
    TensorType,
    broadcast_shapes,
    broadcasts_to,
    format_shape,
    normalize_axis,
    reshape_ends,
)


class Indexing:
    """The indexing of one kernel. `expr` lowers a sub-expression; `is_dim(name)`: does
    `name` stand for a dim symbol there (not shadowed by a value)?"""

    # the builtins lowered here (a method each), by the name sema's handler table gives them
    CALLS = ("gather", "reshape", "expand", "squeeze", "flip", "pad", "scatter", "scatter_add", "index_add",
             "index_copy")

    def __init__(self, build: Builder, expr: Callable[[ast.Expr], int], is_dim: Callable[[str], bool],
                 check_bounds: bool) -> None:
        self.b, self.graph = build, build.graph
        self.expr, self.is_dim = expr, is_dim
        self.check_bounds = check_bounds
        self.checks: list[tuple[int, tuple]] = []  # (count node, Graph.checks entry)
        self.positional: dict[int, bool] = {}  # `_positional`'s answers
        self.exact: list[tuple[str, Lin, Lin]] = []  # floor divisions the call checks exact

    def _value(self, args: dict[str, ast.Expr], name: str) -> tuple[int, Span]:
        expr = args[name]
        return self.expr(expr), expr.span

    def subscript(self, e: ast.Subscript) -> int:
        """NumPy indexing. Integers, slices and None build a view (`slice`, read in place
        through an offset and strides); integer tensors or expressions among the items
        (advanced indexing) gather with `take`, NumPy's broadcasting and placement rules."""
        return self._indexed(e, self.expr(e.value), read_through=True)

    def write(self, e: ast.Subscript, x: int, value: tuple[int, Span], span: Span) -> int:
        """`x[items] = v` (torch's setitem, index_put_), out of place: x with v (cast to x's
        dtype, broadcast to the shape x[items] has) written at the elements x[items] reads;
        where tensor indices repeat an element, which write wins is unspecified (as torch's).
        The name is bound to the result: values bound before keep their elements."""
        if len(e.items) == 1 and not isinstance(e.items[0], ast.Slice | ast.EllipsisLit | ast.NoneLit) \
                and literal_int(e.items[0]) is None:
            mask = self.expr(e.items[0])
            if self.graph.op(mask).type.dtype is DType.BOOL:
                return self._write_where(e, x, (mask, e.items[0].span), value, span)
        read = self._indexed(e, x, read_through=False)
        shape = self.graph.op(read).shape
        v, vspan = value
        vt = self.graph.op(v).type
        if vt.shape != shape and not broadcasts_to(vt.shape, shape):
            note = diag.Note(f"these elements are {format_shape(shape)}", e.span)
            raise diag.IndexingError(vspan, [note], message=(
                f"cannot write a value of shape {format_shape(vt.shape)} into {format_shape(shape)} "
                "elements"))
        if read == x or self.graph.op(read).kind == "slice":
            return self._write_box(x, read, v, span)
        indices = self._positions(x, read, span)
        if vt.shape != shape:
            v = self.b.user_op("expand", [(v, vspan)], vspan, shape=shape)
        return self._put(span, x, v, vspan, [(i, span) for i in indices], accumulate=False)

    def _write_box(self, x: int, view: int, v: int, span: Span) -> int:
        """A write through basic indexing (ints, slices, None) covers a box of x: x's elements
        there are v's, read at the view's index (x's index less the slice's start, over its
        step), elsewhere x's, an elementwise select that fuses with what reads it (min-p's
        `sorted_indices_to_remove[..., :1] = False` stays in its row program)."""
        xt = self.graph.op(x).type
        if view == x:
            inside, at = None, [self._index_of(xt.shape, d, span) for d in range(xt.rank)]
        else:
            conds, at, axis = [], [], 0
            for item in self.graph.op(view).attr("items"):
                if item[0] == "new":
                    at.append(None)
                    continue
                i = self._index_of(xt.shape, axis, span)
                axis += 1
                if item[0] == "at":
                    conds.append(self.b.user_op("eq", [(i, span), (self.b.size(item[1], span), span)], span))
                    continue
                _, start, stop, step, _ = item
                j = i if start == 0 else self.b.user_op("sub", [(i, span), (self.b.size(start, span), span)],
                                                        span)
                zero = self.b.const(0, DType.I32, span)
                conds.append(self.b.user_op("ge", [(j, span), (zero, span)], span))
                conds.append(self.b.user_op("lt", [(i, span), (self.b.size(stop, span), span)], span))
                if step != 1:
                    k = self.b.const(step, DType.I32, span)
                    rem = self.b.user_op("mod", [(j, span), (k, span)], span)
                    conds.append(self.b.user_op("eq", [(rem, span), (self.b.const(0, DType.I32, span), span)],
                                                span))
                    j = self.b.user_op("floordiv", [(j, span), (k, span)], span)
                at.append(j)
            inside = conds[0]
            for c in conds[1:]:
                inside = self.b.user_op("and", [(inside, span), (c, span)], span)
        vt = self.graph.op(v).type
        if vt.rank:  # v read at the view's index of each element of x
            view_shape = xt.shape if view == x else self.graph.op(view).shape
            lead = len(view_shape) - vt.rank
            sub = [None if d == 1 else at[lead + k] for k, d in enumerate(vt.shape)]
            v = reindex(self.b, v, sub, span)
        if vt.dtype is not xt.dtype and not xt.weak:
            v = self.b.user_op("cast", [(v, span)], span, dtype=xt.dtype)
        if inside is None:  # x[...] = v: every element
            return self.b.user_op("expand", [(v, span)], span, shape=xt.shape) \
                if self.graph.op(v).shape != xt.shape else v
        out = self.b.user_op("where", [(inside, span), (v, span), (x, span)], span)
        if self.graph.op(out).type.dtype is not xt.dtype:
            out = self.b.user_op("cast", [(out, span)], span, dtype=xt.dtype)
        return out

    def _write_where(self, e: ast.Subscript, x: int, mask: tuple[int, Span], value: tuple[int, Span],
                     span: Span) -> int:
        """`x[mask] = v` with a bool mask of x's leading dims (torch's: a [M] mask of an [M, N]
        x selects rows) and one value (`scores[scores < t] = -inf`, masked_fill_):
        `where(mask, v, x)` in x's dtype."""
        xt = self.graph.op(x).type
        (m, mspan), (v, vspan) = mask, value
        mt = self.graph.op(m).type
        if mt.shape != xt.shape[:mt.rank]:
            note = diag.Note(f"the value written into is {xt}", e.span)
            raise diag.IndexingError(mspan, [note], message=(
                f"a bool mask of shape {format_shape(mt.shape)} must have the leading dims of "
                f"{format_shape(xt.shape)}"))
        if self.graph.op(v).type.rank != 0:
            raise diag.IndexingError(vspan, message=(
                "a write through a bool mask takes one value (torch's would need as many as the mask "
                "selects, a count only the call knows); write where(mask, v, x) for a tensor v"))
        if mt.rank < xt.rank:  # the mask's trailing axes, of size 1
            items = tuple(("range", 0, d, 1, d) for d in mt.shape) + (("new",),) * (xt.rank - mt.rank)
            m = self.b.user_op("slice", [(m, mspan)], mspan, items=items)
        if self.graph.op(v).type.dtype is not xt.dtype and not xt.weak:
            v = self.b.user_op("cast", [(v, vspan)], vspan, dtype=xt.dtype)
        out = self.b.user_op("where", [(m, mspan), (v, vspan), (x, span)], span)
        if self.graph.op(out).type.dtype is not xt.dtype:
            out = self.b.user_op("cast", [(out, span)], span, dtype=xt.dtype)
        return out

    def _positions(self, x: int, read: int, span: Span) -> list[int]:
        """For each axis of x, the index of the element of x each element of `read` (x itself,
        a slice of it, or a take of either) reads."""
        op = self.graph.op(read)
        if read == x:
            return [self._index_of(op.shape, d, span) for d in range(op.type.rank)]
        if op.kind == "slice":
            at = [self._index_of(op.shape, d, span) for d in range(op.type.rank)]
            return slice_source(self.b, op, at, span)
        source, *indices = self.graph.operands(read)  # a take
        if source == x:
            return list(indices)
        view = self.graph.op(source)  # a take of a slice of x: the slice's source indices
        return slice_source(self.b, view, list(indices), span)

    def _indexed(self, e: ast.Subscript, value: int, read_through: bool) -> int:
        """`value[e.items]`: a view, or a gather of one; `read_through`: a slice of an index
        map is computed at its elements (`_read_positional`)."""
        t = self.graph.op(value).type
        if t.rank == 0:  # a scalar is computed where it is read: there is nothing to view
            raise diag.IndexingError(e.span, message=(
                f"a 0-d value ({t}) cannot be indexed; it broadcasts as it is"))
        items = self._expand_ellipsis(e, t.rank)
        advanced: dict[int, tuple[int, Span]] = {}  # source axis -> index value
        axis = 0
        for item in items:
            if isinstance(item, ast.NoneLit):
                continue
            if not isinstance(item, ast.Slice) and literal_int(item) is None:
                node = self.expr(item)
                it = self.graph.op(node).type
                if not it.dtype.is_int:
                    raise diag.IndexingError(item.span, [diag.Note(f"this index is {it}", item.span)],
                                             message=index_dtype_message(it.dtype))
                advanced[axis] = (node, item.span)
            axis += 1
        if not advanced:
            view = self._view(e, value, t, items)
            return self._read_positional(view, e.span) if read_through else view
        if any(isinstance(i, ast.NoneLit) for i in items):
            raise diag.IndexingError(e.span, message=(
                "None (a new axis) cannot be mixed with tensor indices; add the axis in a "
                "second subscript, e.g. x[idx][:, None]"))
        # literal integers among tensor indices are 0-d indices (NumPy counts them as advanced)
        axis = 0
        for item in items:
            if not isinstance(item, ast.Slice) and axis not in advanced:
                advanced[axis] = (self.b.const(literal_int(item), DType.I32, item.span), item.span)
            axis += 1
        basic = [ast.Slice(i.span, None, None, None) if k in advanced else i for k, i in enumerate(items)]
        if any(i.start is not None or i.stop is not None or i.step is not None for i in basic):
            value = self._view(e, value, t, basic)
            t = self.graph.op(value).type
        return self._gather(e, value, t, advanced)

    def _read_positional(self, view: int, span: Span) -> int:
        """A slice of a value computed from positions (an `index`, a pad, a concat, a flip, a
        gather: an index map) read through: the map computed again at the slice's elements
        (`reindex`), as a stored tensor's slice is read through its strides.
        `pad(x, (3, 0))[..., 1:L + 1]` is x read at i - 2, never a padded tensor stored."""
        op = self.graph.op(view)
        if op.kind != "slice":
            return view
        src = self.graph.operands(view)[0]
        if not _positional(self.graph, src, self.positional):
            return view
        at = [self._index_of(op.shape, d, span) for d in range(op.type.rank)]
        out = reindex(self.b, src, slice_source(self.b, op, at, span), span)
        if self.graph.op(out).shape != op.shape:  # an index read along one axis: its full shape
            out = self.b.user_op("expand", [(out, span)], span, shape=op.shape)
        return out

    def _expand_ellipsis(self, e: ast.Subscript, rank: int) -> list[ast.Expr]:
        items = list(e.items)
        dots = [i for i in items if isinstance(i, ast.EllipsisLit)]
        if len(dots) > 1:
            raise diag.IndexingError(dots[1].span, message="an index can have only one '...'")
        used = sum(not isinstance(i, ast.EllipsisLit | ast.NoneLit) for i in items)
        if used > rank:
            raise diag.IndexingError(e.span, message=(
                f"too many indices: {used} for a value of rank {rank}"))
        fill = [ast.Slice(e.span, None, None, None)] * (rank - used)
        if dots:
            k = items.index(dots[0])
            return items[:k] + fill + items[k + 1:]
        return items + fill

    def _view(self, e: ast.Subscript, value: int, t: TensorType, items: list[ast.Expr]) -> int:
        """Basic indexing: one `slice` view of `value`."""
        out: list[tuple] = []
        requires = list(self.graph.requires)
        axis = 0
        for item in items:
            if isinstance(item, ast.NoneLit):
                out.append(("new",))
                continue
            size = Lin.of(t.shape[axis])
            if isinstance(item, ast.Slice):
                out.append(self._range(item, size, requires))
            else:
                k = literal_int(item)
                index = size + Lin((), k) if k < 0 else Lin((), k)
                self._require(index, item.span, f"index {k} is outside axis {axis} of size "
                              f"{t.shape[axis]}", requires)
                self._require(size - index - Lin((), 1), item.span, f"index {k} is outside axis "
                              f"{axis} of size {t.shape[axis]}", requires)
                out.append(("at", index.dim()))
            axis += 1
        self.graph.requires = tuple(requires)
        return self.b.user_op("slice", [(value, e.value.span)], e.span, items=tuple(out))

    def _range(self, item: ast.Slice, size: Lin, requires: list) -> tuple:
        step = 1 if item.step is None else literal_int(item.step)
        if step is None or step < 1:
            raise diag.IndexingError(item.step.span, message=(
                "a slice step must be a positive integer literal"))
        start = Lin() if item.start is None else self._bound(item.start, size)
        stop = size if item.stop is None else self._bound(item.stop, size)
        if size.is_const and start.is_const and stop.is_const:  # Python's clamping, exactly
            lo, hi, _ = slice(start.const, stop.const, step).indices(size.const)
            start, stop = Lin((), lo), Lin((), max(lo, hi))
        else:
            what = f"slice {item.span.text}"
            self._require(start, item.span, f"{what} starts before 0", requires)
            self._require(stop - start, item.span, f"{what} stops before it starts", requires)
            self._require(size - stop, item.span, f"{what} ends past the axis (size {size.dim()})",
                          requires)
        length = (stop - start + Lin((), step - 1)) // Lin((), step)
        if length.is_const and length.const < 1:
            raise diag.IndexingError(item.span, message=(
                f"slice {item.span.text} is empty here; tiledsl values have no empty dims"))
        return ("range", start.dim(), stop.dim(), step, length.dim())

    def _bound(self, expr: ast.Expr, size: Lin) -> Lin:
        """A slice bound: a negative literal or a negated expression counts from the end."""
        k = literal_int(expr)
        if k is not None:
            return size + Lin((), k) if k < 0 else Lin((), k)
        if isinstance(expr, ast.Unary) and expr.op == "-":
            return size - self._dim_expr(expr.operand)
        return self._dim_expr(expr)

    def _dim_expr(self, expr: ast.Expr, what: str = "slice bounds") -> Lin:
        """An integer expression of dims and literals, as a dim."""
        if isinstance(expr, ast.IntLit):
            return Lin((), expr.value)
        if isinstance(expr, ast.Name) and self.is_dim(expr.id):
            return Lin(((expr.id, 1),), 0)
        if isinstance(expr, ast.Unary) and expr.op in "-+":
            inner = self._dim_expr(expr.operand, what)
            return -inner if expr.op == "-" else inner
        if isinstance(expr, ast.Binary) and expr.op in ("+", "-", "*", "//", "%"):
            a, b = self._dim_expr(expr.lhs, what), self._dim_expr(expr.rhs, what)
            if expr.op in ("//", "%") and b.is_const and b.const <= 0:
                raise diag.IndexingError(expr.rhs.span, message=(
                    f"a dim can only be divided by a positive number, got {b.const}"))
            return {"+": a.__add__, "-": a.__sub__, "*": a.__mul__, "//": a.__floordiv__,
                    "%": a.__mod__}[expr.op](b)
        raise diag.IndexingError(expr.span, message=(
            f"{what} are integer expressions of dims and literals (like D // 2 or N - 1); "
            f"'{expr.span.text}' is not one"))

    def _require(self, x: Lin, span: Span, message: str, requires: list) -> None:
        """`x >= 0`: checked now when it is a number, at every call otherwise (unless it holds
        at any sizes: a sum of products of dims, each at least 1)."""
        if x.const >= 0 and all(c > 0 and not any(f.startswith("(") for f in factors(a))
                                for a, c in x.terms):
            return
        if x.is_const:
            if x.const < 0:
                raise diag.IndexingError(span, message=message)
        else:
            requires.append((x.dim(), span, message))

    def _gather(self, e: ast.Subscript, value: int, t: TensorType,
                advanced: dict[int, tuple[int, Span]]) -> int:
        """Advanced indexing of `value` (its sliced axes already full) as one `take`."""
        axes = sorted(advanced)
        shapes = [self.graph.op(advanced[a][0]).type.shape for a in axes]
        try:
            b = broadcast_shapes(*shapes)
        except BroadcastMismatch as err:
            notes = [diag.Note(f"this index has shape {format_shape(s)}", advanced[a][1])
                     for a, s in zip(axes, shapes, strict=True)]
            raise diag.IndexingError(e.span, notes, message=(
                f"the index arrays cannot be broadcast together: they differ at dim {err.dim} "
                f"({err.a} vs {err.b})")) from None
        for a in axes:
            self._check_index(value, t, a, *advanced[a], e.span)
        rest = [a for a in range(t.rank) if a not in advanced]
        adjacent = axes == list(range(axes[0], axes[0] + len(axes)))
        before = [a for a in rest if adjacent and a < axes[0]]
        after = [a for a in rest if a not in before]
        out = tuple(t.shape[a] for a in before) + b + tuple(t.shape[a] for a in after)
        b0 = len(before)
        indices = []
        for a in range(t.rank):
            if a in advanced:
                node, span = advanced[a]
                rank = self.graph.op(node).type.rank
                if b0 + len(b) != len(out) and rank:  # B is not right-aligned in the output
                    first = b0 + len(b) - rank
                    node = reindex(self.b, node, [self._index_of(out, first + k, span)
                                                for k in range(rank)], span)
                indices.append((node, span))
            else:
                pos = before.index(a) if a in before else b0 + len(b) + after.index(a)
                indices.append((self._index_of(out, pos, e.span), e.span))
        return self.b.user_op("take", [(value, e.value.span), *indices], e.span)

    def _check_index(self, x: int, t: TensorType, axis: int, idx: int, ispan: Span,
                     span: Span) -> None:
        """compile(check_bounds=True): count the values of `idx` outside [-n, n) for axis
        `axis` (size n) of `x`, as one more (hidden) output of the program."""
        if not self.check_bounds:
            return
        n = self.b.size(Lin.of(t.shape[axis]).dim(), ispan)
        low = self.b.user_op("lt", [(idx, ispan), (self.b.user_op("neg", [(n, ispan)], ispan), ispan)], ispan)
        high = self.b.user_op("ge", [(idx, ispan), (n, ispan)], ispan)
        count = self.b.user_op("or", [(low, ispan), (high, ispan)], ispan)
        rank = self.graph.op(count).type.rank
        if rank == 0:
            count = self.b.user_op("cast", [(count, ispan)], ispan, dtype=DType.I32)
        for a in reversed(range(rank)):
            count = self.b.user_op("sum", [(count, ispan)], ispan, axis=a, keepdims=False)
        source = x
        while ops.category(self.graph.op(source).kind) is ops.Category.LAYOUT:
            source = self.graph.operands(source)[0]
        op = self.graph.op(source)
        name = "the indexed value"
        if op.kind == "param":
            name = f"'{op.attr('name')}'" if source == x else f"a view of '{op.attr('name')}'"
        self.checks.append((count, (span, name, axis, t.shape[axis])))

    def _index_of(self, shape: tuple, axis: int, span: Span) -> int:
        """The index along `axis` of a value of `shape`, as an index value that broadcasts
        (size 1 along every other axis)."""
        if shape[axis] == 1:
            return self.b.const(0, DType.I32, span)
        small = tuple(d if k == axis else 1 for k, d in enumerate(shape))
        return self.b.user_op("index", [], span, axis=axis, shape=small)

    def concat(self, e: ast.Call) -> int:
        """concat(a, b, ..., axis=): each output element reads the piece it falls in, at its
        index shifted by the piece's offset (`reindex`), selected with `where`: the pieces
        are computed where the concatenation is read, never stored."""
        for kw in e.keywords:
            if kw.name != "axis":
                raise diag.KeywordError(kw.span, message=(
                    f"'concat' has no parameter '{kw.name}' (parameters: *values, axis)"))
        if not e.args:
            raise diag.ArityError(e.span, name="concat", expected="1 or more values", got=0)
        pieces = [(self.expr(a), a.span) for a in e.args]
        first = self.graph.op(pieces[0][0]).type
        for node, span in pieces:
            t = self.graph.op(node).type
            if t.rank != first.rank or t.rank == 0:
                raise diag.RankError(span, [diag.Note(f"the first value is {first}", pieces[0][1])],
                                     message=f"concat needs values of one rank (1 or more), got {t}")
        args = {kw.name: kw.value for kw in e.keywords}
        axis = axis_arg(e, args, "axis", first.rank)
        offsets, total = [], Lin()
        for k, (node, span) in enumerate(pieces):
            t = self.graph.op(node).type
            for d in range(first.rank):
                if d != axis and t.shape[d] != first.shape[d]:
                    message = (f"concat along axis {axis} needs equal sizes in the other dims; dim {d} is "
                               f"{t.shape[d]} here and {first.shape[d]} in the first value")
                    # dims only the sizes decide (x[..., ::2] and x[..., 1::2] of an even R):
                    # read at the first value's, checked equal at every call
                    want = first.shape[:axis] + (t.shape[axis],) + first.shape[axis + 1:]
                    agreed = self.b.agree_shape(node, span, want, message)
                    if agreed is None:
                        note = diag.Note(f"the first value is {first}", pieces[0][1])
                        raise diag.IndexingError(span, [note], message=message)
                    node = agreed
                    pieces[k] = (node, span)
                    break
            offsets.append(total)
            total = total + Lin.of(t.shape[axis])
        if len(pieces) == 1:
            return pieces[0][0]
        out = first.shape[:axis] + (total.dim(),) + first.shape[axis + 1:]
        idx = self._index_of(out, axis, e.span)
        values = []
        for (node, span), offset in zip(pieces, offsets, strict=True):
            shifted = idx
            if offset != Lin():
                start = self.b.size(offset.dim(), e.span)
                shifted = self.b.user_op("sub", [(idx, e.span), (start, e.span)], e.span)
            indices = [shifted if d == axis else self._index_of(out, d, e.span) for d in range(first.rank)]
            values.append((reindex(self.b, node, indices, span), span))
        result = values[-1]
        for (value, span), offset in zip(reversed(values[:-1]), reversed(offsets[1:]), strict=True):
            cond = self.b.user_op("lt", [(idx, e.span), (self.b.size(offset.dim(), e.span), e.span)], e.span)
            result = (self.b.user_op("where", [(cond, e.span), (value, span), result], e.span), e.span)
        return result[0]

    def gather(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """torch.gather: `out[.., j, ..] = x[.., idx[.., j, ..], ..]` along `axis`, with idx of
        x's rank (out has idx's shape); or, with idx of one rank less, one element per
        position (`gather(x, y, axis=-1)` of logits [N, V] and labels [N] is [N])."""
        x, xspan = self._value(args, "x")
        idx, ispan = self._value(args, "index")
        xt, it = self.graph.op(x).type, self.graph.op(idx).type
        axis = axis_arg(e, args, "axis", xt.rank)
        if it.rank not in (xt.rank, xt.rank - 1):
            raise diag.IndexingError(ispan, [diag.Note(f"this value is {xt}", xspan)], message=(
                f"gather needs an index of rank {xt.rank} (torch.gather) or {xt.rank - 1} (one "
                f"element per position along axis {axis}), got rank {it.rank}"))
        out = it.shape
        dims = list(range(len(out)))
        if it.rank < xt.rank:
            dims.insert(axis, None)
        indices = [(idx, ispan) if d is None or k == axis else
                   (self._index_of(out, d, e.span), e.span) for k, d in enumerate(dims)]
        if it.rank == xt.rank:
            indices[axis] = (idx, ispan)
        self._check_index(x, xt, axis, idx, ispan, e.span)
        return self.b.user_op("take", [(x, xspan), *indices], e.span)

    def scatter(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """torch.scatter, out of place: x with `out[.., idx[.., j, ..], ..] = src[.., j, ..]`
        along `axis` (idx of x's rank, src of idx's shape or a scalar); where idx repeats an
        element, which write wins is unspecified (as torch's)."""
        return self._scatter(e, args, accumulate=False)

    def scatter_add(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """torch.scatter_add, out of place: src added into x at idx along `axis`."""
        return self._scatter(e, args, accumulate=True)

    def _scatter(self, e: ast.Call, args: dict[str, ast.Expr], accumulate: bool) -> int:
        x, xspan = self._value(args, "x")
        idx, ispan = self._value(args, "index")
        src, sspan = self._value(args, "src")
        xt, it = self.graph.op(x).type, self.graph.op(idx).type
        if xt.rank == 0:
            raise diag.RankError(xspan, message=f"'{e.func}' needs a value of rank 1 or more, got {xt}")
        axis = axis_arg(e, args, "axis", xt.rank)
        self._index_type(it, ispan)
        if it.rank != xt.rank:
            raise diag.IndexingError(ispan, [diag.Note(f"this value is {xt}", xspan)], message=(
                f"'{e.func}' needs an index of x's rank {xt.rank}, got rank {it.rank}"))
        st = self.graph.op(src).type
        if st.rank == 0:
            src = self.b.user_op("expand", [(src, sspan)], sspan, shape=it.shape)
        elif st.shape != it.shape:
            raise diag.IndexingError(sspan, [diag.Note(f"the index is {it}", ispan)], message=(
                f"'{e.func}' needs src of the index's shape {format_shape(it.shape)}, got "
                f"{format_shape(st.shape)}"))
        indices = [(idx, ispan) if k == axis else (self._index_of(it.shape, k, e.span), e.span)
                   for k in range(xt.rank)]
        self._check_index(x, xt, axis, idx, ispan, e.span)
        return self._put(e.span, x, src, sspan, indices, accumulate)

    def index_add(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """torch.index_add, out of place: `out[.., idx[j], ..] += src[.., j, ..]` along `axis`
        (idx 1-d, src of x's shape but along the axis, where it has idx's length)."""
        return self._index_put(e, args, accumulate=True)

    def index_copy(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """torch.index_copy, out of place: `out[.., idx[j], ..] = src[.., j, ..]` along `axis`
        (a KV cache's append at its positions); where idx repeats, which write wins is
        unspecified."""
        return self._index_put(e, args, accumulate=False)

    def _index_put(self, e: ast.Call, args: dict[str, ast.Expr], accumulate: bool) -> int:
        x, xspan = self._value(args, "x")
        idx, ispan = self._value(args, "index")
        src, sspan = self._value(args, "src")
        xt, it, st = self.graph.op(x).type, self.graph.op(idx).type, self.graph.op(src).type
        if xt.rank == 0:
            raise diag.RankError(xspan, message=f"'{e.func}' needs a value of rank 1 or more, got {xt}")
        axis = axis_arg(e, args, "axis", xt.rank)
        self._index_type(it, ispan)
        if it.rank != 1:
            raise diag.IndexingError(ispan, message=f"'{e.func}' needs a 1-d index, got {it}")
        note = [diag.Note(f"this value is {xt}", xspan)]
        if st.rank != xt.rank:
            raise diag.RankError(sspan, note, message=(
                f"'{e.func}' needs src of x's rank {xt.rank}, got {st}"))
        for d in range(xt.rank):
            if d != axis and st.shape[d] != xt.shape[d]:
                raise diag.IndexingError(sspan, note, message=(
                    f"'{e.func}' needs src of x's sizes but along axis {axis}; dim {d} is "
                    f"{st.shape[d]} here and {xt.shape[d]} in x"))
        if st.shape[axis] != it.shape[0]:
            raise diag.IndexingError(sspan, [diag.Note(f"the index is {it}", ispan)], message=(
                f"'{e.func}' needs src of the index's length {it.shape[0]} along axis {axis}, "
                f"got {st.shape[axis]}"))
        n = it.shape[0]
        items = tuple(("range", 0, n, 1, n) if k == axis else ("new",) for k in range(xt.rank))
        placed = self.b.user_op("slice", [(idx, ispan)], ispan, items=items)
        indices = [(placed, ispan) if k == axis else (self._index_of(st.shape, k, e.span), e.span)
                   for k in range(xt.rank)]
        self._check_index(x, xt, axis, idx, ispan, e.span)
        return self._put(e.span, x, src, sspan, indices, accumulate)

    @staticmethod
    def _index_type(it: TensorType, span: Span) -> None:
        if not it.dtype.is_int:
            raise diag.IndexingError(span, [diag.Note(f"this index is {it}", span)],
                                     message=index_dtype_message(it.dtype))

    def _put(self, span: Span, x: int, src: int, sspan: Span, indices: list, accumulate: bool) -> int:
        """x with src written (or added) at `indices`: a `put` into zeros, then added to x, or
        selected over x where a second `put` marks the written elements. src is cast to x's
        dtype (a literal x, expand(0.0, [..]), takes src's); x = 0 is not added."""
        xt, st = self.graph.op(x).type, self.graph.op(src).type
        dtype = st.dtype if xt.weak else xt.dtype
        if st.dtype is not dtype:
            src = self.b.user_op("cast", [(src, sspan)], sspan, dtype=dtype)
        put = self.b.user_op("put", [(src, sspan), *indices], span, shape=xt.shape, accumulate=accumulate)
        zero = _is_zero(self.graph, x)
        if accumulate:
            out = put if zero else self.b.user_op("add", [(x, span), (put, span)], span)
        elif zero:
            out = put
        else:
            true = self.b.user_op("expand", [(self.b.const(True, DType.BOOL, span), span)], span,
                                  shape=self.graph.op(src).type.shape)
            written = self.b.user_op("put", [(true, span), *indices], span, shape=xt.shape,
                                     accumulate=False)
            out = self.b.user_op("where", [(written, span), (put, span), (x, span)], span)
        if self.graph.op(out).type.dtype is not dtype:
            out = self.b.user_op("cast", [(out, span)], span, dtype=dtype)
        return out

    def reshape(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """reshape(x, [d0, ...], copy=false): the dims are integer expressions of dims and
        literals, one of them may be -1 (what is left); element counts that only the call
        can compare are checked at every call (`Graph.requires`)."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if t.rank == 0:
            raise diag.IndexingError(e.span, message=(
                f"a 0-d value ({t}) cannot be reshaped; it broadcasts as it is"))
        given = _shape_list(args["shape"], "reshape", "[B, H // 2, 2]")
        shape: list[Lin | None] = []
        rest: ast.Expr | None = None
        for item in given.items:
            if literal_int(item) == -1:
                if rest is not None:
                    raise diag.IndexingError(item.span, [diag.Note("the first -1 is here", rest.span)],
                                             message="only one dim of a reshape can be -1")
                rest = item
                shape.append(None)
                continue
            d = self._dim_expr(item, "reshape dims")
            if d.is_const and d.const < 1:
                raise diag.IndexingError(item.span, message=(
                    f"a reshape dim must be at least 1, got {d.const}"))
            shape.append(d)
        total = _product(Lin.of(d) for d in t.shape)
        if rest is not None:
            shape[shape.index(None)] = _quotient(total, _product(d for d in shape if d is not None))
        shape = [exact(d, self.exact) for d in shape]  # Swin's [B_ // nW, nW, ...] and back to [-1, ...]
        new = tuple(d.dim() for d in shape)
        diff = total - _product(shape)
        note = [diag.Note(f"this value is {t}", xspan)]
        message = (f"reshape from {format_shape(t.shape)} to {format_shape(new)} changes the "
                   "number of elements")
        if never_zero(diff):
            raise diag.IndexingError(given.span, note, message=message)
        if not diff.is_const:
            requires = list(self.graph.requires)
            self._require(diff, given.span, message, requires)
            self._require(-diff, given.span, message, requires)
            self.graph.requires = tuple(requires)
            for division in floor_divisions(_product(shape)):
                if exact(diff, [division]) == Lin((), 0):
                    self.exact.append(division)  # the call checks diff == 0: the division is exact
        copy = const_bool(args.get("copy"), "'copy' of 'reshape'")
        out = self.b.user_op("reshape", [(x, xspan)], e.span, shape=new, copy=copy)
        if read_through(self.graph, x, self.positional):
            # a value computed from positions (a concat of slices: GPT-J's interleave) is read
            # through the reshape, as through a slice (`_read_positional`): computed where read
            return reindex(self.b, x, view_coords(self.b, self.graph.op(out), t.shape), e.span)
        return out

    def expand(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """expand(x, [d0, ...]): x broadcast to a shape; -1 keeps x's dim (torch's expand)."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        given = _shape_list(args["shape"], "expand", "[N, D]")
        lead = len(given.items) - t.rank
        shape = []
        for k, item in enumerate(given.items):
            if literal_int(item) == -1 and k >= lead:
                shape.append(t.shape[k - lead])
                continue
            d = self._dim_expr(item, "expand dims")
            if d.is_const and d.const < 1:
                raise diag.IndexingError(item.span, message=(
                    f"an expand dim must be at least 1, got {d.const}"))
            shape.append(d.dim())
        return self.b.user_op("expand", [(x, xspan)], e.span, shape=tuple(shape))

    def squeeze(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """squeeze(x, axis): drops size-1 axes (an int or a tuple of them), a view."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        given = args["axis"]
        items = given.items if isinstance(given, ast.TupleLit) else (given,)
        axes: dict[int, ast.Expr] = {}
        for item in items:
            axis = const_int(item, "an axis of 'squeeze'")
            norm = normalize_axis(axis, t.rank)
            if norm is None:
                raise diag.AxisError(item.span, axis=axis, rank=t.rank, lo=-t.rank, hi=t.rank - 1)
            if norm in axes:
                raise diag.DuplicateAxisError(item.span, axis=axis, func="squeeze")
            if t.shape[norm] != 1:
                raise diag.IndexingError(item.span, [diag.Note(f"this value is {t}", xspan)], message=(
                    f"squeeze needs axis {axis} to have size 1; it has size {t.shape[norm]}"
                    + ("" if isinstance(t.shape[norm], int) else
                       f" (to take index 0 of it, write x[{', '.join([':'] * norm + ['0'])}])")))
            axes[norm] = item
        out = tuple(("at", 0) if k in axes else ("range", 0, d, 1, d) for k, d in enumerate(t.shape))
        return self.b.user_op("slice", [(x, xspan)], e.span, items=out)

    def flip(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """flip(x, axis): x read at n - 1 - i along `axis` (torch.flip of one axis), computed
        where it is read (`reindex`), like concat's pieces: never stored."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if t.rank == 0:
            raise diag.RankError(e.span, message="'flip' needs a value of rank 1 or more")
        axis = axis_arg(e, args, "axis", t.rank)
        if t.shape[axis] == 1:
            return x
        indices = [self._index_of(t.shape, d, e.span) for d in range(t.rank)]
        last = self.b.user_op("sub", [(self.b.size(t.shape[axis], e.span), e.span),
                                      (self.b.const(1, DType.I32, e.span), e.span)], e.span)
        indices[axis] = self.b.user_op("sub", [(last, e.span), (indices[axis], e.span)], e.span)
        return reindex(self.b, x, indices, xspan)


    def pad(self, e: ast.Call, args: dict[str, ast.Expr]) -> int:
        """pad(x, (before, after), axis=-1, value=0): x read at i - before along `axis`, `value`
        outside it (torch.nn.functional.pad of one axis, constant mode), computed where it is
        read like flip's and concat's pieces: never stored. The widths are dims or literals,
        at least 0 (checked at the call when only the sizes decide)."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if t.rank == 0:
            raise diag.RankError(e.span, message="'pad' needs a value of rank 1 or more")
        axis = axis_arg(e, args, "axis", t.rank)
        given = args["pad"]
        if not isinstance(given, ast.TupleLit | ast.ListLit) or len(given.items) != 2:
            raise diag.ConstantExpected(given.span, what="the widths of 'pad'",
                                        expected="two dims (before, after), like (1, 0) or (0, D - N)")
        requires = list(self.graph.requires)
        before, after = (self._dim_expr(item, "pad widths") for item in given.items)
        for width, item in zip((before, after), given.items, strict=True):
            self._require(width, item.span, f"a pad width must be at least 0 (it is {width.dim()})", requires)
        self.graph.requires = tuple(requires)
        value = args.get("value")
        fill = (self.b.const(0, DType.I32, e.span), e.span) if value is None else self._value(args, "value")
        if self.graph.op(fill[0]).type.rank != 0:
            raise diag.RankError(fill[1], message=(
                f"the value of 'pad' is one number, got {self.graph.op(fill[0]).type}"))
        if before == Lin() and after == Lin():
            return x
        n = Lin.of(t.shape[axis])
        out = t.shape[:axis] + ((n + before + after).dim(),) + t.shape[axis + 1:]
        indices = [self._index_of(out, d, e.span) for d in range(t.rank)]
        at = indices[axis]
        if before != Lin():
            at = self.b.user_op("sub", [(at, e.span), (self.b.size(before.dim(), e.span), e.span)], e.span)
        indices[axis] = at
        zero, n = self.b.const(0, DType.I32, e.span), self.b.size(t.shape[axis], e.span)
        inside = self.b.user_op("and", [
            (self.b.user_op("ge", [(at, e.span), (zero, e.span)], e.span), e.span),
            (self.b.user_op("lt", [(at, e.span), (n, e.span)], e.span), e.span)], e.span)
        fill = (self.b.user_op("cast", [fill], e.span, dtype=t.dtype), fill[1])
        return self.b.user_op("where", [(inside, e.span), (reindex(self.b, x, indices, xspan), xspan), fill],
                              e.span)


def _is_zero(graph, node: int) -> bool:
    """Is `node` the literal 0, broadcast or cast or not (expand(0.0, [B, D]), zeros(x))?"""
    op = graph.op(node)
    while op.kind in ("expand", "cast"):
        node = graph.operands(node)[0]
        op = graph.op(node)
    return op.kind == "const" and op.attr("value") == 0


def _shape_list(given: ast.Expr, func: str, example: str) -> ast.ListLit | ast.TupleLit:
    """The shape argument of reshape/expand: a list (or tuple) of at most MAX_RANK dims."""
    if not isinstance(given, ast.ListLit | ast.TupleLit):
        raise diag.ConstantExpected(given.span, what=f"the shape of '{func}'",
                                    expected=f"a list of dims, like {example}")
    if len(given.items) > MAX_RANK:
        raise diag.LimitError(given.span, what=f"rank {len(given.items)}", limit=MAX_RANK)
    return given


def _product(dims) -> Lin:
    out = Lin((), 1)
    for d in dims:
        out = out * d
    return out


def _quotient(total: Lin, known: Lin) -> Lin:
    """total // known, cancelling the factors they share (B * H * S * D over B * H * S * 2
    is D // 2), so the dim inferred for a reshape's -1 reads as the user would write it."""
    if len(total.terms) == 1 and not total.const and (known.is_const or (
            len(known.terms) == 1 and not known.const)):
        (atom, c), k = total.terms[0], known.const
        left = factors(atom)
        if known.terms:
            (katom, k), = known.terms
            for f in factors(katom):
                if f not in left:
                    return total // known
                left.remove(f)
        rest = Lin(((" * ".join(left), 1),), 0) if left else Lin((), 1)
        return rest.scale(c // k) if c % k == 0 else rest.scale(c) // Lin((), k)
    return total // known


def axis_arg(e: ast.Call, args: dict[str, ast.Expr], name: str, rank: int, default: int | None = -1) -> int:
    """The axis argument `name` of a call on a value of rank `rank`, normalized."""
    expr = args.get(name)
    axis = default if expr is None else const_int(expr, f"'{name}' of '{e.func}'")
    norm = normalize_axis(axis, rank)
    if norm is None:
        where = expr.span if expr is not None else e.span
        raise diag.AxisError(where, axis=axis, rank=rank, lo=-rank, hi=rank - 1)
    return norm


def literal_int(expr: ast.Expr) -> int | None:
    """The value of an integer literal (possibly negated), else None."""
    if isinstance(expr, ast.IntLit):
        return expr.value
    if isinstance(expr, ast.Unary) and expr.op in "-+" and isinstance(expr.operand, ast.IntLit):
        return -expr.operand.value if expr.op == "-" else expr.operand.value
    return None


def const_int(expr: ast.Expr, what: str) -> int:
    if isinstance(expr, ast.IntLit):
        return expr.value
    if isinstance(expr, ast.Unary) and isinstance(expr.operand, ast.IntLit):
        return -expr.operand.value if expr.op == "-" else expr.operand.value
    raise diag.ConstantExpected(expr.span, what=what, expected="an integer constant")


def const_bool(expr: ast.Expr | None, what: str) -> bool:
    if expr is None:
        return False
    if isinstance(expr, ast.BoolLit):
        return expr.value
    raise diag.ConstantExpected(expr.span, what=what, expected="true or false")


def reindex(b: Builder, node: int, indices: list, span: Span | None) -> int:
    """`node` read at `indices` (one index value per axis; None along an axis of size 1,
    read at 0), computed where it is read:
    elementwise ops are rebuilt over their re-read operands, a slice of one is read
    through (its source at the indices the slice maps to: a row normalised by its
    statistic is computed again from slices of its leaves, the statistic read at the
    row's own index), index ops become the indices, anything else (a parameter, a
    reduction, a matmul) is gathered with `take`. Sema's concat and reshapes read their
    pieces so, and canonicalize's view of a gather its index tensors."""
    graph = b.graph
    op = graph.op(node)
    if op.type.rank == 0:
        return node
    if op.kind == "index":
        axis = op.attr("axis")
        return b.const(0, DType.I32, span) if op.shape[axis] == 1 else indices[axis]
    if op.kind == "slice" and _computed(graph.op(graph.operands(node)[0])):
        return reindex(b, graph.operands(node)[0], slice_source(b, op, indices, span), span)
    if op.kind == "transpose" and _computed(graph.op(graph.operands(node)[0])):
        a, c = (d % op.type.rank for d in op.attr("dims"))  # (a transpose of one: its source swapped)
        swapped = list(indices)
        swapped[a], swapped[c] = indices[c], indices[a]
        return reindex(b, graph.operands(node)[0], swapped, span)
    if ops.is_elementwise(op.kind):
        operands = []
        for slot, o in enumerate(graph.operands(node)):
            ot = graph.op(o).type
            if ops.gathers_at(op.kind, slot):
                operands.append((o, span))
                continue
            lead = op.type.rank - ot.rank
            sub = [None if d == 1 else indices[lead + k] for k, d in enumerate(ot.shape)]
            operands.append((reindex(b, o, sub, span), span))
        if op.kind == "expand":
            # the indices do the broadcast; its `shape` is the unread value's, which the
            # operand read at them no longer has
            return operands[0][0]
        return b.user_op(op.kind, operands, op.span or span, **op.attr_map)
    sub = [b.const(0, DType.I32, span) if d == 1 else i for d, i in zip(op.shape, indices, strict=True)]
    return b.user_op("take", [(node, span), *((i, span) for i in sub)], span)


def _positional(graph, node: int, memo: dict[int, bool]) -> bool:
    """Is `node` computed elementwise from an `index` or a gather (`take`)? `memo`: the
    answers so far (sema's ops never change), so a long chain sliced at every statement is
    walked once."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        op = graph.op(n)
        if not ops.is_elementwise(op.kind) or op.kind in ("index", "take"):
            memo[n] = op.kind in ("index", "take")
            stack.pop()
            continue
        pending = [o for o in graph.operands(n) if o not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[n] = any(memo[o] for o in graph.operands(n))
        stack.pop()
    return memo[node]


def read_through(graph, node: int, memo: dict[int, bool]) -> bool:
    """Is `node` a map of positions a view of it is read through (computed again at the
    view's elements, never stored): an elementwise op, not an `index` or a gather itself,
    computed from positions (`_positional`, `memo` its answers) and the inputs alone?"""
    op = graph.op(node)
    return (isinstance(op, Op) and op.kind not in ("index", "take") and ops.is_elementwise(op.kind)
            and op.type.rank > 0 and _positional(graph, node, memo) and index_map_of_inputs(graph, node))


def index_map_of_inputs(graph, node: int) -> bool:
    """Is `node` computed elementwise from positions and the program's inputs alone (an
    `index`, constants and dims, parameters and views of them, gathers from those): what a
    kernel reading it at other positions computes again from loads, never from another
    kernel's result (a matmul, a reduction)?"""
    def kind(n: int) -> str | None:
        return getattr(graph.op(n), "kind", None)

    def read(n: int) -> list[int]:
        k = kind(n)
        return [] if k in ("param", "const", "dim", "index") else list(graph.operands(n))

    return all(k in ("param", "const", "dim", "index", "slice", "reshape", "transpose")
               or (k is not None and ops.is_elementwise(k))
               for k in map(kind, walk([node], read)))


def _computed(op) -> bool:
    """Is `op` an elementwise value computed from others, or a transpose (not a parameter,
    an index, a reduction or a matmul, which are read through their slices)?"""
    return op.kind != "index" and ops.is_elementwise(op.kind) or op.kind == "transpose"


def view_coords(b: Builder, op, source: Shape) -> list[int]:
    """For each axis of a view's source (of shape `source`), the index expression of the
    source position each element of the view `op` reads, over the view's own `index`es."""
    out = op.shape

    def index(axis: int) -> int:
        return b.op("index", [], op.span, axis=axis, shape=tuple(d if k == axis else 1
                                                                   for k, d in enumerate(out)))

    def size(dim) -> int:
        return b.size(dim, op.span)

    if op.kind == "transpose":
        p, q = (a % len(out) for a in op.attr("dims"))
        return [index({p: q, q: p}.get(a, a)) for a in range(len(out))]
    if op.kind == "slice":  # (a new axis reads no source axis: it needs no index)
        kept = [item[0] for item in op.attr("items") if item[0] != "at"]
        return slice_source(b, op, [index(a) if kind == "range" else None for a, kind in enumerate(kept)],
                            op.span)
    # a reshape: the axes both shapes begin and end with are read as they are; the flat
    # index of the middle ones is split by the source's middle dims
    lo, hi = reshape_ends(source, out)
    mid_out, mid_src = list(range(lo, len(out) - hi)), list(range(lo, len(source) - hi))
    flat = None
    wide = len(mid_out) > 1 and len(mid_src) > 1  # a flat index of several axes: in i64
    for k in mid_out:
        if out[k] == 1:
            continue
        term = index(k)
        term = b.op("cast", [term], op.span, dtype=DType.I64) if wide else term
        for d in out[k + 1:len(out) - hi]:
            if d != 1:
                term = b.op("mul", [term, size(d)], op.span)
        flat = term if flat is None else b.op("add", [flat, term], op.span)
    flat = flat if flat is not None else b.const(0, DType.I32, op.span)
    coords = [index(a) for a in range(lo)]
    for n, a in enumerate(mid_src):
        if source[a] == 1:
            coords.append(b.const(0, DType.I32, op.span))
            continue
        at = flat
        for d in source[a + 1:len(source) - hi]:
            if d != 1:
                at = b.op("floordiv", [at, size(d)], op.span)
        coords.append(at if n == 0 else b.op("mod", [at, size(source[a])], op.span))
    shift = len(out) - len(source)
    coords += [index(a + shift) for a in range(len(source) - hi, len(source))]
    return coords


def slice_source(b: Builder, op, indices: list, span: Span | None) -> list[int]:
    """The indices of a slice's source that its elements at `indices` (one per axis of the
    slice; a new axis's is not read) read."""
    source, out = [], iter(indices)
    for item in op.attr("items"):
        if item[0] == "new":
            next(out)
        elif item[0] == "at":
            source.append(b.size(item[1], span))
        else:
            _, start, _, step, _ = item
            i = next(out)
            if i is None:  # an axis of size 1
                i = b.const(0, DType.I32, span)
            if step != 1:
                i = b.op("mul", [i, b.const(step, DType.I32, span)], span)
            if start != 0:
                i = b.op("add", [i, b.size(start, span)], span)
            source.append(i)
    return source


def own_index(graph, edge, k: int, shape: Shape) -> bool:
    """Is `edge` the index along axis k of `shape` (0 where that axis has size 1)?"""
    i_op = graph.op(edge[0])
    if not isinstance(i_op, Op):
        return False
    if i_op.kind == "index":
        return i_op.attr("axis") == k and i_op.type.rank == len(shape) and i_op.shape[k] == shape[k]
    return shape[k] == 1 and i_op.kind == "const" and i_op.attr("value") == 0


def permuted_axis(graph, indices, shape: Shape) -> int | None:
    """The axis `indices` permute, where they name every element of `shape` once: their own
    index along every axis but one, and along that one a sort's positions of a row as long as
    the axis (argsort's result, `argtopk` with k the axis' length); None otherwise."""
    moved = [k for k, e in enumerate(indices) if not own_index(graph, e, k, shape)]
    if len(moved) != 1:
        return None
    (k,) = moved
    sel = graph.op(indices[k][0])
    permutes = (isinstance(sel, Op) and sel.kind == "argtopk" and sel.type.shape == tuple(shape)
                and sel.attr("axis") % len(shape) == k and sel.attr("k") == shape[k])
    return k if permutes else None
