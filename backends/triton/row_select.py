"""Selections along a row program's row (topk and argtopk; sort and argsort are those of
the whole row), as the `Selections` part of `rows.RowProgram`.

A row's element becomes an i64 key that orders as the selection wants and is unique:
its value's bits made to order as integers (NaN, made positive, above inf; -0.0 made
0.0) times 2**32, plus its position (largest: 2**32 - 1 - position, so that equal
values keep their order in a descending sort). One sort of the keys gives the values
and the positions; a row of several chunks keeps the best tile so far and merges each
chunk sorted the other way (the larger of each pair of lanes of a descending and an
ascending tile are the larger half of both), then sorts the merged tile.

Long selections: a row sorted in memory. A selection keeping more than SELECT_LIMIT
elements of a row (a sort of a 128k vocabulary) sorts the row's keys in the workspace,
`2**SORT_LOG` words a row (the row padded with keys after every element), with a bitonic
network: each chunk of BLOCK_R keys is sorted in registers as the row's phase loop
computes it (up or down, as its place in the network wants), then every merge step of a
stride of a chunk or more exchanges the keys of two chunks elementwise, and the strides
below a chunk are a sort of each chunk. A program owns one row and reads back what its own
threads stored after a barrier. The selected values are then read from the workspace a
chunk at a time, and the ops computed from them stored with them.
"""

from __future__ import annotations

from tiledsl import ops

from .codegen import next_pow2
from .expr import Val
from .row_reduce import F32, I32, I64

# the chunk a longer row streams through a topk in, and a long selection sorts in memory
SELECT_CHUNK = 1 << 12
CHUNK_LOG = 12


class Selections:
    """Selections (a mixin of `rows.RowProgram`, whose plan and emitter it uses)."""

    def chosen_mask(self, v: int) -> str:
        """The lanes of a selection's tile that hold one of its k elements."""
        return f"omask[:, None] & ({self.lanes} < {self.k_of(v)})[None, :]"

    def k_of(self, v: int) -> str:
        """How many elements the selection `v` (or the one an op of a selection reads) holds."""
        stack, seen = [v], set()
        while stack:  # (through the selected values it reads; positions alone select none)
            v = stack.pop()
            op = self.op(v)
            if op is not None and ops.category(op.kind) is ops.Category.SELECT:
                return self.sig.size(op.shape[op.attr("axis")])
            seen.add(v)
            stack.extend(o for o in self.operands(v) if o in self.plan.selected and o not in seen)
        raise AssertionError("a selected value reads a selection")

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
        self.start_scans(set(self.long_values))  # (scans of the selected values, carried)
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


def sort_log(length: int) -> int:
    """log2 of a row's workspace words: the row padded to a power of two."""
    return max(CHUNK_LOG + 1, (next_pow2(length) - 1).bit_length())
