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
  and a last loop writes the full outputs. rmsnorm reads a row twice, layernorm three
  times, softmax twice.

This module holds the program's frame: `RowProgram` (what a loop computes, the values
of a tile, the one-pass program and the phase loops) and `emit` (its launch: block sizes
and workspace). Each other concern is a mixin of `RowProgram`, in a module of its own:

- row_layout.py: addressing (each dim's index, a tensor's pointer and mask at the tile,
  loads and stores);
- row_reduce.py: reductions as their `Reduction` declarations say (sum, argmax,
  logsumexp, softmax...), their special values, f32 sums accumulated in f64;
- row_scans.py: scans along the row, carried from chunk to chunk;
- row_select.py: selections (topk, sort), long ones sorted in the workspace;
- row_split.py: reductions across rows: within a group of a tile's rows, or split among
  programs and merged by a combine launch (combine.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl import ops
from tiledsl.diagnostics import EmptyReductionError
from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp, Op
from tiledsl.plans import SELECT_LIMIT, RowPlan, sorts_whole_row
from tiledsl.types import compute_type

from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, TensorRef, next_pow2
from .combine import emit_combine
from .expr import TRITON_TYPE, Emitter, Val, literal
from .renderings import SCANS
from .row_layout import Layout
from .row_reduce import F32, Reductions
from .row_scans import Scans, in_loop, scan_words
from .row_select import SELECT_CHUNK, Selections, sort_log
from .row_split import SPLIT_ONE_PASS, SPLIT_ROW_CHUNK, Split, split_chunk

# a row program loading, gathering and storing this many tile-sized values at each element is
# chunked like one computing trig (below): QK-norm with RoPE's backward, whose norm programs
# read the rotated gradient at both halves, 13 of them, spilled 48 bytes at a [32, 128] tile
# and 6.4 KB at 4096 elements of a long row, nothing at 1024; norms and softmaxes have 2 to 6
HEAVY_STREAMS = 10


class RowProgram(Layout, Reductions, Scans, Selections, Split):
    """A row program being emitted: its region and plan, signature and body, and the state
    its loops share, which the mixins' methods read through `self`."""

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
        # inputs a split program reads before its loop over rows (`row_invariant`), and those
        # the values being emitted read from there instead of loading them
        self.hoisted: dict[int, Val] = {}
        self.reused: dict[int, Val] = {}
        self.softmax_stats: dict[int, tuple[str, str]] = {}  # softmax value -> (m, 1/z) names
        self.carries: dict[int, list[str]] = {}  # scan value -> its partials of the chunks before
        # a selection's (source, attributes) -> its sorted keys (one sort for topk and argtopk)
        self.selections: dict[tuple, str] = {}
        # selections whose k may pass SELECT_LIMIT, the values computed from them, and the
        # workspace rows of each selection's keys (`emit_long`)
        self.long = self.plan.long_selections(region)
        # (and the values of positions a selected value reads: the j-th element's is j)
        self.long_values = self.reading(set(self.long) | {v for v in self.plan.selected
                                                          if self.op(v).kind == "index"})
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

    # --- the values of a tile --------------------------------------------------------------

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
                selected = v in self.plan.selected
                expr = self.index(self.layouts[v][axis], selected) if op.shape[axis] != 1 else None
                vals[v] = em.index(expr)
            elif op.kind == "put" or ops.category(op.kind) is ops.Category.LAYOUT:
                # a put is stored at its positions (`store`); a view is its source's tile (its
                # layout names the same space dims: a transpose, size-1 dims)
                if self.operands(v)[0] in vals:
                    vals[v] = vals[self.operands(v)[0]]
            elif op.kind == "softmax" and self.is_row_op(v):
                (x,) = self.operands(v)
                if v in self.softmax_stats and x in vals:
                    ms, inv = self.softmax_stats[v]
                    xt = em.tensor(em.convert(vals[x], F32))
                    vals[v] = em.assign(f"tl.exp({xt.text} - {ms}) * {inv}", F32)
                elif x in self.plan.selected and x in vals:  # (of a selection in registers)
                    vals[v] = self.one_pass_reduce(v, vals[x], self.chosen_mask(x), "r_base[None, :]",
                                                   self.k_of(x))
            elif self.scanned(v):
                if all(x in vals for x in self.operands(v)):
                    vals[v] = self.scan(v, [vals[x] for x in self.operands(v)])
            elif op.kind in SCANS and not self.is_row_op(v):
                scan = SCANS[op.kind]
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

    def emit_one_pass(self) -> None:
        """The whole row in one tile: every input read once (the row-invariant ones of a split
        program once a chunk of rows, before its loop: `hoisted`)."""
        self.body("r = r_base")
        self.tile_mask()
        self.reused = self.hoisted
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
        self.reused = {}

    def emit_phases(self, long: bool = False) -> None:
        """Rows longer than a block: one loop per reduction phase, then one to write. `long`:
        the long selections sort their rows in the workspace (`emit_long`)."""
        body = self.body
        self.long_mode = long
        self.softmax_stats = {}
        row_vals: dict[int, Val] = {}
        self.emit_row_values(row_vals)
        reductions = [v for v in self.values if self.is_row_op(v) and not self.scanned(v)
                      and self.reduced(v) not in self.plan.selected]
        self.selections = {}
        for p in range(1, max((self.plan.phases[v] for v in reductions), default=0) + 1):
            current = [v for v in reductions if self.plan.phases[v] == p]
            state = {v: self.init_state(v) for v in current}
            need = self.needed([self.reduced(v) for v in current])
            self.start_scans(need)
            body(f"for r0 in range(0, {self.length}, BLOCK_R):")
            with body.indent():
                self.chunk(need)
                self.tile_mask()
                vals = dict(row_vals)
                self.emit_values(vals, need)
                for v in current:
                    self.accumulate(v, state[v], vals[self.reduced(v)])
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
        """Per-row values whose inputs are known: computed once, outside the loops (a long
        selection's values in its own loop, `emit_long`)."""
        self.emit_values(row_vals, {v for v in self.values if not self.full(v)
                                    and (not self.is_row_op(v) or in_loop(self.op(v).kind)
                                         or self.plan.source(v) in self.plan.selected)
                                    and not (self.long_mode and v in self.long_values)})

    def reduced(self, v: int) -> int:
        """The value a reduction's loop reduces: its source, but for a softmax of a long sort's
        values (a permutation of the row), the row itself, whose statistics they share; the
        sorted values are then scaled by them as `emit_long` reads them back."""
        source = self.plan.source(v)
        if self.long_mode and self.op(v).kind == "softmax" and source in self.long \
                and sorts_whole_row(self.region, source):
            return self.plan.source(source)
        return source

    def chunk(self, need: set[int]) -> None:
        """The positions of the loop's chunk r0: from the start of the row, or from its end
        when the loop computes reverse scans (in a long selection's loop, `rc` its first)."""
        start = f"({self.length} - 1) // BLOCK_R * BLOCK_R - r0" if self.runs_backward(need) else "r0"
        if self.long_mode:
            self.body(f"rc = {start}")
            start = "rc"
        self.body(f"r = {start} + r_base")


# the block a one-phase row program writing one value per row walks its row in (`one_pass_limit`)
ROW_WALK = 1 << 13


# the rows along `across` a split program's block of scanned rows holds, at most, with its
# row-sized partials: Mamba's 16 states
SPLIT_SCAN_ROWS = 16


def tile_streams(plan: RowPlan, region) -> int:
    """How many tile-sized values a row program loads, gathers or stores at each element:
    each is a tile live in registers at once."""
    n_in = len(region.inputs)
    loads = sum(plan.full(i) for i in range(n_in))
    gathers = sum(rop.op.kind == "take" and plan.full(n_in + k) for k, rop in enumerate(region.ops))
    return loads + gathers + sum(plan.full(v) for v in region.outputs)


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


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The row program (no dots: `allow_tf32` changes nothing)."""
    prog = RowProgram(kernel)
    prog.emit()
    shape, axes = prog.plan.shape, prog.plan.axes
    limit = one_pass_limit(prog.plan, kernel.region)
    group = prog.group
    words = sum(scan_words(prog.plan, kernel.region))  # the scans' partials, per element
    scans = bool(words)
    selections = [prog.op(v) for v in sorted(prog.plan.reducing)
                  if ops.category(prog.op(v).kind) is ops.Category.SELECT]

    across_no_identity = [prog.op(v) for v in sorted(prog.plan.across_reducing) if prog.split
                          and not ops.OPS[prog.op(v).kind].reduction.empty]
    no_identity = [prog.op(v) for v in sorted(prog.plan.reducing)
                   if (r := ops.OPS[prog.op(v).kind].reduction) is not None and not r.empty]
    # ops of SLOW_PATH_UNITS: tan computes in f64 through libdevice, whose large-argument
    # reduction is a slow path across which the GPU spills every live value of the tile (sin
    # and cos are still counted so, though their f64 reduction calls none now); many
    # tile-sized values keep as many live (`HEAVY_STREAMS`)
    heavy = any(ops.units(o.op.kind) >= ops.SLOW_PATH_UNITS for o in kernel.region.ops) \
        or tile_streams(prog.plan, kernel.region) >= HEAVY_STREAMS
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
        if heavy and device == "cuda":  # a long row chunked too, at 8 elements a thread (below)
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
        tile = caps["flat"] if heavy and device == "cuda" else caps["tile"]
        if group > 1:  # a program owns whole groups of rows, and a chunk of the row fits beside
            # them in half a tile: the totals given back to the rows (a reshape through shared
            # memory) keep a second tile live (Mamba's scan at 16 x 256: 120 bytes spilled)
            tile //= 2
            block_r = max(2, min(block_r, tile // group))
            rows *= group
        across = evaluate(shape[prog.plan.across], dims) if prog.split else 0
        if split_rows and scans and device == "cuda":  # as a group's (above): the block's rows
            # summed into its row-sized partial keep a second tile live beside the scans' carries,
            # and a tile per two words of the scans' partials (a [2, 2048] block of Mamba's states,
            # N split, spilled 1.2 KB, [16, 128] nothing; mamba-tiny's two f64 cumsums at [16, 128]
            # spilled 160 bytes, [16, 64] nothing)
            tile //= 2 * max(1, words // 2)
            block_r = max(2, min(block_r, tile // min(next_pow2(across), SPLIT_SCAN_ROWS)))
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
        """Do this call's selections keep more than a tile holds? (fuse-rows admits no
        reduction of the values of one that may: `legality._reduces_long_selection`.)"""
        return any(evaluate(prog.op(v).shape[prog.op(v).attr("axis")], dims) > SELECT_LIMIT
                   for v in prog.long)

    def workspace(dims: Mapping[str, int], target: str) -> tuple[tuple[int, str], ...]:
        """The long selections' sorted rows (int64 words: one row of 2**SORT_LOG keys per row
        and selection), or a split program's partials (one per chunk, group and position
        along the row, or one per block of BLOCK_O rows and group where the reduced value is
        one per row)."""
        rows = numel([d for i, d in enumerate(shape) if i not in axes and i != prog.plan.across], dims)
        length = numel([shape[a] for a in axes], dims)
        if prog.split:
            cfg = configure(dims, target).constexprs
            across = evaluate(shape[prog.plan.across], dims)
            chunks, blocks = cdiv(across, cfg["CHUNK"]), cdiv(across, cfg["BLOCK_O"])
            return tuple((chunks * rows * length if prog.full(prog.operands(v)[0]) else blocks * rows,
                          "float64" if prog.wide(v) else TRITON_TYPE[prog.reduce_cat(v)].removeprefix("tl."))
                         for v in sorted(prog.plan.across_reducing))
        if not long_at(dims):
            return ((0, "int64"),)
        return ((len(prog.long_keys) * rows * group * (1 << sort_log(length)), "int64"),)

    then = (emit_combine(prog, kernel, configure),) if prog.split else ()
    return finish(kernel, prog.sig, prog.body, configure, prog.em, programs=prog.programs,
                  workspace=workspace if prog.long or prog.split else None, then=then)
