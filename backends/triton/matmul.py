"""The GEMM template: batched C = A @ B with f32 accumulation (i32 for i8 operands), an operand
prologue and a multi-D epilogue.

One program per (batch index, BLOCK_M x BLOCK_N tile); tiles are visited in
grouped order (GROUP_M rows of tiles at a time) so neighbouring programs
share A and B tiles in L2. Batch dims broadcast through strides (a missing or
size-1 batch dim reads the same matrix); any input strides work, so `k.T` is
read in place. Tails in M, N and K are masked (K = 1 included).

The kernel's region is the matmul plus, optionally,
- a prologue per operand: elementwise ops applied to each loaded A (or B)
  tile, from one tensor plus scalars (masked back to 0 in the K tail);
- an epilogue: elementwise ops on the f32 accumulator and on extra tensors
  ("D tensors") loaded at the output tile through their strides (bias [N],
  row scales [M, 1], full [.., M, N], batch-broadcast, scalars), applied
  before the store; every region output is stored (multi-output epilogues);
- batch sums (`GemmPlan.batch_sums`): the product summed (or averaged) over batch axes.
  sum_t A_t @ B_t is one longer K loop: a program per tile of the sum's output walks the
  summed batch elements (`tb`) around its K loop, the operands' pointers (or descriptor
  coordinates) at each, into the one accumulator; the epilogue runs on the summed tile.

Split-K: where a call's output tiles alone cannot fill the GPU (`split_count`: from the
sizes only, or the SPLITS tile hint), SPLITS programs share each tile's K loop, each over a
range of whole BLOCK_K blocks, and store the partial products of their range (every
accumulator's, and the partial sums of the row statistics) in workspaces laid out per output
element, [SPLITS, batch, M, N]. A second launch, the combine (`emit_combine`, the same
parameters and epilogue), adds each tile's partials in split order (no atomics: the same
bits on every run), finalizes the statistics and runs the epilogue. A batch sum's splits
share the flattened (batch element, block of K) steps of its tile (`batch_range`), so a sum
of many short products splits as a long K does. SPLITS is a constexpr:
at 1 the kernel compiles to what it was unsplit, and the combine's grid is empty.

fp32 dots use IEEE precision unless the program opted into tf32. Triton's
interpreter multiplies bf16 dot operands as raw bits, so when `INTERPRETER`
is set they are widened to f32 first. On a GPU, a list of Hopper
configurations is autotuned per problem size (`candidates`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tiledsl import ops
from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp, Op, Region
from tiledsl.plans import GemmPlan
from tiledsl.types import Compute, DType, compute_type

from . import tma
from .base import (
    EmittedKernel,
    Hints,
    LaunchConfig,
    batch_names,
    cdiv,
    decompose,
    finish,
    hint,
    hinted_first,
    numel,
    require_dot_hints,
    sm_count,
)
from .codegen import Code, Signature, TensorRef, next_pow2
from .expr import Emitter, Val, dot_kwargs, inputs_read, literal
from .renderings import REDUCTIONS

DOT_HINTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
OPERAND_BLOCKS = (("BLOCK_M", "BLOCK_K"), ("BLOCK_K", "BLOCK_N"))  # the a and b tiles
# Hopper configurations to autotune among: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the
# first the default. Derived from the build Triton's launcher really makes (`tiledsl ptx
# --all`, sm_90, Triton 3.9, M=N=8192 K=4096, f16/bf16): with the epilogue run on one
# column half of the tile at a time, every epilogue we tried (two D tiles, gelu, two
# outputs, row and column scales) compiles without spills at all of them (128 x 256: 164-220
# registers), and 128-wide tiles issue m64n128k16 (128 x 256: m64n256k16) wgmmas. An operand
# prologue keeps its tile in registers through the K loop: 256 x 128 then spills, so
# prologue kernels stay at 128 x 128 and below. 4-warp 128 x 128 tiles use 210+ registers.
WIDE_DEFAULT = (128, 256, 64, 8, 3)
HOPPER_CONFIGS = ((128, 128, 64, 8, 3), WIDE_DEFAULT, (256, 128, 64, 8, 3),
                  (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 64, 64, 8, 3),
                  (64, 128, 64, 8, 3))


def batch_base(ref: TensorRef, rank: int, bnames: list[str | None]) -> str:
    """The pointer of this program's batch element of a matrix tensor (batch dims right-aligned
    to `bnames`, the program's batch indices; broadcast dims have none)."""
    if rank <= 2:
        return ref.ptr
    off = ref.offset(bnames[len(bnames) - (rank - 2):] + [None, None])
    return ref.ptr if off == "0" else f"{ref.ptr} + {off}"


def tile_ptrs(ref: TensorRef, rank: int, bnames: list[str | None], rows: str, cols: str, shape: str) -> str:
    """Pointers of a matrix tile; broadcast when a literal size-1 dim has no stride."""
    ptrs = f"{batch_base(ref, rank, bnames)} + {ref.offset([None] * (rank - 2) + [rows, cols])}"
    if ref.strides[-2] is None or ref.strides[-1] is None:
        ptrs = f"tl.broadcast_to({ptrs}, {shape})"
    return ptrs


def operand_tile(em: Emitter, region: Region, name: str, ptrs: str | None, mask: str, value: int, src: int,
                 chain: set[int], scalars: Mapping[int, Val], dot: DType,
                 vectors: Mapping[int, str] | None = None, keep: dict[int, Val] | None = None,
                 index: Callable[[Op], Val] | None = None,
                 positions: Callable[[Op], Val] | None = None) -> str:
    """Load a dot operand tile of `src` into `name`, apply the prologue `chain` (the values
    `value` is computed from: elementwise ops with scalars, and transposes, which the
    pointers already account for) in f32, and bring it to the dot's dtype. The prologue
    result is masked back to 0 outside the tile, so tails add nothing to the dot.

    `scalars`: the value of every rank-0 input the chain reads, which the template reads
    once before its loops: a by-value argument, or a 0-d tensor another kernel stored (a
    mean the prologue scales by), loaded. `vectors`: inputs read along K (an A prologue's
    `g: [K]`), as source text of their loaded value for this step; `keep`: when given, the
    chain's values are left there, with any values it already names computed too (a GEMM's
    row statistics of the same tile).
    `vectors` may also give a value the chain computes (a grouped GEMM's per-row index: the
    one this pass of the K loop takes).
    `index`: the operand is gathered (`ptrs` None): the chain's `index` ops at the tile, whose
    gather loads it (masked, at the addresses it computes) from the tensors it gathers from.
    `positions`: the chain's `index` ops at the tile of an operand loaded through its
    pointers (a prologue computing from positions: `(index(y, 0) * 0.01 + ...) @ w`)."""
    body, n_in = em.code, len(region.inputs)
    if index is None:
        src_type = region.inputs[src].type
        body(f"{name} = tl.load({ptrs}, mask={mask}, other=0.0)")
    wanted = set(chain) | (set(keep) if keep else set())
    if value != src or keep or index is not None:
        vals = {} if index is not None else \
            {src: em.assign(em.widen(name, src_type.dtype), compute_type(src_type.dtype))}
        for i in wanted:
            if i < n_in and i != src and not (index is not None and not region.read_whole(i)):
                if vectors is not None and i in vectors:
                    vals[i] = em.load(vectors[i], region.inputs[i].type)
                else:
                    vals[i] = scalars[i]
        for v in sorted(v for v in wanted if v >= n_in):
            rop = region.ops[v - n_in]
            if vectors is not None and v in vectors:  # a value the template gives (a grouped
                vals[v] = Val(vectors[v], compute_type(rop.op.dtype))  # GEMM's index: `e`)
            elif rop.op.kind == "transpose":
                vals[v] = vals[rop.operands[0]]
            elif rop.op.kind == "const":
                vals[v] = literal(rop.op.attr("value"), compute_type(rop.op.dtype))
            elif rop.op.kind == "index":
                vals[v] = (index or positions)(rop.op)
            else:
                types = tuple(region.value_type(o) for o in rop.operands)
                vals[v] = em.op(rop.op, em.operands(rop, vals), types)
        if keep is not None:
            keep.update(vals)
    if value != src or index is not None:
        last = region.ops[value - n_in] if value >= n_in else None
        if dot.is_f8 and last is not None and last.op.kind == "cast" and last.op.dtype is dot:
            value = last.operands[0]  # rounded to f8 once, by the narrowing below
        result = em.tensor(em.convert(vals[value], compute_type(dot)))
        body(f"{name} = tl.where({mask}, {em.narrow(result.text, dot)}, {'0' if dot.is_int else '0.0'})")
    elif src_type.dtype is not dot:  # mixed operands meet in the promoted dtype (f32)
        body(f"{name} = {em.widen(name, src_type.dtype)}")
    if dot is DType.BF16 or dot.is_f8:
        # the interpreter multiplies bf16 (and f8) dot operands as raw bits
        body("if INTERPRETER:")
        with body.indent():
            body(f"{name} = {em.widen(name, dot)}")
    return name


class GemmProgram:
    def __init__(self, kernel: KernelOp, hints: Hints, allow_tf32: bool) -> None:
        require_dot_hints(hints, DOT_HINTS)
        self.kernel, self.hints, self.allow_tf32 = kernel, hints, allow_tf32
        self.region = region = kernel.region
        self.plan: GemmPlan = kernel.plan
        plan = self.plan
        self.n_in = len(region.inputs)
        self.mm = plan.matmul
        self.op: Op = region.ops[self.mm - self.n_in].op
        # operand 0 is A; 1 is B; 2, 3, ... the B operands of the dual matmuls
        self.prologues = [plan.a_prologue, plan.b_prologue, *(d.b_prologue for d in plan.duals)]
        self.sources = [plan.a_source, plan.b_source, *(d.b_source for d in plan.duals)]
        self.values = [plan.a, plan.b, *(d.b for d in plan.duals)]
        self.matmuls = [self.mm, *(d.matmul for d in plan.duals)]  # one accumulator each
        self.stats = plan.row_stats  # sums and means of A's rows, accumulated in the K loop
        # what each operand enters the dot as: i8 (i8 products give i32), or f8 where every
        # operand's value is an f8 one (f8 products accumulate in f32, their result dtype),
        # or the product's dtype
        self.integer = self.op.dtype is DType.I32
        self.dots = [DType.I8] * len(self.sources) if self.integer else self.f8_operands() \
            or [self.op.dtype] * len(self.sources)
        # a batch sum (`plan.batch_sums`) sums the product over its batch axes `summed` in the
        # K loop: the output tiles, the grid and the workspaces are the sum's, whose batch
        # dims are the product's others (or size 1 with keepdims)
        self.product = self.op.shape
        self.summed = plan.summed_axes
        self.sums = plan.batch_sums
        self.shape = region.value_type(self.sums[-1]).shape if self.sums else self.product
        self.batch = self.shape[:-2]
        # a grouped GEMM (`GemmPlan.segment`): a tile's rows are the product's last batch axis
        # (its M dim is 1), and each row's B matrix is the one its index selects
        self.segment = plan.segment
        if self.segment is not None:
            self.batch = self.shape[:-3]
        # a grouped GEMM's B that is its matrix as stored (`w[expert]` read at the tile's K and
        # N): each of the source's dims indexed by `e`, K or N, read through its strides like
        # an ungathered B (`affine_b`)
        self.affine: dict[int, tuple[list[str], int, int]] = {}
        for which in range(1, len(self.sources)):
            found = self.affine_b(which)
            if found is not None:
                self.affine[which] = found
                self.sources[which] = self.values[which] = found[2]
        self.sig, self.body = Signature(), Code()
        self.em = Emitter(self.body)

    def f8_operands(self) -> list[DType] | None:
        """The f8 dtype of each operand when every one is an f8 value: its f8 source as it is,
        or a widening cast of an f8 value its prologue computes (a per-token quantizer's
        `cast(cast(x / s, f8e4m3), f32)`; the operand is then the f8 value, its widening left
        to the tensor core). None when any is not: a mixed dot widens its f8 operands."""
        region, n_in = self.region, self.n_in
        dots, values = [], list(self.values)
        for w, (src, value) in enumerate(zip(self.sources, self.values, strict=True)):
            if value == src and region.inputs[src].type.dtype.is_f8:
                dots.append(region.inputs[src].type.dtype)
                continue
            rop = region.ops[value - n_in] if value >= n_in else None
            if rop is None or rop.op.kind != "cast" or not rop.op.dtype.is_float:
                return None
            inner = region.value_type(rop.operands[0]).dtype
            if not inner.is_f8:
                return None
            dots.append(inner)
            values[w] = rop.operands[0]
        self.values = values
        return dots

    # --- emission ----------------------------------------------------------------------------

    def declare(self) -> None:
        """The parameters the main kernel and its combine both take: every input, the outputs,
        the sizes M, N, K, and the block constexprs."""
        sig, region = self.sig, self.region
        a_type = region.inputs[self.sources[0]].type
        self.refs = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
                     if not inp.scalar and inp.type.rank > 0}
        self.scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
        self.zero_dim = {i: sig.tensor("in", i, ()).ptr for i, inp in enumerate(region.inputs)
                         if not inp.scalar and inp.type.rank == 0}
        self.outs = [sig.tensor("out", j, self.shape) for j in range(len(region.outputs))]
        self.em.gather_from(region, self.refs, sig.size)
        self.M = sig.size(self.shape[-3] if self.segment is not None else self.shape[-2])
        self.N = sig.size(self.shape[-1])
        self.K = sig.size(a_type.shape[-1])
        self.batch_count = " * ".join(sig.size(d) for d in self.batch if d != 1)
        self.body(f"tiles_m = tl.cdiv({self.M}, BLOCK_M)")
        self.body(f"tiles_n = tl.cdiv({self.N}, BLOCK_N)")
        self.body("tiles = tiles_m * tiles_n")
        self.body(f"tiles_all = tiles{f' * {self.batch_count}' if self.batch_count else ''}")

    def emit(self) -> None:
        sig, body = self.sig, self.body
        self.declare()
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLITS"):
            sig.constexpr(name)
        # the rank-0 inputs the operand prologues read, read once per program
        read = set().union(*self.prologues, self.plan.stat_chain)
        self.prologue_scalars = {i: self.scalar_input(i) for i in sorted(read)
                                 if i < self.n_in and self.region.inputs[i].type.rank == 0}
        # operands read as they are may come through TMA descriptors (`tma.py`)
        descs = [self.descriptors(which) for which in range(len(self.sources))]
        # an 8-bit B read through a descriptor comes K-major (`EmittedKernel.k_major`): its
        # transposed descriptor's tiles are what fp8 wgmma reads, with no transpose through
        # shared memory each K step
        self.k_major = tuple(self.sources[w] for w in range(1, len(descs))
                             if descs[w] is not None and self.dots[w].itemsize == 1)
        # one tile per program, or (a persistent grid) every program-count-th tile; split
        # (SPLITS > 1, never persistent): SPLITS programs a tile, each over its range of K
        body("first_pid = tl.program_id(0)")
        body("pid_step = tl.num_programs(0)")
        if self.sums:
            self.batch_range()
        else:
            self.k_range()
        body("for pid in range(first_pid, tiles_all, pid_step):")
        with body.indent():
            self.tile_body(descs)

    def k_range(self) -> None:
        """The range of K a program's K loop walks: all of it, or (split) its split's."""
        body = self.body
        body("k_lo = 0")
        body(f"k_hi = {self.K}")
        body("if SPLITS > 1:")
        with body.indent():
            body("split = first_pid // tiles_all")
            body("first_pid = first_pid % tiles_all")
            body("pid_step = tiles_all")
            # whole blocks of K a split (only the last one's ends in K's tail): a new K
            # compiles nothing new, and a TMA tile never reads past its split's range
            body(f"k_chunk = tl.cdiv(tl.cdiv({self.K}, BLOCK_K), SPLITS) * BLOCK_K")
            body("k_lo = split * k_chunk")
            # (true, and it keeps ptxas from spilling: 16 bytes of the int4 GEMM's split at M =
            # 16, its K indices divided in the loop, with Triton's --regAllocOptLevel=2)
            body("tl.assume(k_lo >= 0)")
            body(f"k_hi = tl.minimum(k_lo + k_chunk, {self.K})")

    def batch_range(self) -> None:
        """The batch elements a program's loops walk when it sums the product over the batch
        (each with all of K): all of them, or (split) the split's range of the (batch element,
        block of K) steps, flattened, from `s_lo` to `s_hi`: a split may begin and end inside
        an element's K loop, so few long K loops split as well as many short ones."""
        body, count = self.body, self.summed_count()
        body("b_lo = 0")
        body(f"b_hi = {count}")
        body("if SPLITS > 1:")
        with body.indent():
            body("split = first_pid // tiles_all")
            body("first_pid = first_pid % tiles_all")
            body("pid_step = tiles_all")
            body(f"k_blocks = tl.cdiv({self.K}, BLOCK_K)")
            body(f"s_all = {count} * k_blocks")
            body("s_chunk = tl.cdiv(s_all, SPLITS)")
            body("s_lo = split * s_chunk")
            body("tl.assume(s_lo >= 0)")
            body("s_hi = tl.minimum(s_lo + s_chunk, s_all)")
            body("b_lo = s_lo // k_blocks")
            body("b_hi = tl.cdiv(s_hi, k_blocks)")

    def emit_combine(self) -> None:
        """The combine launch (a second function, this program's parameters and epilogue):
        program `pid` adds the partials each split left of its tile's accumulators and row
        statistics, in split order, finalizes the statistics, and runs the epilogue."""
        sig, body = self.sig, self.body
        self.declare()
        for name in ("BLOCK_M", "BLOCK_N", "GROUP_M", "SPLITS"):
            sig.constexpr(name)
        self.prologue_scalars = {}  # no prologue: the epilogue reads each rank-0 input itself
        body("pid = tl.program_id(0)")
        self.tile_indices()
        works = [sig.workspace(k) for k in range(len(self.matmuls) + len(self.stats))]
        for j in range(len(self.stats)):
            body(f"stat{j} = tl.zeros([BLOCK_M], dtype=tl.float32)")
            body("for sp in range(0, SPLITS):")
            with body.indent():
                body(f"stat{j} += tl.load({works[len(self.matmuls) + j]} + {self.stat_offsets('sp')}, "
                     f"mask=rm < {self.M}, other=0.0)")
        self.finalize_stats()
        accs = self.accumulators()
        zero = "0" if self.integer else "0.0"
        for half in (0, 1):
            body(f"rn = pid_n * BLOCK_N + {half} * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)")
            body(f"tile_mask = (rm[:, None] < {self.M}) & (rn[None, :] < {self.N})")
            for acc, work in zip(accs, works[:len(accs)], strict=True):
                body(f"{acc}_{half} = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype={self.acc_type()})")
                body("for sp in range(0, SPLITS):")
                with body.indent():
                    body(f"{acc}_{half} += tl.load({work} + {self.partial_offsets('sp')}, "
                         f"mask=tile_mask, other={zero})")
            self.epilogue([f"{acc}_{half}" for acc in accs])

    def partial_offsets(self, split: str) -> str:
        """Where split `split`'s partials of the tile `rm` x `rn` lie in an accumulator's
        workspace, laid out [SPLITS, batch, M, N] (in int64): the same for any block sizes,
        so an autotuned tile and the combine's agree."""
        batch = f" * ({self.batch_count})" if self.batch_count else ""
        return (f"(({split}{batch} + pid_b).to(tl.int64) * {self.M} + rm[:, None]) * {self.N} "
                f"+ rn[None, :]")

    def stat_offsets(self, split: str) -> str:
        """Where split `split`'s partial sums of the rows `rm` lie in a row statistic's
        workspace, laid out [SPLITS, batch, M]."""
        batch = f" * ({self.batch_count})" if self.batch_count else ""
        return f"({split}{batch} + pid_b).to(tl.int64) * {self.M} + rm"

    def acc_type(self) -> str:
        return "tl.int32" if self.integer else "tl.float32"

    def tile_indices(self) -> None:
        """The tile of program `pid`: its batch element `pid_b` (and batch indices), its rows
        `rm` and columns `rn`."""
        sig, body = self.sig, self.body
        body("pid_b = pid // tiles")
        body("t = pid % tiles")
        # grouped order: GROUP_M rows of tiles share the columns they read
        body("width = GROUP_M * tiles_n")
        body("first_m = (t // width) * GROUP_M")
        body("group_m = tl.minimum(tiles_m - first_m, GROUP_M)")
        body("pid_m = first_m + (t % width) % group_m")
        body("pid_n = (t % width) // group_m")
        self.out_bnames: list[str | None] = batch_names(self.batch)
        if self.batch:
            body("pb = pid_b.to(tl.int64)")
            decompose(body, "pb", self.batch, self.out_bnames, sig.size, "pq")
        if self.segment is not None:  # the rows' batch axis: the tile's rows
            self.out_bnames = [*self.out_bnames, "rm[:, None]"]
        self.bnames = self.product_names()
        body("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        body("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")

    def product_names(self) -> list[str | None]:
        """The index of each batch dim of the product: the output's batch index, or (a summed
        axis) the batch loop's `bs<axis>` (None: a literal size-1 dim)."""
        if not self.sums:
            return self.out_bnames
        # the product's dim each output dim is (a dim summed with keepdims stays, size 1)
        axes = list(range(len(self.product)))
        for v in self.sums:
            op = self.region.ops[v - self.n_in].op
            if not op.attr("keepdims"):
                del axes[op.attr("axis") % len(axes)]
        names: list[str | None] = [None if d == 1 else f"bs{a}" for a, d in enumerate(self.product[:-2])]
        for j, a in enumerate(axes[:-2]):
            if a not in self.summed:
                names[a] = self.out_bnames[j]
        return names

    def summed_dims(self) -> list:
        return [self.product[a] for a in self.summed]

    def summed_count(self) -> str:
        """The number of batch elements the K loop sums (source text)."""
        return " * ".join(self.sig.size(d) for d in self.summed_dims() if d != 1) or "1"

    def tile_body(self, descs: list[tma.Descriptors | None]) -> None:
        """One output tile: its indices, the K loop (over the split's range of K; summing the
        batch, inside the loop over the batch elements summed), then the epilogue, or (split)
        the partials left for the combine."""
        body, K = self.body, self.K
        self.tile_indices()
        body("rk = tl.arange(0, BLOCK_K)")
        accs = self.accumulators()
        if self.sums:
            for acc in accs:
                body(f"{acc} = tl.zeros((BLOCK_M, BLOCK_N), dtype={self.acc_type()})")
            body("for tb in range(b_lo, b_hi):")
            with body.indent():
                summed = [self.bnames[a] for a in self.summed]
                decompose(body, "tb", self.summed_dims(), summed, self.sig.size, "tq")
                # this element's range of K: all of it, or the part of it in the split's range
                body("kb_lo = 0")
                body(f"kb_hi = {K}")
                body("if SPLITS > 1:")
                with body.indent():
                    body("kb_lo = tl.maximum(s_lo - tb * k_blocks, 0) * BLOCK_K")
                    body(f"kb_hi = tl.minimum(tl.minimum(s_hi - tb * k_blocks, k_blocks) * BLOCK_K, {K})")
                if self.plan.batch_scales:  # this element's product, scaled, then added
                    body(f"part = tl.zeros((BLOCK_M, BLOCK_N), dtype={self.acc_type()})")
                    self.k_loop(descs, ["part"], "kb_lo", "kb_hi")
                    body(f"acc += {self.scaled_part('part')}")
                else:
                    self.k_loop(descs, accs, "kb_lo", "kb_hi")
        elif self.segment is not None:
            self.segment_loop(descs, accs)
        else:
            self.k_loop(descs, accs, "k_lo", "k_hi")
        body("if SPLITS > 1:")
        with body.indent():
            self.store_partials(accs)
        body("else:")
        with body.indent():
            self.finalize_stats()
            # the epilogue runs on the two column halves of the tile in turn, so the D tiles
            # it loads and the values it computes live beside half the accumulator, not all
            for acc in accs:
                body(f"{acc} = tl.permute(tl.reshape({acc}, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))")
                body(f"{acc}_0, {acc}_1 = tl.split({acc})")
            for half in (0, 1):
                body(f"rn = pid_n * BLOCK_N + {half} * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)")
                self.epilogue([f"{acc}_{half}" for acc in accs])

    def segment_loop(self, descs: list[tma.Descriptors | None], accs: list[str]) -> None:
        """A grouped GEMM's tile: each index its rows hold, from the least to the greatest (one
        or two where the rows are sorted by it), multiplies those rows, the others masked to
        0, by the B matrix it selects, into the one accumulator."""
        body = self.body
        n_in = self.n_in
        vals = self.at_product({}, {v for v in self.region.depends(self.segment) if v >= n_in})
        seg = self.em.tensor(vals[self.segment]).text
        body(f"seg = tl.broadcast_to({seg}, [BLOCK_M, 1]).to(tl.int64)")
        body(f"e_lo = tl.min(tl.where(rm[:, None] < {self.M}, seg, 9223372036854775807))")
        body(f"e_hi = tl.max(tl.where(rm[:, None] < {self.M}, seg, -9223372036854775807))")
        for acc in accs:
            body(f"{acc} = tl.zeros((BLOCK_M, BLOCK_N), dtype={self.acc_type()})")
        body("for e in range(e_lo, e_hi + 1):")
        with body.indent():
            body("rows_e = seg == e")
            body("if tl.max(rows_e.to(tl.int32)) > 0:")
            with body.indent():
                self.k_loop(descs, accs, "k_lo", "k_hi", zero=False)

    def scaled_part(self, part: str) -> str:
        """The product of one summed batch element (`part`, the whole tile) times its scales
        (`GemmPlan.batch_scales`), their factors read at the product's tile of this element."""
        vals = self.at_product({self.mm: Val(part, Compute.F32)}, self.plan.scale_ops)
        return self.em.tensor(self.em.convert(vals[self.plan.batch_scales[-1]], Compute.F32)).text

    def at_product(self, vals: dict[int, Val], values: frozenset[int] | set[int]) -> dict[int, Val]:
        """Emit the region ops `values` at the product's tile of this batch element (inside
        the batch loop, or a grouped GEMM's tile), the inputs they read loaded there; returns
        `vals` with them."""
        region, rank = self.region, len(self.product)
        names = [*self.bnames, "rm[:, None]", "rn[None, :]"]
        for i in inputs_read(region, values):
            if i not in vals:
                t = region.inputs[i].type
                vals[i] = (self.prologue_scalars.get(i) or self.scalar_input(i)) if t.rank == 0 \
                    else self.load_d(i, t.shape, rank, names)

        def index(op: Op) -> Val:
            axis = op.attr("axis") % len(op.shape)
            return self.em.index(names[axis + rank - len(op.shape)] if op.shape[axis] != 1 else None)

        return self.em.run(region, vals, index, skip=lambda v: v not in values)

    def k_loop(self, descs: list[tma.Descriptors | None], accs: list[str], k_lo: str, k_hi: str,
               zero: bool = True) -> None:
        """The operands' pointers at this batch element and the loop over K from `k_lo` to
        `k_hi`, accumulating into `accs` (zeroed here, unless the program sums the batch and
        zeroed them before its batch loop)."""
        body = self.body
        a_src = self.sources[0]
        a_type = self.region.inputs[a_src].type
        M, N, K = self.M, self.N, self.K
        a_tile = self.tile(self.refs[a_src], a_type.rank, "rm[:, None]", "rk[None, :]", "[BLOCK_M, BLOCK_K]")
        body(f"a_ptrs = {a_tile}")
        names = self.operand_names()
        for which in range(1, len(self.sources)):
            src = self.sources[which]
            if self.gathered(which):  # loaded through the indices it computes per tile
                continue
            if which in self.affine:  # a grouped GEMM's matrix `e`, through its strides
                # (a negative index counts from the end; one outside [-n, n) reads 0)
                ref, (idx, _, _) = self.refs[src], self.affine[which]
                size = self.sig.size(self.region.inputs[src].type.shape[idx.index("e")])
                name = names[which]
                body(f"{name}_e = tl.where(e < 0, e + {size}, e)")
                # (a [1, BLOCK_N] tensor: the interpreter masks with no 0-d one)
                body(f"{name}_in = tl.zeros([1, BLOCK_N], dtype=tl.int1) | "
                     f"(({name}_e >= 0) & ({name}_e < {size}))")
                offset = ref.offset([f"{name}_e" if i == "e" else i for i in idx])
                body(f"{name}_ptrs = {ref.ptr} + {offset}")
                continue
            b_tile = self.tile(self.refs[src], self.region.inputs[src].type.rank, "rk[:, None]",
                               "rn[None, :]", "[BLOCK_K, BLOCK_N]")
            body(f"{names[which]}_ptrs = {b_tile}")
        steps = self.pointer_steps()
        if steps:  # a split's pointers start at its range of K
            body("if SPLITS > 1:")
            with body.indent():
                for name, step in steps:
                    body(f"{name}_ptrs += {k_lo} * {step}")
        if not self.sums and zero:
            for acc in accs:
                body(f"{acc} = tl.zeros((BLOCK_M, BLOCK_N), dtype={self.acc_type()})")
        for j in range(len(self.stats)):
            body(f"stat{j} = tl.zeros([BLOCK_M], dtype=tl.float32)")
        body(f"for k0 in range({k_lo}, {k_hi}, BLOCK_K):")
        with body.indent():
            body(f"kmask = rk < {K} - k0")
            body(f"a_mask = (rm[:, None] < {M}) & kmask[None, :]")
            body(f"b_mask = kmask[:, None] & (rn[None, :] < {N})")
            for which, name in enumerate(names):
                coords = ("pid_m * BLOCK_M", "k0") if which == 0 else ("k0", "pid_n * BLOCK_N")
                mask = "a_mask" if which == 0 else f"b_mask & {name}_in" if which in self.affine else "b_mask"
                with tma.load_or_pointers(self.em, descs[which], name, coords, self.bnames,
                                          self.dots[which]):
                    self.operand(name, which, mask)
                if which == 0 and self.segment is not None:  # this index's rows only
                    body("a = tl.where(rows_e, a, 0)")
            for acc, name in zip(accs, names[1:], strict=True):
                body(f"{acc} = tl.dot(a, {name}, {acc}{self.dot_kwargs()})")
            for name, step in steps:
                body(f"{name}_ptrs += BLOCK_K * {step}")

    def pointer_steps(self) -> list[tuple[str, str]]:
        """(tile name, stride along K) of each operand read through pointers that move along
        K (a gathered operand computes its addresses; a literal size-1 K has no stride)."""
        out = []
        for which, (name, src) in enumerate(zip(self.operand_names(), self.sources, strict=True)):
            if self.gathered(which):
                continue
            step = self.refs[src].strides[self.affine[which][1] if which in self.affine
                                          else -1 if which == 0 else -2]
            if step is not None:
                out.append((name, step))
        return out

    def store_partials(self, accs: list[str]) -> None:
        """A split's partial products of its range of K (and its partial sums of the row
        statistics, stored by the tile of the first columns) in the workspaces the combine
        adds up: one per accumulator, then one per statistic."""
        sig, body = self.sig, self.body
        body(f"tile_mask = (rm[:, None] < {self.M}) & (rn[None, :] < {self.N})")
        for k, acc in enumerate(accs):
            body(f"tl.store({sig.workspace(k)} + {self.partial_offsets('split')}, {acc}, mask=tile_mask)")
        if self.stats:
            body("if pid_n == 0:")
            with body.indent():
                for j in range(len(self.stats)):
                    body(f"tl.store({sig.workspace(len(accs) + j)} + {self.stat_offsets('split')}, "
                         f"stat{j}, mask=rm < {self.M})")

    def finalize_stats(self) -> None:
        """The row statistics from their sums along K (a mean divides by K)."""
        for j, v in enumerate(self.stats):
            finalize = REDUCTIONS[self.region.ops[v - self.n_in].op.kind].finalize
            if finalize is not None:
                self.body(f"stat{j} = " + finalize.format(total=f"stat{j}", length=self.K))

    def operand_names(self) -> list[str]:
        """The tile names of the operands: a, b, then b1, b2, ... for the dual matmuls."""
        return ["a", "b", *(f"b{i}" for i in range(1, len(self.sources) - 1))]

    def accumulators(self) -> list[str]:
        return ["acc", *(f"acc{i}" for i in range(1, len(self.matmuls)))]

    def dot_kwargs(self) -> str:
        return dot_kwargs(self.dots[0], self.allow_tf32)

    def tile(self, ref: TensorRef, rank: int, rows: str, cols: str, shape: str) -> str:
        return tile_ptrs(ref, rank, self.bnames, rows, cols, shape)

    def descriptors(self, which: int) -> tma.Descriptors | None:
        """TMA descriptors for operand `which` when it is its source tensor as it is (no
        prologue, or only the widening of an f8 source the tensor core multiplies as it is)."""
        src = self.sources[which]
        t = self.region.inputs[src].type
        if self.values[which] != src or self.segment is not None or not tma.eligible(t, self.dots[which]) or (
                which == 0 and self.stats):
            return None
        return tma.declare(self.sig, self.body, self.operand_names()[which], src, self.refs[src], t,
                           OPERAND_BLOCKS[min(which, 1)])

    def operand(self, name: str, which: int, mask: str) -> str:
        """Load one operand tile, apply its prologue, and bring it to the dot's dtype."""
        value = self.values[which]
        if which != 0 and self.gathered(which):
            # tensors its prologue reads element for element (an index another kernel stores
            # too: a bounds check's), at the tile's indices
            tiles = {}
            for i in self.prologues[which]:
                inp = self.region.inputs[i] if i < self.n_in else None
                if inp is not None and not inp.scalar and inp.type.rank > 0 and self.region.read_whole(i):
                    names = self.b_names(inp.type.rank)
                    idx = [None if d == 1 else names[k] for k, d in enumerate(inp.type.shape)]
                    ref = self.refs[i]
                    if any(idx[-2:]):
                        tiles[i] = f"tl.load({ref.ptr} + {ref.offset(idx)}, mask={mask}, other=0)"
                    else:  # one element per batch (a head's scale): always there, no tile mask
                        tiles[i] = f"tl.load({ref.ptr} + {ref.offset(idx)})"
            if self.segment is not None:  # the matrix of the index this pass of the K loop takes
                tiles[self.segment] = "e"
            return operand_tile(self.em, self.region, name, None, mask, value, self.sources[which],
                                self.prologues[which], self.prologue_scalars, self.dots[which], tiles,
                                index=self.b_index)
        if which != 0:
            return operand_tile(self.em, self.region, name, f"{name}_ptrs", mask, value,
                                self.sources[which], self.prologues[which], self.prologue_scalars,
                                self.dots[which], positions=self.b_index)
        # A: its prologue may read vectors along K, and the row statistics are summed from
        # the same tile
        region, n_in = self.region, self.n_in
        vectors = {}
        for i in self.prologues[0] | self.plan.stat_chain:
            inp = region.inputs[i] if i < n_in else None
            if inp is not None and i != self.sources[0] and not inp.scalar and inp.type.rank > 0:
                ref = self.refs[i]
                if inp.type.rank >= 2 and inp.type.shape[-2] != 1 and inp.type.shape[-1] == 1:
                    # a vector along A's rows (a per-token scale): a column of the tile's rows
                    ptrs = f"{batch_base(ref, inp.type.rank, self.bnames)} + " \
                        f"{ref.offset([None] * (inp.type.rank - 2) + ['rm[:, None]', None])}"
                    vectors[i] = f"tl.load({ptrs}, mask=(rm < {self.M})[:, None], other=0.0)"
                    continue
                if inp.type.rank >= 2 and inp.type.shape[-2] != 1:
                    # a tensor of A's rows (a statistic of `g * o`, both stored by other
                    # kernels): its tile at A's
                    ptrs = self.tile(ref, inp.type.rank, "rm[:, None]", "(k0 + rk)[None, :]",
                                     "[BLOCK_M, BLOCK_K]")
                    vectors[i] = f"tl.load({ptrs}, mask={mask}, other=0.0)"
                    continue
                offset = ref.offset([None] * (inp.type.rank - 1) + ["(k0 + rk)[None, :]"])
                vectors[i] = f"tl.load({ref.ptr} + {offset}, mask=kmask[None, :], other=0.0)"
        keep = dict.fromkeys(self.plan.stat_chain) if self.stats else None
        operand_tile(self.em, region, name, f"{name}_ptrs", mask, value, self.sources[0],
                     self.prologues[0], self.prologue_scalars, self.dots[0], vectors, keep,
                     positions=self.a_index)
        for j, v in enumerate(self.stats):
            (x,) = region.ops[v - n_in].operands
            term = self.em.tensor(self.em.convert(keep[x], Compute.F32)).text
            self.body(f"stat{j} += tl.sum(tl.where({mask}, {term}, 0.0), 1)")
        return name

    def gathered(self, which: int) -> bool:
        """Is B operand `which` loaded through gathers its prologue computes (a packed int4
        weight read at k // 8)? (Not a grouped GEMM's matrix as stored: `affine`.)"""
        n_in = self.n_in
        return which > 0 and which not in self.affine and any(
            v >= n_in and self.region.ops[v - n_in].op.kind == "take" for v in self.prologues[which])

    def affine_b(self, which: int) -> tuple[list[str], int, int] | None:
        """A grouped GEMM's B operand `which` that is one take of a stored tensor at the
        segment and at the tile's K and N indices (Mixtral's `w[expert]`, transposed as
        `F.linear` takes it): the index of each of the tensor's dims (`e`, `(k0 + rk)[:, None]`,
        `rn[None, :]`), the one indexed along K, and the tensor's input. None otherwise."""
        region, n_in = self.region, self.n_in
        value = self.values[which]
        if self.segment is None or value < n_in or region.ops[value - n_in].op.kind != "take":
            return None
        rop = region.ops[value - n_in]
        src, *indices = rop.operands
        rank = len(rop.op.shape)
        names, k_dim = [], None
        for d, i in enumerate(indices):
            if i == self.segment:
                names.append("e")
                continue
            iop = region.ops[i - n_in].op if i >= n_in else None
            if iop is None or iop.kind != "index":
                return None
            axis = iop.attr("axis") % len(iop.shape) + rank - len(iop.shape)
            if axis == rank - 2:
                names.append("rk[:, None]")
                k_dim = d
            elif axis == rank - 1:
                names.append("rn[None, :]")
            else:
                return None
        if k_dim is None or "e" not in names or "rn[None, :]" not in names or src >= n_in:
            return None
        return names, k_dim, src

    def b_names(self, rank: int) -> list[str | None]:
        """The index of each dim of a B tile of rank `rank`: its rows k0 + rk, its columns rn,
        its batch dims the program's."""
        return [*self.bnames[len(self.bnames) - (rank - 2):], "(k0 + rk)[:, None]", "rn[None, :]"] \
            if rank > 2 else ["(k0 + rk)[:, None]", "rn[None, :]"]

    def a_index(self, op: Op) -> Val:
        """An `index` op of A's prologue at the tile: its rows rm, its columns k0 + rk, its
        batch dims the program's."""
        rank, axis = len(op.shape), op.attr("axis") % len(op.shape)
        names = [*self.bnames[len(self.bnames) - (rank - 2):], "rm[:, None]", "(k0 + rk)[None, :]"] \
            if rank > 2 else ["rm[:, None]", "(k0 + rk)[None, :]"][2 - rank:]
        return self.em.index(None if op.shape[axis] == 1 else names[axis])

    def b_index(self, op: Op) -> Val:
        """An `index` op of B's prologue (or of a gathered B) at the tile, its dims
        right-aligned to the tile's."""
        rank = len(op.shape)
        axis = op.attr("axis") % rank
        names = self.b_names(rank)
        return self.em.index(None if op.shape[axis] == 1 else names[len(names) - rank:][axis])

    def out_index(self, dim: int) -> str | None:
        """Index of an output dim at the tile: batch scalars, rows, columns."""
        rank = len(self.shape)
        if self.shape[dim] == 1:
            return None
        if dim == rank - 2:
            return "rm[:, None]"
        if dim == rank - 1:
            return "rn[None, :]"
        return self.out_bnames[dim]

    def epilogue(self, accs: list[str]) -> None:
        """Elementwise ops on the accumulators `accs` (one per matmul, the columns `rn` of the
        output tile) and the D tensors there, then stores."""
        em, region, body = self.em, self.region, self.body
        rank = len(self.shape)
        M, N = self.M, self.N
        cat = Compute.I32 if self.integer else Compute.F32
        vals: dict[int, Val] = {mm: Val(acc, cat) for mm, acc in zip(self.matmuls, accs, strict=True)}
        vals.update({v: Val(f"stat{j}[:, None]", Compute.F32) for j, v in enumerate(self.stats)})
        self.batch_sum_values(vals)
        # prologue ops are done inside the K loop; an input may feed both an operand and the
        # epilogue, and so may a constant or scalar op, which the epilogue computes again
        skip = self.plan.prologue_only | set(self.matmuls) | set(self.stats) | set(self.sums) \
            | self.plan.scale_ops
        for i, inp in enumerate(region.inputs):
            if i in skip or not self._used_in_epilogue(i, skip):
                continue
            if inp.type.rank == 0:  # (read once per program where a prologue reads it too)
                vals[i] = self.prologue_scalars[i] if i in self.prologue_scalars else self.scalar_input(i)
            else:
                vals[i] = self.load_d(i, inp.type.shape, rank)

        def index(op: Op) -> Val:
            axis = op.attr("axis") + rank - len(op.shape)
            expr = self.out_index(axis) if op.shape[op.attr("axis")] != 1 else None
            return em.index(expr)

        em.run(region, vals, index, skip=lambda v: v in skip)
        tile_mask = f"(rm[:, None] < {M}) & (rn[None, :] < {N})"
        for j, v in enumerate(region.outputs):
            c = self.outs[j]
            ptrs = tile_ptrs(c, rank, self.out_bnames, "rm[:, None]", "rn[None, :]",
                             "[BLOCK_M, BLOCK_N // 2]")
            body(f"tl.store({ptrs}, {em.store_value(vals[v], region.value_type(v))}, "
                 f"mask={tile_mask})")

    def batch_sum_values(self, vals: dict[int, Val]) -> None:
        """The batch sums' values from the accumulator, which summed the product over their
        axes: a mean divides by its axis's size."""
        previous = self.mm
        if self.plan.batch_scales:  # the accumulator summed the scaled products
            previous = self.plan.batch_scales[-1]
            vals[previous] = vals[self.mm]
        for v in self.sums:
            rop = self.region.ops[v - self.n_in]
            val = vals[previous]
            if rop.op.kind == "mean":
                shape = self.region.value_type(previous).shape
                size = self.sig.size(shape[rop.op.attr("axis") % len(shape)])
                val = self.em.assign(f"{self.em.convert(val, Compute.F32).text} / {size}", Compute.F32)
            vals[v] = val
            previous = v

    def scalar_input(self, i: int) -> Val:
        """Rank-0 input `i`: a by-value argument, or the one element of a 0-d tensor another
        kernel stored."""
        inp = self.region.inputs[i]
        if inp.scalar:
            return self.em.scalar(self.scalars[i], inp.type)
        return self.em.load(f"tl.load({self.zero_dim[i]})", inp.type)

    def _used_in_epilogue(self, i: int, skip: set[int]) -> bool:
        """Does the epilogue read input `i` element for element (a gathered input is read
        through its pointer)?"""
        return any(o == i and not ops.gathers_at(r.op.kind, slot)
                   for k, r in enumerate(self.region.ops) if self.n_in + k not in skip
                   for slot, o in enumerate(r.operands)) or i in self.region.outputs

    def load_d(self, i: int, shape, rank: int, names: list[str | None] | None = None) -> Val:
        """A D tensor at the output tile, read through its strides (broadcast dims: none);
        `names`: each dim's index at another tile of rank `rank` (the product's)."""
        ref = self.refs[i]
        lead = rank - len(shape)
        at = self.out_index if names is None else names.__getitem__
        indices = [at(lead + k) if shape[k] != 1 else None for k in range(len(shape))]
        offset = ref.offset(indices)
        if offset == "0":
            return self.em.load(f"tl.load({ref.ptr})", self.region.inputs[i].type)
        rows = "rm[:, None]" in indices
        cols = "rn[None, :]" in indices
        mask = {(True, True): f"(rm[:, None] < {self.M}) & (rn[None, :] < {self.N})",
                (True, False): f"(rm < {self.M})[:, None]", (False, True): f"(rn < {self.N})[None, :]",
                (False, False): None}[(rows, cols)]
        return self.em.load_at(f"{ref.ptr} + {offset}", mask, self.region.inputs[i].type)

    # --- launch --------------------------------------------------------------------------------

    def launch_rules(self):
        user = {n: hint(self.hints, n, 0) for n in (*DOT_HINTS, "GROUP_M", "num_warps", "num_stages")}
        shape = self.shape
        k_dim = self.region.inputs[self.sources[0]].type.shape[-1]
        dot = self.dots[0]
        batch = self.batch
        summed = self.summed_dims()
        # 128 x 256 and 256 x 128 tiles: not with a prologue tile or a second accumulator
        wide = not self.plan.has_prologue and not self.plan.duals
        # an epilogue calling f64 slow paths keeps every live value of its half tile across
        # them: sin, cos and tan spill 2 KB at 128 x 256; a normal random number (Box-Muller's
        # log, sqrt and cos) 8 KB at 128 x 128, none at 128 x 64
        kinds = {r.op.kind for r in self.region.ops}
        normal = any(r.op.kind == "random" and r.op.attr("dist") == "normal" for r in self.region.ops)
        slow = any(ops.units(k) >= ops.SLOW_PATH_UNITS for k in kinds)
        # a grouped dual GEMM computes both B tiles' addresses beside its two accumulators: 24
        # bytes spill at 128 x 128 (Mixtral's SwiGLU experts), none at 128 x 64
        grouped_dual = self.segment is not None and bool(self.plan.duals)
        most = 128 * 64 if normal or grouped_dual else 128 * 128 if slow else None
        allowed = [c for c in HOPPER_CONFIGS if most is None or c[0] * c[1] <= most]
        # an epilogue of cheap ops only (scales, bias, casts: composable-kernel's multi-D
        # products): the 128 x 256 default; one activation may spill there (mish 600 bytes,
        # softplus 56), so those start at 128 x 128 and the autotuner tries the wide tile
        light = all(ops.units(r.op.kind) <= 1 for r in self.region.ops
                    if ops.is_elementwise(r.op.kind) and r.op.type.rank > 0)

        rows = shape[-3] if self.segment is not None else shape[-2]  # (a grouped GEMM's: T)

        def sizes(dims: Mapping[str, int]) -> tuple[int, int, int]:
            m, n, k = (evaluate(d, dims) for d in (rows, shape[-1], k_dim))
            return m, n, k

        def config(dims: Mapping[str, int], bm: int, bn: int, bk: int, warps: int,
                   stages: int, persistent: bool = False, splits: int | None = None) -> LaunchConfig:
            """`splits`: the programs a tile's K loop is shared among (None: as `split_count`
            gives for these blocks; a persistent grid never splits)."""
            m, n, k = sizes(dims)
            tiles = cdiv(m, bm) * cdiv(n, bn) * numel(batch, dims)
            if splits is None:
                # a batch sum's tile walks the K loop of every element it sums
                steps = cdiv(k, bk) * numel(summed, dims)
                # (a grouped GEMM's K loop runs once per index of its rows: never split)
                splits = 1 if persistent or self.segment is not None else \
                    split_count(tiles, steps, hint(self.hints, "SPLITS", 0))
            constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": user["GROUP_M"] or 8,
                          "SPLITS": splits}
            programs = min(tiles, sm_count()) if persistent else tiles * splits
            return LaunchConfig((programs,), constexprs, warps, stages, persistent)

        def default(dims: Mapping[str, int]) -> tuple[int, int, int, int, int]:
            """The first configuration of the list, or 128 x 256 where the kernel takes it and
            its tiles fill the GPU once (see `configure`)."""
            m, n, _ = sizes(dims)
            tiles = cdiv(m, 128) * cdiv(n, 256) * numel(batch, dims)
            if wide and light and n > 128 and tiles >= sm_count() and WIDE_DEFAULT in allowed:
                return WIDE_DEFAULT
            return allowed[0]

        def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
            m, n, k = sizes(dims)
            if device == "cuda":
                # the first configuration of the list (128 x 128 x 64, 8 warps), or 128 x
                # 256 (Triton's persistent-matmul tutorial's) where the kernel takes it and
                # its tiles fill the GPU once: the K loop's per-step costs over twice the
                # multiply-adds; 64 x 64 for small problems
                if m >= 128 and n >= 128:
                    bm, bn, bk, warps, stages = default(dims)
                    # f32 dots run on the FMA units; 8-bit ones take 128 of K a step (the
                    # bytes of a 16-bit 64: 64 left fp8 GEMMs issue-bound, `tiledsl ptx`)
                    bk = 32 if dot is DType.F32 else 128 if dot.itemsize == 1 else bk
                    return config(dims, user["BLOCK_M"] or bm, user["BLOCK_N"] or bn,
                                  user["BLOCK_K"] or bk, user["num_warps"] or warps,
                                  user["num_stages"] or stages)
                big = 64
                bk_cap = 64 if dot is not DType.F32 else 32
            else:  # the interpreter: few, large programs
                big, bk_cap = 128, 128
            bm = user["BLOCK_M"] or max(16, min(next_pow2(m), big))
            bn = user["BLOCK_N"] or max(16, min(next_pow2(n), big))
            # an f8 or i8 dot takes 32 values of K at a time
            bk = user["BLOCK_K"] or max(32 if dot.itemsize == 1 else 16, min(next_pow2(k), bk_cap))
            warps = user["num_warps"] or (8 if bm * bn >= 128 * 128 else 4)
            return config(dims, bm, bn, bk, warps, user["num_stages"] or 3)

        def candidates(dims: Mapping[str, int], device: str) -> list[LaunchConfig]:
            """Hopper configurations worth timing for these sizes (none: use `configure`)."""
            m, n, k = sizes(dims)
            if device != "cuda" or m < 128 or n < 128 or dot is DType.F32:
                return []
            first = default(dims)
            configs = [first] + [c for c in allowed if c != first]
            if dot.itemsize == 1:  # 8-bit operands: a K step of 128 moves the bytes a 16-bit 64 does
                configs = [(bm, bn, 128, w, s) for bm, bn, _, w, s in configs[:3]] + configs
            # every candidate splits as `configure` does: the workspace is sized by it
            splits = configure(dims, device).constexprs["SPLITS"]
            found = [config(dims, bm, bn, bk, w, s, splits=splits) for bm, bn, bk, w, s in configs
                     if bm <= next_pow2(m) and bn <= next_pow2(n) and bk <= max(16, next_pow2(k))
                     and (wide or bm * bn <= 128 * 128)]
            # the default first; the first two candidates (128 x 128 and 128 x 256 where the
            # kernel takes it) on a persistent grid too: one program per SM walks the tiles in
            # grouped order (no launch tail of partial waves); not where the tiles are so few
            # that the K loop splits
            if splits == 1:
                found += [config(dims, c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"],
                                 c.constexprs["BLOCK_K"], c.num_warps, c.num_stages, persistent=True)
                          for c in found[:2]]
            return hinted_first(configure(dims, device) if any(user.values()) else None, found)

        def workspace(dims: Mapping[str, int], target: str) -> tuple[tuple[int, str], ...]:
            """The partials of a split call, laid out per output element ([SPLITS, batch, M,
            N] for each accumulator, [SPLITS, batch, M] for each row statistic), whatever
            blocks the launch autotunes to; none unsplit."""
            splits = configure(dims, target).constexprs["SPLITS"]
            m, n, _ = sizes(dims)
            rows = splits * numel(batch, dims) * m if splits > 1 else 0
            acc = "int32" if self.integer else "float32"
            return (((rows * n, acc),) * len(self.matmuls)) + (((rows, "float32"),) * len(self.stats))

        def combine(dims: Mapping[str, int], device: str) -> LaunchConfig:
            """The combine's grid: a program per tile of its own blocks, none unsplit."""
            splits = configure(dims, device).constexprs["SPLITS"]
            m, n, _ = sizes(dims)
            big_m, big_n = (32, 128) if device == "cuda" else (128, 256)
            bm, bn = max(16, min(next_pow2(m), big_m)), max(32, min(next_pow2(n), big_n))
            tiles = cdiv(m, bm) * cdiv(n, bn) * numel(batch, dims) if splits > 1 else 0
            return LaunchConfig((tiles,), {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 1, "SPLITS": splits},
                                num_warps=4)

        return configure, candidates, workspace, combine


# split-K: output tiles that fill an H100's 132 SMs need no split; fewer share each tile's K
# loop among programs, aiming at two a SM (as split row programs do, `row_split.SPLIT_PROGRAMS`),
# each walking at least SPLIT_BLOCKS blocks of K. Numbers of the sizes only, never of the
# device, so every device adds up the same partials.
SPLIT_TILES = 132
SPLIT_PROGRAMS = 264
SPLIT_BLOCKS = 4


def split_count(tiles: int, k_blocks: int, hinted: int = 0) -> int:
    """The programs each of `tiles` output tiles shares its `k_blocks` blocks of K among:
    the SPLITS hint's (at most one a block), or enough for `SPLIT_PROGRAMS` programs."""
    if hinted:
        return max(1, min(hinted, k_blocks))
    if tiles == 0 or tiles >= SPLIT_TILES:
        return 1
    splits = min(cdiv(SPLIT_PROGRAMS, tiles), k_blocks // SPLIT_BLOCKS)
    return splits if splits >= 2 else 1


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The GEMM kernel, and its combine launch (which runs only where a call splits K)."""
    prog = GemmProgram(kernel, hints, allow_tf32)
    prog.emit()
    configure, candidates, workspace, combine_rule = prog.launch_rules()
    combine = GemmProgram(kernel, hints, allow_tf32)
    combine.emit_combine()
    then = finish(kernel, combine.sig, combine.body, combine_rule, combine.em, hints,
                  fn_name=f"{kernel.name}_combine")
    emitted = finish(kernel, prog.sig, prog.body, configure, prog.em, hints, workspace=workspace,
                     then=(then,))
    return emitted.with_candidates(candidates).with_k_major(prog.k_major)
