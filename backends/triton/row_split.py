"""Reductions across a row program's rows (along the plan's `across` dim), as the `Split`
part of `rows.RowProgram`.

Along a short `across` dim a program owns whole groups of rows, and a reduction across
them is one over a group of the tile's rows (`across_reduce`). A split program
(`RowPlan.split`) reduces along a kept dim `across` whose rows no program owns (tokens,
a batch): program `chunk` of a group (`grp`, an index of the other kept dims)
walks the CHUNK rows of its chunk, BLOCK_O at a time. A reduction of one value per row (a
loss, a norm) stores each block's total in the workspace, a word per (block, group); one
of a value along the row (a weight gradient's column sums) merges each block's total into
its chunk's partial, a row of the workspace (registers when the row is one block, else the
workspace row itself, read back after a barrier). The combine launch (`emit_combine`,
combine.py) merges a group's partials in block or chunk order. Blocks and chunks depend on
the sizes only, so every run and every device gives the same bits; a reduction of one
value per row gives them at every CHUNK too (its blocks do not change with the split).
"""

from __future__ import annotations

from .base import cdiv, decompose
from .codegen import next_pow2
from .expr import TRITON_TYPE, Val
from .row_reduce import F32, collapse

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


class Split:
    """Reductions across rows (a mixin of `rows.RowProgram`, whose plan and emitter it uses)."""

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
            acc = self.em.fresh("part") if full else None  # (one per row: each block's stored)
            compute = "tl.float64" if self.wide(v) else TRITON_TYPE[cat]
            if full:
                body(f"{acc} = tl.full([1, BLOCK_R], {self.identity(red.identity, cat)}, {compute})")
            self.partials[v] = (sig.workspace(k), acc, full)
        body(f"base = (chunk * {self.rows} + grp).to(tl.int64)")  # the chunk's partials
        hoisted = self.row_invariant()
        if hoisted:  # read once for the chunk's rows where a row is one tile (a norm's weight)
            body("if ONE_PASS:")
            with body.indent():
                body("r = r_base")
                self.row_mask()
                self.hoisted = {i: self.load(i) for i in hoisted}
        body("for b0 in range(0, CHUNK, BLOCK_O):")
        with body.indent():
            body("o = chunk * CHUNK + b0 + o_base")
            body(f"omask = o < {size}")
            body(f"j{self.plan.across} = o")
            if not all(full for _, _, full in self.partials.values()):
                # the block's own partials (of values one per row), past the last row none
                body("blk = (chunk * CHUNK + b0) // BLOCK_O")
                body(f"block_at = (blk * {self.rows} + grp).to(tl.int64)")
                body(f"block_live = blk * BLOCK_O + tl.zeros([1, 1], tl.int32) < {size}")
            self.emit_rows()
        for work, acc, full in self.partials.values():
            if full:  # (a longer row merged its partial in the workspace)
                body("if ONE_PASS:")
                with body.indent():
                    body(f"tl.store({work} + base * {self.length} + r_base[None, :], {acc}, "
                         f"mask=(r_base < {self.length})[None, :])")

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
            if not full:  # each block's total, where the combine merges them in block order
                body(f"tl.store({work} + block_at + tl.zeros([1, 1], tl.int32), {part}, mask=block_live)")
            elif memory:
                ptr, mask, prev = f"{work} + base * {self.length} + r[None, :]", "rmask", em.fresh("prev")
                body(f"{prev} = tl.load({ptr}, mask={mask} & (b0 > 0), other={identity})")
                body(f"tl.store({ptr}, {red.combine.format(a=prev, b=part, nan=nan)}, mask={mask})")
            else:
                body(f"{acc} = {red.combine.format(a=acc, b=part, nan=nan)}")
