"""Reductions along a row program's row, driven by the op registry, as the `Reductions`
part of `rows.RowProgram`.

A reduction is computed as its `Reduction` declaration (tiledsl/ops) says: sum, max,
prod... accumulate in a tile of partials merged by `combine`, then `collapse`d and
`finalize`d; argmax/argmin also keep each lane's position; softmax and logsumexp run the
online recurrence (`online.py`); a softmax value is then exp(x - m) / z wherever a loop
needs it. A row held in one tile is reduced at once (`one_pass_reduce`); a longer one
keeps a state per reduction through its phase's loop (`init_state`, `accumulate`,
`finalize`, a selection's among them: row_select.py).

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

from tiledsl import ops
from tiledsl.ir import Op
from tiledsl.ops import Reduction
from tiledsl.types import Compute, DType

from . import online
from .expr import TRITON_TYPE, Emitter, Val
from .online import NEG_INF
from .renderings import REDUCTIONS, Reducing

F32, I32, I64 = Compute.F32, Compute.I32, Compute.I64

# argmax/argmin: a position larger than any in a row (positions are i32 in the kernel)
_NO_POSITION = str(2**31 - 1)


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


class Reductions:
    """Reductions (a mixin of `rows.RowProgram`, whose plan and emitter it uses)."""

    def masked(self, x: Val, fill: str, mask: str = "tmask") -> str:
        x = self.em.tensor(x)
        name = self.em.fresh("x")
        self.body(f"{name} = tl.where({mask}, {x.text}, {fill})")
        return name

    def reduction(self, v: int) -> Reducing | None:
        """A reduction as Triton computes it (None: softmax, a scan)."""
        return REDUCTIONS.get(self.op(v).kind)

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
