"""The row-program template: reductions and softmax along one axis, with the
elementwise ops around them, in one kernel.

A row program's iteration space is a shape S and its row axes: the other ("kept")
dims index rows, the row axes index positions in a row. With several row axes
(a reduction over several axes, adjacent or not: batch norm's 0, 2 and 3 of
NCHW) a position `r` counts their elements in row-major order and splits into
one index per axis (`k<axis>`). A program owns BLOCK_O rows and walks them in
chunks of BLOCK_R. Every value has a layout (which dims of S it varies along,
recorded in the kernel's `RowPlan`): "full" values vary along the row axes
([BLOCK_O, BLOCK_R] tiles), "row" values do not ([BLOCK_O, 1]). A reduction
over several axes is one reduction over the row (sema's one op per axis are
the plan's `partial` reductions, never computed).

- When a row fits in one block (`ONE_PASS`), inputs are read once and the
  program runs straight through.
- Otherwise the reductions run in phases: a reduction belongs to phase
  1 + the latest phase it depends on, each phase is one loop over the row,
  and a last loop writes the full outputs. A reduction is computed as its
  `Reduction` declaration (tiledsl/ops) says: sum, max, prod... accumulate in
  a tile of partials merged by `combine`, then `collapse`d and `finalize`d;
  argmax/argmin also keep each lane's position; softmax and logsumexp run the
  online recurrence (`online.py`); a softmax value is then exp(x - m) / z
  wherever a loop needs it. rmsnorm reads a row twice, layernorm three times,
  softmax twice.

A row that is all -inf gives softmax 0 and logsumexp -inf, never NaN.
Otherwise special values follow torch: max/min propagate NaN, a softmax row
holding a NaN or +inf is all NaN, logsumexp of a row holding +inf is +inf.
Sums, means and products whose IR dtype is f32 accumulate in f64, so an f32 program's row
sums are as good as correctly rounded (a following exp amplifies any error
of the sum), unless only 16-bit results depend on them (passes/sum_precision.py:
then in f32); f16/bf16 ones accumulate in f32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tiledsl import ops
from tiledsl.diagnostics import EmptyReductionError, LimitError
from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp, Op
from tiledsl.ops import Reduction, Scan
from tiledsl.plans import SELECT_LIMIT, RowPlan
from tiledsl.types import Compute, DType, compute_type

from . import online
from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, TensorRef, next_pow2
from .combine import emit_combine
from .expr import HELPERS, TRITON_TYPE, Emitter, Val, literal
from .online import NEG_INF

F32, I32, I64 = Compute.F32, Compute.I32, Compute.I64


def in_loop(kind: str) -> bool:
    """Is a row op computed inside the loops from its operands (softmax, a scan), not
    accumulated in a phase of its own?"""
    return kind == "softmax" or ops.OPS[kind].scan is not None


def combine_helper(kind: str, scan: Scan) -> str:
    """A scan's `combine` as the jit function tl.associative_scan and tl.reduce call."""
    n = len(scan.combine)
    a, b = [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]
    parts = ", ".join(c.format(**dict(zip(a + b, a + b, strict=True))) for c in scan.combine)
    return f"@triton.jit\ndef {kind}_combine({', '.join(a + b)}):\n    return {parts}\n\n"


for _kind, _d in ops.OPS.items():
    if _d.scan is not None:
        HELPERS[f"{_kind}_combine"] = combine_helper(_kind, _d.scan)
# argmax/argmin: a position larger than any in a row (positions are i32 in the kernel)
_NO_POSITION = str(2**31 - 1)


class RowProgram:
    def __init__(self, kernel: KernelOp) -> None:
        self.region = region = kernel.region
        self.plan: RowPlan = kernel.plan
        self.layouts = self.plan.layouts
        self.n_in = len(region.inputs)
        self.values = range(self.n_in + len(region.ops))
        self.sig, self.body = Signature(), Code()
        self.em = Emitter(self.body)
        shape, axes = self.plan.shape, self.plan.axes
        # the dims that index rows, the one reductions run across last (a group of rows)
        across = self.plan.across
        self.kept = [d for d in range(len(shape)) if d not in axes and d != across]
        self.split = self.plan.split  # the reductions across rows merged by a combine launch
        # rows a group spans (a short `across` dim: a program owns all of its rows)
        self.group = next_pow2(shape[across]) if across is not None and not self.split else 1
        self.refs: dict[int, TensorRef] = {}
        self.scalars: dict[int, str] = {}
        for i, inp in enumerate(region.inputs):
            if inp.scalar:
                self.scalars[i] = self.sig.scalar(i)
            else:
                self.refs[i] = self.sig.tensor("in", i, inp.type.shape)
        self.outs = [self.sig.tensor("out", j, region.value_type(v).shape)
                     for j, v in enumerate(region.outputs)]
        self.em.gather_from(region, self.refs, self.sig.size)
        self.length = (self.sig.size(shape[axes[0]]) if len(axes) == 1
                       else self.sig.numel(tuple(shape[a] for a in axes), "n_cols"))
        self.softmax_stats: dict[int, tuple[str, str]] = {}  # softmax value -> (m, 1/z) names
        self.carries: dict[int, list[str]] = {}  # scan value -> its partials of the chunks before
        # a selection's (source, attributes) -> its sorted keys (one sort for topk and argtopk)
        self.selections: dict[tuple, str] = {}
        # selections whose k may pass SELECT_LIMIT, the values computed from them, and the
        # workspace rows of each selection's keys (`emit_long`)
        self.long = self.plan.long_selections(region)
        self.long_values = self.reading(set(self.long))
        self.long_keys = list(dict.fromkeys(self.select_key(v) for v in self.long))
        self.partials: dict[int, tuple[str, str, bool]] = {}  # a split program's (`emit_split`)
        self.lanes = "r_base"  # the positions among a selection's k of its tile's lanes
        self.long_mode = False  # emitting the loops that sort long selections in the workspace

    # --- analysis --------------------------------------------------------------------------

    def op(self, v: int) -> Op | None:
        return self.region.ops[v - self.n_in].op if v >= self.n_in else None

    def operands(self, v: int) -> tuple[int, ...]:
        return self.region.ops[v - self.n_in].operands if v >= self.n_in else ()

    def is_row_op(self, v: int) -> bool:
        """A reduction or softmax that really reduces: its operand varies along the axes.

        One over a literal size-1 axis is elementwise (see `trivial_reduce`)."""
        return v in self.plan.reducing

    def full(self, v: int) -> bool:
        """Does the value vary along the row axes?"""
        return self.plan.full(v)

    def needed(self, targets: list[int]) -> set[int]:
        """What a loop over the row computes to produce `targets`: full values back to
        the inputs, stopping at values that are already known per row."""
        need: set[int] = set()
        stack = list(targets)
        while stack:
            v = stack.pop()
            if v in need:
                continue
            need.add(v)
            op = self.op(v)
            if op is not None and (in_loop(op.kind) or not self.is_row_op(v)):
                stack.extend(o for o in self.operands(v) if self.full(o) or o < self.n_in)
        return need

    def reading(self, seeds: set[int]) -> frozenset[int]:
        """`seeds` and the values computed from them (in the region's order)."""
        out = set(seeds)
        for v in self.values:
            if any(o in out for o in self.operands(v)):
                out.add(v)
        return frozenset(out)

    def used(self, v: int) -> bool:
        """Is `v` read element for element (a gathered input is read through its pointer)?"""
        return self.region.read_whole(v)

    # --- emission helpers -------------------------------------------------------------------

    def index(self, dim: int | None, selected: bool = False) -> str | None:
        if dim is None or self.plan.shape[dim] == 1:
            return None
        if dim not in self.plan.axes:
            return f"j{dim}[:, None]"
        if selected:  # the j-th selected element is lane j of its per-row tile
            return f"{self.lanes}[None, :]"
        return "r[None, :]" if len(self.plan.axes) == 1 else f"k{dim}[None, :]"

    def chosen_mask(self, v: int) -> str:
        """The lanes of a selection's tile that hold one of its k elements."""
        return f"omask[:, None] & ({self.lanes} < {self.k_of(v)})[None, :]"

    def k_of(self, v: int) -> str:
        """How many elements the selection `v` (or the one an op of a selection reads) holds."""
        while (op := self.op(v)).kind in ops.OPS and ops.category(op.kind) is not ops.Category.SELECT:
            v = next(o for o in self.operands(v) if o in self.plan.selected)
        return self.sig.size(op.shape[op.attr("axis")])

    def access(self, ref: TensorRef, v: int) -> tuple[str | None, str | None]:
        """(pointer, mask) of a value's tensor at the tile, or (None, None) for one element."""
        layout = self.layouts[v]
        offset = self.flat_offset(ref, layout) if v not in self.plan.selected else None
        offset = offset or ref.offset([self.index(d, v in self.plan.selected) for d in layout])
        if v in self.plan.selected:  # (k = 1: lane 0 only)
            lanes = "" if self.lanes in offset else f" + {self.lanes}[None, :] * 0"
            return f"{ref.ptr} + {offset}{lanes}", self.chosen_mask(v)
        if offset == "0":
            return None, None
        axes = self.plan.axes
        rows = any(self.index(d) for d in layout if d is not None and d not in axes)
        cols = any(self.index(d) for d in layout if d in axes)
        mask = {(True, True): "tmask", (True, False): "omask[:, None]",
                (False, True): "rmask"}[(rows, cols)]
        return f"{ref.ptr} + {offset}", mask

    def flat_offset(self, ref: TensorRef, layout) -> str | None:
        """A tensor's offset whose rows may be the flat row index times a stride: where
        it has every row dim, in their order, the per-call flag (`RowsFlat`) picks
        `o * stride` or the dims' indices times their strides (Triton compiles one). None
        where it cannot (a broadcast row dim, rows in groups, one row dim only)."""
        rows = [d for d in self.kept if self.plan.shape[d] != 1]
        axes = tuple(a for d in rows for a, e in enumerate(layout) if e == d)
        if self.group > 1 or self.split or len(rows) < 2 or len(axes) != len(rows) \
                or list(axes) != sorted(axes) or any(ref.strides[a] is None for a in axes):
            return None
        flag = self.sig.rows_flat(ref.role, ref.index, axes)
        by_dims = ref.offset([self.index(d) if d in rows else None for d in layout])
        cols = ref.offset([self.index(d) if d is not None and d not in rows else None for d in layout])
        row = f"(o[:, None] * {ref.strides[axes[-1]]} if {flag} else {by_dims})"
        return row if cols == "0" else f"{row} + {cols}"

    def load(self, i: int) -> Val:
        t = self.region.inputs[i].type
        if i in self.scalars:
            return self.em.scalar(self.scalars[i], t)
        ptr, mask = self.access(self.refs[i], i)
        if ptr is None:
            ptr, mask = self.refs[i].ptr, None
        return self.em.load_at(ptr, mask, t)

    def emit_values(self, vals: dict[int, Val], which: set[int] | None) -> None:
        """Emit the loads and elementwise ops (those in `which`, or all) not yet in `vals`."""
        em = self.em
        for v in self.values:
            if v in vals or (which is not None and v not in which) or v in self.plan.partial \
                    or v in self.plan.tail:  # (the combine launch's)
                continue
            op = self.op(v)
            if op is None:
                if self.used(v):
                    vals[v] = self.load(v)
            elif op.kind == "const":
                vals[v] = literal(op.attr("value"), compute_type(op.dtype))
            elif op.kind == "index":
                axis = op.attr("axis")
                expr = self.index(self.layouts[v][axis]) if op.shape[axis] != 1 else None
                vals[v] = em.index(expr)
            elif op.kind == "softmax" and self.is_row_op(v):
                (x,) = self.operands(v)
                if v in self.softmax_stats and x in vals:
                    ms, inv = self.softmax_stats[v]
                    xt = em.tensor(em.convert(vals[x], F32))
                    vals[v] = em.assign(f"tl.exp({xt.text} - {ms}) * {inv}", F32)
            elif self.scanned(v):
                if all(x in vals for x in self.operands(v)):
                    vals[v] = self.scan(v, [vals[x] for x in self.operands(v)])
            elif (scan := ops.OPS[op.kind].scan) is not None and not self.is_row_op(v):
                if all(x in vals for x in self.operands(v)):  # along a size-1 axis: one element
                    xs, cat = [vals[x] for x in self.operands(v)], self.reduce_cat(v)
                    lifted = self.lifted(scan, xs, cat)
                    if scan.start is not None:
                        lifted = self.started(scan, lifted, cat)
                    vals[v] = self.finalized_scan(scan, lifted, cat)
            elif self.is_row_op(v) and self.plan.source(v) in self.plan.selected:
                if self.plan.source(v) in vals:  # a reduction of the k a topk selected
                    x = self.plan.source(v)
                    vals[v] = self.one_pass_reduce(v, vals[x], self.chosen_mask(x), "r_base[None, :]",
                                                   self.k_of(x))
            elif v in self.plan.across_reducing:
                if self.operands(v)[0] in vals:
                    vals[v] = self.across_reduce(v, vals[self.operands(v)[0]])
            elif op.kind in ops.ROW_KINDS and not self.is_row_op(v):
                if self.operands(v)[0] in vals:
                    vals[v] = self.trivial_reduce(op, vals[self.operands(v)[0]])
            elif not self.is_row_op(v) and (args := em.operands(self.region.ops[v - self.n_in], vals)):
                types = tuple(self.region.value_type(o) for o in self.operands(v))
                vals[v] = em.op(op, args, types)

    def trivial_reduce(self, op: Op, x: Val) -> Val:
        """A reduction over a size-1 axis: the value itself (softmax: 1, or 0 at -inf;
        argmax: position 0)."""
        if op.kind == "softmax":
            x = self.em.tensor(self.em.convert(x, F32))
            return self.em.assign(f"tl.where({x.text} == {NEG_INF}, 0.0, tl.exp({x.text} - {x.text}))", F32)
        red = ops.OPS[op.kind].reduction
        if (red is not None and red.index) or op.kind == "argtopk":
            return self.em.assign(f"{self.em.tensor(self.em.convert(x, I64)).text} * 0", I64)
        if op.dtype.is_float:
            return self.em.convert(x, F32)
        return self.em.convert(x, x.cat if x.cat in (F32, I64) else I32)

    def across_reduce(self, v: int, x: Val) -> Val:
        """A reduction across the tile's rows along the plan's `across` dim: that dim is
        innermost in `o`, so the rows of one group (one index of the other kept dims) are
        `self.group` consecutive rows of the tile; their total is given back to each of them."""
        red, cat, em = self.reduction(v), self.reduce_cat(v), self.em
        full = self.full(self.operands(v)[0])
        x = em.convert(x, cat)
        if self.wide(v):
            x = em.assign(f"{em.tensor(x).text}.to(tl.float64)", F32)
        xm = self.masked(x, self.identity(red.identity, cat), "tmask" if full else "omask[:, None]")
        width = "BLOCK_R" if full else "1"
        groups = f"[BLOCK_O // {self.group}, {self.group}, {width}]"
        grouped = em.fresh("g")
        self.body(f"{grouped} = tl.reshape({xm}, {groups})")
        total = self.collapse(red, cat, grouped)  # [groups, 1, width]
        spread = em.assign(f"tl.reshape(tl.broadcast_to({total}, {groups}), [BLOCK_O, {width}])", cat)
        return self.finalized(spread, red, str(self.plan.shape[self.plan.across]), self.wide(v))

    def scanned(self, v: int) -> bool:
        """Is `v` a scan along the row?"""
        return self.is_row_op(v) and ops.OPS[self.op(v).kind].scan is not None

    def scan(self, v: int, xs: list[Val]) -> Val:
        """A scan along the row (`Scan` in tiledsl/ops): the chunk's tile scanned by
        `tl.associative_scan` (or Triton's own scan), each partial then combined with the
        chunks before it (`carries[v]`, per row, when the row takes several chunks), which
        then become the chunk's last partials (no tl.reduce: its combine must commute).
        f32 cumsum and cumprod accumulate in f64, like a sum."""
        em, cat, kind = self.em, self.reduce_cat(v), self.op(v).kind
        scan = ops.OPS[kind].scan
        lifted = self.lifted(scan, xs, cat)
        if scan.start is not None:
            last = f"{self.length} - 1" if self.op(v).attr("reverse") else "0"
            lifted = self.started(scan, lifted, cat, f"(r == {last})[None, :]")
        parts = []
        for x, identity in zip(lifted, scan.identity, strict=True):
            if self.wide(v):
                x = em.assign(f"{em.tensor(x).text}.to(tl.float64)", F32)
            parts.append(self.masked(x, self.identity(identity, cat)))
        names = [em.fresh("cs") for _ in parts]
        reverse = ", reverse=True" if self.op(v).attr("reverse") else ""
        if scan.builtin is not None:
            self.body(f"{names[0]} = {scan.builtin}({parts[0]}, axis=1{reverse})")
        else:
            em.helpers.add(f"{kind}_combine")
            self.body(f"{', '.join(names)} = tl.associative_scan({self.packed(parts)}, 1, "
                      f"{kind}_combine{reverse})")
        carry = self.carries.get(v)
        if carry is not None:
            self.body(f"{', '.join(names)} = {', '.join(self.combined(scan, carry, names))}")
            if scan.collapse is not None:
                total = scan.collapse.format(x=parts[0])
                self.body(f"{carry[0]} = {self.combined(scan, carry, [f'{total}[:, None]'])[0]}")
            else:  # the chunk's last partial (its first in reverse) combines it all
                last = "0" if self.op(v).attr("reverse") else "BLOCK_R - 1"
                self.body(", ".join(carry) + " = " + ", ".join(
                    f"tl.sum(tl.where(r_base[None, :] == {last}, {n}, 0), axis=1)[:, None]" for n in names))
        return self.finalized_scan(scan, [Val(n, cat) for n in names], cat, self.wide(v))

    def lifted(self, scan: Scan, xs: list[Val], cat: Compute) -> list[Val]:
        """An element's partials from its operands (in the scan's compute type)."""
        xs = [self.em.convert(x, cat) for x in xs]
        if scan.lift is None:
            return xs
        fields = {f"x{i}": self.em.tensor(x).text for i, x in enumerate(xs)}
        return [self.em.assign(p.format(**fields), cat) for p in scan.lift]

    def started(self, scan: Scan, parts: list[Val], cat: Compute, first: str | None = None) -> list[Val]:
        """The partials of the row's first element (where `first` holds; every element when
        None) combined with the state the row starts from (`Scan.start`)."""
        start = [self.identity(s, cat) for s in scan.start]
        texts = [self.em.tensor(p).text for p in parts]
        combined = self.combined(scan, start, texts)
        if first is None:
            return [self.em.assign(c, cat) for c in combined]
        return [self.em.assign(f"tl.where({first}, {c}, {t})", cat)
                for c, t in zip(combined, texts, strict=True)]

    def finalized_scan(self, scan: Scan, parts: list[Val], cat: Compute, wide: bool = False) -> Val:
        narrow = ".to(tl.float32)" if wide else ""
        text = scan.finalize.format(**{f"p{i}": f"{p.text}{narrow}" for i, p in enumerate(parts)})
        return self.em.assign(text, cat)

    @staticmethod
    def packed(parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"

    @staticmethod
    def combined(scan: Scan, left: list[str], right: list[str]) -> list[str]:
        """`scan`'s combination of the partials `left` (the elements before) and `right`."""
        fields = {f"a{i}": a for i, a in enumerate(left)} | {f"b{i}": b for i, b in enumerate(right)}
        return [c.format(**fields) for c in scan.combine]

    def start_scans(self, need: set[int]) -> None:
        """Before a loop over the row: carries that change nothing for every scan the loop
        computes."""
        self.carries = {}
        for v in sorted(need):
            if self.scanned(v):
                scan, cat = ops.OPS[self.op(v).kind].scan, self.reduce_cat(v)
                compute = "tl.float64" if self.wide(v) else TRITON_TYPE[cat]
                names = self.carries[v] = [self.em.fresh("carry") for _ in scan.identity]
                for name, identity in zip(names, scan.identity, strict=True):
                    self.body(f"{name} = tl.full([BLOCK_O, 1], {self.identity(identity, cat)}, {compute})")

    def runs_backward(self, need: set[int]) -> bool:
        """Does a loop computing `need` run from the end of the row (its scans are reverse;
        fuse-rows keeps a row program's scans to one direction)?"""
        return any(self.scanned(v) and self.op(v).attr("reverse") for v in need)

    def masked(self, x: Val, fill: str, mask: str = "tmask") -> str:
        x = self.em.tensor(x)
        name = self.em.fresh("x")
        self.body(f"{name} = tl.where({mask}, {x.text}, {fill})")
        return name

    def reduction(self, v: int) -> Reduction | None:
        """The declaration of a reduction (None: softmax, a scan)."""
        return ops.OPS[self.op(v).kind].reduction

    def reduce_cat(self, v: int) -> Compute:
        """f32 when the operand or the result is a float, else the operand's integer type."""
        x_type = self.region.value_type(self.plan.source(v) if self.is_row_op(v) else self.operands(v)[0])
        if self.op(v).dtype.is_float or x_type.dtype.is_float:
            return F32
        return I64 if x_type.dtype is DType.I64 else I32

    @staticmethod
    def identity(identity: float, cat: Compute) -> str:
        """A declared identity as a literal: an integer's extremes stand for -inf and inf."""
        if not math.isinf(identity):
            return repr(identity) if cat is F32 else str(int(identity))
        if cat is F32:
            return NEG_INF if identity < 0 else 'float("inf")'
        bits = 64 if cat is I64 else 32
        return str(-(2 ** (bits - 1))) if identity < 0 else str(2 ** (bits - 1) - 1)

    def wide(self, v: int) -> bool:
        return ops.in_f64(self.op(v))

    def finalized(self, total: Val, red: Reduction, length: str | None = None, wide: bool = False) -> Val:
        """The result from a row's merged `total` (f64 where `wide`: a mean divides it by
        the row's exact length there, its one rounding to f32 after)."""
        text = total.text
        if red.finalize is not None:
            text = "(" + red.finalize.format(total=text, length=length or self.length) + ")"
        if wide:
            return self.em.assign(f"{text}.to(tl.float32)", total.cat)
        return total if red.finalize is None else self.em.assign(text, F32)

    # --- selections: topk, sort -------------------------------------------------------------
    # A row's element becomes an i64 key that orders as the selection wants and is unique:
    # its value's bits made to order as integers (NaN, made positive, above inf; -0.0 made
    # 0.0) times 2**32, plus its position (largest: 2**32 - 1 - position, so that equal
    # values keep their order in a descending sort). One sort of the keys gives the values
    # and the positions; a row of several chunks keeps the best tile so far and merges each
    # chunk sorted the other way (the larger of each pair of lanes of a descending and an
    # ascending tile are the larger half of both), then sorts the merged tile.

    def select_key(self, v: int) -> tuple:
        op = self.op(v)
        return (self.plan.source(v), op.attr("axis"), op.attr("k"), op.attr("largest"))

    def sentinel(self, v: int) -> str:
        """The key of a lane past the row's end: after every element."""
        return "-9223372036854775807 - 1" if self.op(v).attr("largest") else "9223372036854775807"

    def keys(self, v: int, x: Val) -> str:
        """The keys of the chunk `x` at positions `r`, the sentinel past the row."""
        em = self.em
        t = self.em.tensor(em.convert(x, F32 if x.cat is F32 else I32)).text
        if x.cat is F32:
            canon = em.assign(f'tl.where({t} != {t}, float("nan"), tl.where({t} == 0.0, 0.0, {t}))', F32)
            bits = em.assign(f"{em.tensor(canon).text}.to(tl.int32, bitcast=True).to(tl.int64)", I64).text
            order = em.assign(f"tl.where({bits} >= 0, {bits}, {bits} ^ 0x7FFFFFFF)", I64).text
        else:
            order = em.assign(f"{t}.to(tl.int64)", I64).text
        position = "r[None, :].to(tl.int64)"
        if self.op(v).attr("largest"):
            position = f"(4294967295 - {position})"
        return em.assign(f"tl.where(tmask, {order} * 4294967296 + {position}, "
                         f"{self.sentinel(v)})", I64).text

    def decoded(self, v: int, keys: str) -> Val:
        """The values (topk) or positions (argtopk) of sorted keys."""
        em, op = self.em, self.op(v)
        if op.kind == "argtopk":
            low = f"({keys} & 4294967295)"
            return em.assign(f"4294967295 - {low}" if op.attr("largest") else low, I64)
        order = em.assign(f"{keys} >> 32", I64).text
        if self.region.value_type(self.plan.source(v)).dtype.is_float:
            bits = f"tl.where({order} >= 0, {order}, {order} ^ 0x7FFFFFFF).to(tl.int32)"
            return em.assign(f"{bits}.to(tl.float32, bitcast=True)", F32)
        return em.assign(f"{order}.to(tl.int32)", I32)

    # --- long selections: a row sorted in memory ----------------------------------------------
    # A selection keeping more than SELECT_LIMIT elements of a row (a sort of a 128k
    # vocabulary) sorts the row's keys in the workspace, `2**SORT_LOG` words a row (the row
    # padded with keys after every element), with a bitonic network: each chunk of BLOCK_R
    # keys is sorted in registers as the row's phase loop computes it (up or down, as its
    # place in the network wants), then every merge step of a stride of a chunk or more
    # exchanges the keys of two chunks elementwise, and the strides below a chunk are a sort
    # of each chunk. A program owns one row and reads back what its own threads stored after
    # a barrier. The selected values are then read from the workspace a chunk at a time, and
    # the ops computed from them stored with them.

    def workspace_row(self, v: int) -> str:
        """The pointer to the workspace row of the program's row, for `v`'s keys."""
        name = self.em.fresh("ws")
        w = self.long_keys.index(self.select_key(v))
        self.body(f"{name} = {self.work} + ({w} * {self.rows} + o[:, None]) * (1 << SORT_LOG)")
        return name

    def upward(self, v: int, start: str, size: str) -> str:
        """Does the block of `size` keys holding position `start` sort upward (toward the
        selection's order: descending keys for the largest)?"""
        return f"((({start}) & ({size})) {'!=' if self.op(v).attr('largest') else '=='} 0)"

    def merge_network(self, v: int, ws: str) -> None:
        """Sort the row's keys in the workspace: the chunks past the row hold keys after every
        element, then each stage of a bitonic merge of blocks of 2**level keys."""
        body, sentinel = self.body, self.sentinel(v)
        body(f"for r0 in range(tl.cdiv({self.length}, BLOCK_R) * BLOCK_R, 1 << SORT_LOG, BLOCK_R):")
        with body.indent():
            body(f"tl.store({ws} + r0 + r_base[None, :], tl.full([BLOCK_O, BLOCK_R], {sentinel}, tl.int64), "
                 "mask=omask[:, None])")
        body("tl.debug_barrier()")
        body(f"for level in range({CHUNK_LOG + 1}, SORT_LOG + 1):")
        with body.indent():
            body("size = 1 << level")
            body(f"for step in range(0, level - {CHUNK_LOG}):")
            with body.indent():  # pairs `stride` apart, from the lower half of each block
                body("stride = size >> (step + 1)")
                body("for h in range(0, (1 << SORT_LOG) // 2, BLOCK_R):")
                with body.indent():
                    body("lo = h // stride * (2 * stride) + h % stride")
                    body(f"a = tl.load({ws} + lo + r_base[None, :], mask=omask[:, None], other=0)")
                    body(f"b = tl.load({ws} + lo + stride + r_base[None, :], mask=omask[:, None], other=0)")
                    up = self.upward(v, "lo", "size")
                    body(f"tl.store({ws} + lo + r_base[None, :], tl.where({up}, tl.minimum(a, b), "
                         "tl.maximum(a, b)), mask=omask[:, None])")
                    body(f"tl.store({ws} + lo + stride + r_base[None, :], tl.where({up}, tl.maximum(a, b), "
                         "tl.minimum(a, b)), mask=omask[:, None])")
                body("tl.debug_barrier()")
            body("for c0 in range(0, 1 << SORT_LOG, BLOCK_R):")  # the strides below a chunk
            with body.indent():
                up = self.upward(v, "c0", "size")
                body(f"t = tl.load({ws} + c0 + r_base[None, :], mask=omask[:, None], other=0)")
                body(f"t = tl.sort(tl.where({up}, t, ~t), dim=1)")
                body(f"tl.store({ws} + c0 + r_base[None, :], tl.where({up}, t, ~t), mask=omask[:, None])")
            body("tl.debug_barrier()")

    def emit_long(self, row_vals: dict[int, Val]) -> None:
        """The selected values, read back from the workspace a chunk of lanes at a time, and
        the ops computed from them, stored."""
        body, em = self.body, self.em
        ks = sorted({self.k_of(v) for v in self.long})
        most = ks[0]
        for k in ks[1:]:
            most = f"tl.maximum({most}, {k})"
        body(f"for s0 in range(0, {most}, BLOCK_R):")
        with body.indent():
            body("lanes = s0 + r_base")
            self.lanes = "lanes"
            vals = dict(row_vals)
            for v in self.long:
                ws = self.selections[self.select_key(v)]
                keys = em.assign(f"tl.load({ws} + lanes[None, :], mask={self.chosen_mask(v)}, other=0)",
                                 I64).text
                vals[v] = self.decoded(v, keys)
            self.emit_values(vals, set(self.long_values))
            self.store(vals, full=False, skip=frozenset(v for v in self.region.outputs
                                                         if v not in self.long_values))
            self.lanes = "r_base"

    # --- the program ------------------------------------------------------------------------

    def emit(self) -> None:
        body, sig = self.body, self.sig
        shape = self.plan.shape
        rows = sig.numel(tuple(shape[d] for d in self.kept), "n_rows")
        if self.group > 1:  # each group of rows padded to a power of two
            rows = f"({rows} * {self.group})"
        self.rows = rows
        self.programs = f"tl.cdiv({rows}, BLOCK_O)"  # the grid `emit`'s configure picks
        for name in ("BLOCK_O", "BLOCK_R", "ONE_PASS", "EVEN_O", "EVEN_R"):
            sig.constexpr(name)
        body(PROGRAM_ID)
        # the rows' indices in int32 where every tensor fits it (not WIDE; a number of rows
        # known to the compiler is small): dividing them into the row dims' indices is then
        # an int32 division, not a call of int64's
        if not all(isinstance(shape[d], int) for d in self.kept):
            body(f"if {sig.wide()}:")
            with body.indent():
                body("pid = pid.to(tl.int64)")
        if self.split:
            self.emit_split()
            return
        body("o = pid * BLOCK_O + tl.arange(0, BLOCK_O)")
        # a call whose rows fill every program (`EVEN_O`), and whose row length is a multiple
        # of the block (`EVEN_R`), gets constant masks, which Triton folds away: no selects
        # for the tail, and unmasked loads and stores
        body("if EVEN_O:")
        with body.indent():
            body("omask = tl.full([BLOCK_O], 1, tl.int1)")
        body("else:")
        with body.indent():
            body(f"omask = o < {rows}")
        groups = "o"
        if self.group > 1:
            c = self.plan.across
            body(f"j{c} = o % {self.group}")
            groups = f"(o // {self.group})"
            if shape[c] != self.group:
                body(f"omask = omask & (j{c} < {shape[c]})")
        names = [None if shape[d] == 1 else f"j{d}" for d in self.kept]
        decompose(body, groups, [shape[d] for d in self.kept], names, sig.size, "q")
        body("r_base = tl.arange(0, BLOCK_R)")
        self.emit_rows()

    def emit_rows(self) -> None:
        """The program's rows (`o`, masked by `omask`, their dims' indices `j<dim>`)."""
        body, sig = self.body, self.sig
        body("if ONE_PASS:")
        with body.indent():
            self.emit_one_pass()
        if self.long:
            for name in ("LONG", "SORT_LOG"):
                sig.constexpr(name)
            self.work = sig.workspace()
            body("elif LONG:")
            with body.indent():
                self.emit_phases(long=True)
        body("else:")
        with body.indent():
            self.emit_phases()

    # --- split programs: partials across rows, merged by a combine launch -----------------
    # A split program reduces along a kept dim `across` whose rows no program owns (tokens, a
    # batch): program `chunk` of a group (`grp`, an index of the other kept dims) walks the
    # CHUNK rows of its chunk, BLOCK_O at a time, and merges each block's total into its
    # partial, a row of the workspace (registers when the row is one block, else the
    # workspace row itself, read back after a barrier); the combine launch (`emit_combine`)
    # merges a group's partials in chunk order. CHUNK depends on the sizes only, so every
    # run and every device gives the same bits.

    def emit_split(self) -> None:
        body, sig, shape = self.body, self.sig, self.plan.shape
        size = sig.size(shape[self.plan.across])
        sig.constexpr("CHUNK")
        self.programs = f"{self.rows} * tl.cdiv({size}, CHUNK)"
        body(f"n_chunks = tl.cdiv({size}, CHUNK)")
        body("chunk = pid % n_chunks")
        body("grp = pid // n_chunks")
        body("o_base = tl.arange(0, BLOCK_O)")
        names = [None if shape[d] == 1 else f"j{d}" for d in self.kept]
        decompose(body, "(grp + o_base * 0)", [shape[d] for d in self.kept], names, sig.size, "q")
        body("r_base = tl.arange(0, BLOCK_R)")
        for k, v in enumerate(sorted(self.plan.across_reducing)):
            red, cat = self.reduction(v), self.reduce_cat(v)
            full = self.full(self.operands(v)[0])
            acc = self.em.fresh("part")
            compute = "tl.float64" if self.wide(v) else TRITON_TYPE[cat]
            body(f"{acc} = tl.full([1, {'BLOCK_R' if full else '1'}], {self.identity(red.identity, cat)}, "
                 f"{compute})")
            self.partials[v] = (sig.workspace(k), acc, full)
        body(f"base = (chunk * {self.rows} + grp).to(tl.int64)")  # the chunk's partials
        body("for b0 in range(0, CHUNK, BLOCK_O):")
        with body.indent():
            body("o = chunk * CHUNK + b0 + o_base")
            body(f"omask = o < {size}")
            body(f"j{self.plan.across} = o")
            self.emit_rows()
        for work, acc, full in self.partials.values():
            if full:  # (a longer row merged its partial in the workspace)
                body("if ONE_PASS:")
                with body.indent():
                    body(f"tl.store({work} + base * {self.length} + r_base[None, :], {acc}, "
                         f"mask=(r_base < {self.length})[None, :])")
            else:
                body(f"tl.store({work} + base + tl.zeros([1, 1], tl.int32), {acc})")

    def accumulate_across(self, vals: dict[int, Val], full: bool, memory: bool) -> None:
        """Merge the block's total of each reduction across rows (of a full value, or of one
        per row) into its partial: the accumulator, or (`memory`) the workspace row at the
        chunk `r` of the row, whose first block starts it."""
        em, body = self.em, self.body
        for v, (work, acc, is_full) in self.partials.items():
            if is_full != full:
                continue
            red, cat = self.reduction(v), self.reduce_cat(v)
            x = em.convert(vals[self.operands(v)[0]], cat)
            if self.wide(v):
                x = em.assign(f"{em.tensor(x).text}.to(tl.float64)", F32)
            identity = self.identity(red.identity, cat)
            xm = self.masked(x, identity, "tmask" if full else "omask[:, None]")
            part = em.assign(collapse(em, red, cat, xm, axis=0), cat).text  # [1, BLOCK_R] or [1, 1]
            nan = ", propagate_nan=tl.PropagateNan.ALL" if red.nan and cat is F32 else ""
            if memory:
                ptr, mask, prev = f"{work} + base * {self.length} + r[None, :]", "rmask", em.fresh("prev")
                body(f"{prev} = tl.load({ptr}, mask={mask} & (b0 > 0), other={identity})")
                body(f"tl.store({ptr}, {red.combine.format(a=prev, b=part, nan=nan)}, mask={mask})")
            else:
                body(f"{acc} = {red.combine.format(a=acc, b=part, nan=nan)}")

    def tile_mask(self) -> None:
        """The mask of the tile at positions `r`, and with several row axes, `r` split into
        an index per axis."""
        shape, axes = self.plan.shape, self.plan.axes
        if len(axes) > 1:
            names = [None if shape[a] == 1 else f"k{a}" for a in axes]
            decompose(self.body, "r", [shape[a] for a in axes], names, self.sig.size, "kq")
        self.body("if EVEN_R:")
        with self.body.indent():
            self.body("rmask = tl.full([1, BLOCK_R], 1, tl.int1)")
        self.body("else:")
        with self.body.indent():
            self.body(f"rmask = (r < {self.length})[None, :]")
        self.body("tmask = omask[:, None] & rmask")

    def emit_one_pass(self) -> None:
        """The whole row in one tile: every input read once."""
        self.body("r = r_base")
        self.tile_mask()
        vals: dict[int, Val] = {}
        self.carries = {}  # one chunk: scans need no carry
        self.selections = {}
        for v in self.values:
            self.emit_values(vals, None)
            if self.is_row_op(v) and v not in vals and not self.scanned(v):
                vals[v] = self.one_pass_reduce(v, vals[self.plan.source(v)])
        self.emit_values(vals, None)
        self.store(vals, full=True)
        self.store(vals, full=False)
        if self.split:
            self.accumulate_across(vals, full=True, memory=False)
            self.accumulate_across(vals, full=False, memory=False)

    def one_pass_reduce(self, v: int, x: Val, mask: str = "tmask", positions: str = "r[None, :]",
                        length: str | None = None) -> Val:
        """A reduction (or softmax) of the tile `x` whose lanes `mask` holds, at `positions`
        along a row of `length` (the row's when None)."""
        red, cat, em = self.reduction(v), self.reduce_cat(v), self.em
        if ops.category(self.op(v).kind) is ops.Category.SELECT:
            key = self.select_key(v)
            if key not in self.selections:
                sort = "tl.sort({k}, dim=1, descending=" + str(self.op(v).attr("largest")) + ")"
                self.selections[key] = em.assign(sort.format(k=self.keys(v, x)), I64).text
            return self.decoded(v, self.selections[key])
        x = em.convert(x, cat)
        if red is not None and red.index:
            return self.position(red, cat, self.masked(x, self.identity(red.identity, cat), mask), positions)
        if red is not None and not red.online:
            if self.wide(v):
                x = em.assign(f"{em.tensor(x).text}.to(tl.float64)", F32)
            xm = self.masked(x, self.identity(red.identity, cat), mask)
            total = self.collapse(red, cat, xm)
            return self.finalized(em.assign(total, cat), red, length, self.wide(v))
        # softmax and logsumexp: the online recurrence in one step
        xm = self.masked(x, NEG_INF, mask)
        m = em.assign(f"tl.max({xm}, axis=1)[:, None]", F32)
        ms = em.assign(online.finite(m.text) if red is not None else online.shift(m.text), F32)
        e = em.assign(f"tl.exp({xm} - {ms.text})", F32)
        z = em.assign(f"tl.sum({e.text}, axis=1)[:, None]", F32)
        if red is not None:
            return em.assign(online.logsumexp(ms.text, z.text), F32)
        return em.assign(f"{e.text} * {self.inverse_sum(m.text, z.text)}", F32)

    def collapse(self, red: Reduction, cat: Compute, x: str) -> str:
        """The reduction of tile `x` along the row; float max/min propagate NaN, like torch."""
        return collapse(self.em, red, cat, x)

    def position(self, red: Reduction, cat: Compute, x: str, positions: str) -> Val:
        """argmax/argmin of tile `x` along the row: the first position (from the tile
        `positions`) holding the extremum, a NaN before any number (torch's)."""
        m = self.em.assign(self.collapse(red, cat, x), cat)
        hit = f"({x} == {m.text})" + (f" | ({x} != {x})" if cat is F32 else "")
        return self.em.assign(f"tl.min(tl.where({hit}, {positions}, {_NO_POSITION}), axis=1)"
                              "[:, None].to(tl.int64)", I64)

    def inverse_sum(self, m: str, z: str) -> str:
        """1 / z for softmax: 0 for a row that is all -inf, NaN where torch gives NaN."""
        inv = self.em.assign(online.positive_inverse(z), F32)
        return self.em.assign(f'tl.where({online.nan_row(m, z)}, float("nan"), {inv.text})', F32).text

    def emit_phases(self, long: bool = False) -> None:
        """Rows longer than a block: one loop per reduction phase, then one to write. `long`:
        the long selections sort their rows in the workspace (`emit_long`)."""
        body = self.body
        self.long_mode = long
        row_vals: dict[int, Val] = {}
        self.emit_row_values(row_vals)
        reductions = [v for v in self.values if self.is_row_op(v) and not self.scanned(v)
                      and self.plan.source(v) not in self.plan.selected]
        self.selections = {}
        for p in range(1, max((self.plan.phases[v] for v in reductions), default=0) + 1):
            current = [v for v in reductions if self.plan.phases[v] == p]
            state = {v: self.init_state(v) for v in current}
            need = self.needed([self.plan.source(v) for v in current])
            self.start_scans(need)
            body(f"for r0 in range(0, {self.length}, BLOCK_R):")
            with body.indent():
                self.chunk(need)
                self.tile_mask()
                vals = dict(row_vals)
                self.emit_values(vals, need)
                for v in current:
                    self.accumulate(v, state[v], vals[self.plan.source(v)])
            for v in current:
                self.finalize(v, state[v], row_vals)
            self.emit_row_values(row_vals)
        full_outputs = [v for v in self.region.outputs if self.full(v) and v not in self.plan.tail]
        # the full values a split program's reductions across rows reduce, a chunk at a time
        across = [self.operands(v)[0] for v, (_, _, full) in self.partials.items() if full]
        if full_outputs or across:
            need = self.needed(full_outputs + across)
            self.start_scans(need)
            body(f"for r0 in range(0, {self.length}, BLOCK_R):")
            with body.indent():
                self.chunk(need)
                self.tile_mask()
                vals = dict(row_vals)
                self.emit_values(vals, need)
                self.store(vals, full=True)
                if across:
                    self.accumulate_across(vals, full=True, memory=True)
            if across:  # the next block reads back what this one's threads stored
                body("tl.debug_barrier()")
        self.store(row_vals, full=False, skip=self.long_values if long else frozenset())
        if self.split:
            self.accumulate_across(row_vals, full=False, memory=False)
        if long:
            self.emit_long(row_vals)
        self.long_mode = False

    def emit_row_values(self, row_vals: dict[int, Val]) -> None:
        """Per-row values whose inputs are known: computed once, outside the loops."""
        self.emit_values(row_vals, {v for v in self.values if not self.full(v)
                                    and (not self.is_row_op(v) or in_loop(self.op(v).kind)
                                         or self.plan.source(v) in self.plan.selected)})

    def chunk(self, need: set[int]) -> None:
        """The positions of the loop's chunk r0: from the start of the row, or from its end
        when the loop computes reverse scans (in a long selection's loop, `rc` its first)."""
        start = f"({self.length} - 1) // BLOCK_R * BLOCK_R - r0" if self.runs_backward(need) else "r0"
        if self.long_mode:
            self.body(f"rc = {start}")
            start = "rc"
        self.body(f"r = {start} + r_base")


    def init_state(self, v: int) -> dict[str, str]:
        red, cat = self.reduction(v), self.reduce_cat(v)
        if self.long_mode and v in self.long:
            key = self.select_key(v)
            shared = key in self.selections
            self.selections[key] = self.workspace_row(v)
            return {"long": self.selections[key], **({"shared": "1"} if shared else {})}
        if ops.category(self.op(v).kind) is ops.Category.SELECT:  # topk and argtopk share one
            key = self.select_key(v)
            if key not in self.selections:
                self.selections[key] = self.em.fresh("best")
                best = self.selections[key]
                self.body(f"{best} = tl.full([BLOCK_O, BLOCK_R], {self.sentinel(v)}, tl.int64)")
                return {"best": self.selections[key]}
            return {"best": self.selections[key], "shared": "1"}
        name = self.em.fresh("acc")
        if red is None or red.online:  # softmax, logsumexp
            m, z = online.init(self.body, name)
            return {"m": m, "z": z, "cat": cat}
        compute = "tl.float64" if self.wide(v) else TRITON_TYPE[cat]
        self.body(f"{name} = tl.full([BLOCK_O, BLOCK_R], {self.identity(red.identity, cat)}, {compute})")
        if red.index:  # each lane's position so far: the first, until a later one wins
            self.body(f"{name}_i = tl.zeros([BLOCK_O, BLOCK_R], tl.int32) + r_base[None, :]")
        return {"acc": name, "cat": cat}

    def accumulate(self, v: int, state: dict[str, str], x: Val) -> None:
        red, body = self.reduction(v), self.body
        if "long" in state:
            if "shared" not in state:  # the chunk sorted the way its place in the network wants
                keys = self.em.assign(self.keys(v, x), I64).text
                up = self.upward(v, "rc", "BLOCK_R")
                body(f"{state['long']}_c = tl.where({up}, {keys}, ~{keys})")
                body(f"{state['long']}_c = tl.sort({state['long']}_c, dim=1)")
                body(f"tl.store({state['long']} + r[None, :], tl.where({up}, {state['long']}_c, "
                     f"~{state['long']}_c), mask=omask[:, None])")
            return
        if "best" in state:
            if "shared" not in state:
                best, largest = state["best"], self.op(v).attr("largest")
                chunk = self.em.assign(f"tl.sort({self.keys(v, x)}, dim=1, descending={not largest})", I64)
                merged = f"tl.{'maximum' if largest else 'minimum'}({best}, {chunk.text})"
                body(f"{best} = tl.sort({merged}, dim=1, descending={largest})")
            return
        x = self.em.convert(x, state["cat"])
        if red is None or red.online:
            online.update(body, state["m"], state["z"], self.masked(x, NEG_INF))
            return
        if self.wide(v):
            x = self.em.assign(f"{self.em.tensor(x).text}.to(tl.float64)", F32)
        xm = self.masked(x, self.identity(red.identity, state["cat"]))
        acc = state["acc"]
        nan = ", propagate_nan=tl.PropagateNan.ALL" if red.nan and state["cat"] is F32 else ""
        combined = red.combine.format(a=acc, b=xm, nan=nan)
        if red.index:  # a lane moves to this position where the value changed; a NaN stays
            new = self.em.fresh("x")
            body(f"{new} = {combined}")
            body(f"{acc}_i = tl.where(({new} != {acc}) & ({acc} == {acc}), r[None, :], {acc}_i)")
            combined = new
        body(f"{acc} = {combined}")

    def finalize(self, v: int, state: dict[str, str], row_vals: dict[int, Val]) -> None:
        red, em = self.reduction(v), self.em
        if "long" in state:
            if "shared" not in state:
                self.merge_network(v, state["long"])
            return
        if "best" in state:
            row_vals[v] = self.decoded(v, state["best"])
        elif red is None:  # softmax, a full value: later loops compute exp(x - m) / z from these
            m, z = state["m"], state["z"]
            ms = em.assign(online.shift(m), F32)
            self.softmax_stats[v] = (ms.text, self.inverse_sum(m, z))
        elif red.online:
            ms = em.assign(online.finite(state["m"]), F32)
            row_vals[v] = em.assign(online.logsumexp(ms.text, state["z"]), F32)
        elif red.index:
            row_vals[v] = self.position(red, state["cat"], state["acc"], f"{state['acc']}_i")
        else:
            total = em.assign(self.collapse(red, state["cat"], state["acc"]), state["cat"])
            row_vals[v] = self.finalized(total, red, wide=self.wide(v))

    def store(self, vals: dict[int, Val], full: bool, skip: frozenset[int] = frozenset()) -> None:
        for j, v in enumerate(self.region.outputs):
            if self.full(v) != full or v in skip or v in self.plan.tail:
                continue
            ptr, mask = self.access(self.outs[j], v)
            if ptr is None:  # a single element (no kept dims): row 0 writes it
                ptr = f"{self.outs[j].ptr} + o[:, None] * 0"
            if not full and v not in self.plan.selected:
                mask = "omask[:, None]"
            if self.plan.across is not None and self.plan.across not in self.layouts[v]:  # one row stores
                c = self.plan.across
                mask = f"{mask or 'omask[:, None]'} & (j{c} == 0)[:, None]"
                if "[:, None]" not in ptr:  # a pointer of no row's (the value varies along the row only)
                    ptr = f"{ptr} + j{c}[:, None] * 0"
            text = self.em.store_value(vals[v], self.region.value_type(v))
            self.body(f"tl.store({ptr}, {text}, mask={mask})")


# the chunk a longer row streams through a topk in, and a long selection sorts in memory
SELECT_CHUNK = 1 << 12
CHUNK_LOG = 12


# the block a one-phase row program writing one value per row walks its row in (`one_pass_limit`)
ROW_WALK = 1 << 13


def one_pass_limit(plan: RowPlan, region) -> int:
    """The longest row a CUDA program holds in registers (read once), by what the build that
    really runs shows (`tiledsl ptx`, sm_90): 32k elements with 16 warps and no spills, but
    16k of 32-bit inputs summed in f64 or of two (an f32 RMSNorm at 32k spills 128 bytes,
    a softmax of x + bias 384; an f32 softmax, online in f32, none), halved per further
    dependent reduction (each keeps another row-sized value live: layernorm's centred
    row), and 32k words of a scan's
    partials (a linear_scan's two f32 ones: 16k elements). Longer rows loop, reading the
    row once per phase with online softmax and logsumexp. A program of one phase writing
    nothing along the row (every output one per row: a loss, a norm) reads its row once
    either way and loops at `ROW_WALK`: a cross-entropy of a 32k vocabulary in one pass
    spilled 568 bytes (Triton 3.9's ptxas options), walking 8k elements none, at fewer
    instructions per element."""
    n_in = len(region.inputs)
    words = sum(inp.type.dtype.itemsize >= 4 for i, inp in enumerate(region.inputs) if plan.full(i))
    wide = words > 1 or words == 1 and any(ops.in_f64(region.ops[v - n_in].op) for v in plan.reducing)
    phases = max(plan.phases, default=0)
    limit = (1 << 14 if wide else 1 << 15) >> max(0, phases - 1)
    if phases <= 1 and not any(plan.full(v) for v in region.outputs):
        limit = min(limit, ROW_WALK)
    # (a power of two: the block is one)
    return min([limit] + [1 << ((1 << 15) // words).bit_length() - 1 for words in scan_words(plan, region)])


def scan_words(plan: RowPlan, region) -> list[int]:
    """The 32-bit words of partials each scan of a row program holds per element, and one
    more where its combine computes an exponential (logcumsumexp's rescaling: at 16k f32
    elements, two words, it spilled 40 bytes under Triton 3.9's ptxas options)."""
    n_in = len(region.inputs)
    out = []
    for v in plan.reducing:
        op = region.ops[v - n_in].op
        scan = ops.OPS[op.kind].scan
        if scan is not None:
            out.append(len(scan.identity) * (2 if scan.wide and op.dtype is DType.F32 else 1)
                       + any("exp" in c for c in scan.combine))
    return out


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The row program (no dots: `allow_tf32` changes nothing)."""
    prog = RowProgram(kernel)
    prog.emit()
    shape, axes = prog.plan.shape, prog.plan.axes
    limit = one_pass_limit(prog.plan, kernel.region)
    group = prog.group
    scans = bool(scan_words(prog.plan, kernel.region))
    selections = [prog.op(v) for v in sorted(prog.plan.reducing)
                  if ops.category(prog.op(v).kind) is ops.Category.SELECT]

    across_no_identity = [prog.op(v) for v in sorted(prog.plan.across_reducing) if prog.split
                          and not ops.OPS[prog.op(v).kind].reduction.empty]
    no_identity = [prog.op(v) for v in sorted(prog.plan.reducing)
                   if (r := ops.OPS[prog.op(v).kind].reduction) is not None and not r.empty]
    # sin, cos and tan are computed in f64, whose libdevice forms call a slow path (a large
    # argument's reduction) across which the GPU spills every live value of the tile
    trig = any(o.op.kind in ("sin", "cos", "tan") for o in kernel.region.ops)
    split_rows = any(full for _, _, full in prog.partials.values())

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        length = numel([shape[a] for a in axes], dims)
        if length == 0 and no_identity:
            op, empty = no_identity[0], next(a for a in axes if evaluate(shape[a], dims) == 0)
            raise EmptyReductionError(op.span, kind=op.kind, axis=f"{shape[empty]} = 0")
        if across_no_identity and evaluate(shape[prog.plan.across], dims) == 0:  # (split: no rows)
            op = across_no_identity[0]
            raise EmptyReductionError(op.span, kind=op.kind, axis=f"{shape[prog.plan.across]} = 0")
        rows = numel([d for i, d in enumerate(shape) if i not in axes and i != prog.plan.across], dims)
        caps = CAPS[device]
        block_r = max(2, min(next_pow2(length), limit if device == "cuda" else caps["row"]))
        if trig and device == "cuda":  # a long row chunked too, at 8 elements a thread (below)
            block_r = min(block_r, caps["flat"])
        if split_rows and device == "cuda":  # a row-sized partial stays live beside the row
            block_r = min(block_r, SPLIT_ONE_PASS)
            if length > block_r:  # each chunk's partials merged in memory
                block_r = min(block_r, SPLIT_ROW_CHUNK)
        if scans and length > block_r and device == "cuda":
            block_r //= 2  # a loop's carries and chunk totals keep more live (280 bytes spilled)
        long = selections and long_at(dims)
        if long:  # the row sorted in the workspace, a chunk of it in registers at a time
            block_r = SELECT_CHUNK
        elif selections:  # a chunk holds a selection's k
            keep = max(evaluate(op.shape[op.attr("axis")], dims) for op in selections)
            if length > block_r and device == "cuda":
                block_r = min(block_r, SELECT_CHUNK)  # a streamed chunk is sorted twice: 4k spill nothing
            block_r = max(block_r, next_pow2(keep))
        # short rows: several per program, up to a tile of `caps["tile"]` elements, or of a
        # pointwise program's (`caps["flat"]`, 8 elements a thread) on a GPU where it computes
        # trig: QK-norm with RoPE at D = 128 spills 87 KB a thread with 32, none with 8
        tile = caps["flat"] if trig and device == "cuda" else caps["tile"]
        if group > 1:  # a program owns whole groups of rows, and a chunk of the row fits beside
            # them in half a tile: the totals given back to the rows (a reshape through shared
            # memory) keep a second tile live (Mamba's scan at 16 x 256: 120 bytes spilled)
            tile //= 2
            block_r = max(2, min(block_r, tile // group))
            rows *= group
        across = evaluate(shape[prog.plan.across], dims) if prog.split else 0
        # a split program's block holds rows along `across` only
        block_o = group if long else max(group, min(next_pow2(across if prog.split else rows),
                                                    tile // block_r))
        # about 32 elements per thread: 4 warps up to 4k elements, 16 from 16k
        warps = max(4, min(16, block_r * block_o // 1024))
        if long:  # i64 keys and a sort's exchanges: 4 warps spill 104 bytes, 8 none
            warps = max(warps, 8)
        constexprs = {"BLOCK_O": block_o, "BLOCK_R": block_r, "ONE_PASS": length <= block_r,
                      "EVEN_O": rows > 0 and rows % block_o == 0,
                      # a row of 32k in registers keeps its masks: unmasked, ptxas schedules
                      # its loads so that an f16 RMSNorm spills 104 bytes (none masked)
                      "EVEN_R": length > 0 and length % block_r == 0 and block_r < 1 << 15}
        if prog.long:
            constexprs |= {"LONG": bool(long), "SORT_LOG": sort_log(length) if long else 0}
        if prog.split:
            chunk = split_chunk(across, block_o, rows)
            constexprs |= {"CHUNK": chunk, "EVEN_O": False}
            return LaunchConfig((rows * cdiv(across, chunk),), constexprs, num_warps=warps)
        return LaunchConfig((cdiv(rows, block_o),), constexprs, num_warps=warps)

    def long_at(dims: Mapping[str, int]) -> bool:
        """Do this call's selections keep more than a tile holds? (Refused where a reduction
        reads what they selected: it would need the selected values in registers.)"""
        keeps = {v: evaluate(prog.op(v).shape[prog.op(v).attr("axis")], dims) for v in prog.long}
        if not any(k > SELECT_LIMIT for k in keeps.values()):
            return False
        for v in sorted(prog.plan.reducing):
            if prog.plan.source(v) in prog.long_values:
                op = prog.op(v)
                raise LimitError(op.span, what=f"a {op.kind} of more than {SELECT_LIMIT} elements a topk "
                                 f"or sort selected ({max(keeps.values())} at this call)",
                                 limit=f"{SELECT_LIMIT} (a reduction of selected elements reads them in "
                                       "registers)")
        return True

    def workspace(dims: Mapping[str, int], target: str) -> tuple[tuple[int, str], ...]:
        """The long selections' sorted rows (int64 words: one row of 2**SORT_LOG keys per row
        and selection), or a split program's partials (one per chunk, group and position
        along the row, or one per chunk and group where the reduced value is one per row)."""
        rows = numel([d for i, d in enumerate(shape) if i not in axes and i != prog.plan.across], dims)
        length = numel([shape[a] for a in axes], dims)
        if prog.split:
            chunk = configure(dims, target).constexprs["CHUNK"]
            chunks = cdiv(evaluate(shape[prog.plan.across], dims), chunk)
            return tuple((chunks * rows * (length if prog.full(prog.operands(v)[0]) else 1),
                          "float64" if prog.wide(v) else TRITON_TYPE[prog.reduce_cat(v)].removeprefix("tl."))
                         for v in sorted(prog.plan.across_reducing))
        if not long_at(dims):
            return ((0, "int64"),)
        return ((len(prog.long_keys) * rows * group * (1 << sort_log(length)), "int64"),)

    then = (emit_combine(prog, kernel, configure),) if prog.split else ()
    return finish(kernel, prog.sig, prog.body, configure, prog.em, programs=prog.programs,
                  workspace=workspace if prog.long or prog.split else None, then=then)


# the chunk of a long row whose partials across rows a split program merges in its
# workspace: 16k (16 warps) spill 1 KB a thread in an f32 RMSNorm backward at N = 32k; and
# the longest row it holds in one pass beside its row-sized partial (a bf16 one at 32k
# spills 5.8 KB)
SPLIT_ROW_CHUNK = 4096
SPLIT_ONE_PASS = 8192

# the programs a split row program's chunks aim for: two per SM of a 132-SM H100, a number
# of the sizes only (never of the device), so that every device merges the same partials
SPLIT_PROGRAMS = 264


def split_chunk(rows: int, block_o: int, groups: int) -> int:
    """The rows along `across` of a split program's chunk: whole blocks, as many as leave
    `SPLIT_PROGRAMS` programs over all groups (at least one block)."""
    blocks = cdiv(rows, block_o)
    chunks = max(1, cdiv(SPLIT_PROGRAMS, max(groups, 1)))
    return next_pow2(max(1, cdiv(blocks, chunks))) * block_o


def sort_log(length: int) -> int:
    """log2 of a row's workspace words: the row padded to a power of two."""
    return max(CHUNK_LOG + 1, (next_pow2(length) - 1).bit_length())


def collapse(em: Emitter, red: Reduction, cat: Compute, x: str, axis: int = 1) -> str:
    """The reduction of tile `x` along its `axis` (1: the row; 0: the rows), kept ([n, 1] or
    [1, n]); float max/min propagate NaN, like torch."""
    keep = "[:, None]" if axis == 1 else "[None, :]"
    total = red.collapse.format(x=x, axis=axis) + keep
    if red.helper is not None:
        em.helpers.add(red.helper)
    if not red.nan or cat is not F32:
        return total
    nan = f"tl.max(({x} != {x}).to(tl.int32), axis={axis}){keep} > 0"
    return f'tl.where({nan}, float("nan"), {total})'
