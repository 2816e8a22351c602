"""The flash-attention template: softmax(score_mod(q @ k.T)) @ v, one kernel, scores never
stored.

One program per (query block, batch element): it loads its q tile once, then
walks the keys in blocks of BLOCK_N. Per key block: the k tile (in K^T
orientation, through strides, so `k.T`, a pre-transposed `kt` and [B, N, H, D]
views all work), s = q @ kt in f32, the score modification (scales, biases
read at the [BLOCK_M, BLOCK_N] tile, index masks, soft-capping; any
elementwise ops, in f32), then the online softmax in base 2: the scores are
scaled by log2(e) once, the running max `m` and sum `l` are updated, the
accumulator is rescaled by exp2(m_old - m_new), and P, cast to v's dtype,
meets the v tile in the second dot. One normalisation at the end; the
epilogue runs on the normalised f32 tile before the one store.

Masks are true -inf. The running max is guarded where it is infinite, so rows
whose scores are all masked give 0 (and logsumexp -inf), never NaN; a row
with a NaN or +inf score is NaN, with logsumexp NaN or +inf, as torch gives.
Columns past the sequence end are masked to -inf, head dims are padded to a power of
two (BLOCK_D >= 16, tl.dot's smallest) with zeros. When the last op before
the softmax is a mask with a known key bound (`causal`, or any
`index(-2) + a >= index(-1) + b`), key blocks past the bound of the block's
last row are not visited, and query blocks run heaviest first. The bound is computed
where it cannot overflow, and kept only while the mask's i32 sums cannot wrap at the
call (`bound_offsets`): otherwise every key block is walked with the mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp, Op
from tiledsl.plans import AttentionPlan, KeyBound
from tiledsl.types import Compute, DType

from . import online, tma
from .base import (
    EmittedKernel,
    Hints,
    LaunchConfig,
    batch_names,
    cdiv,
    decompose,
    finish,
    fit_rows,
    hint,
    hinted_first,
    numel,
    require_dot_hints,
)
from .codegen import Code, Signature, next_pow2
from .expr import Emitter, Val, dot_kwargs, inputs_read, literal, with_scalar_operands
from .matmul import operand_tile, tile_ptrs
from .online import NEG_INF

LOG2E = 1.4426950408889634
I32_MIN, I32_MAX = DType.I32.int_range


def transcendentals(kinds) -> int:
    """The score ops whose registers count (several of them per score spill 128-key tiles):
    those costing a transcendental's `units` or more (a division, an exp, a tanh)."""
    return sum(ops.units(k) >= 4 for k in kinds)


LN2 = 0.6931471805599453
DOT_HINTS = ("BLOCK_M", "BLOCK_N")
# Hopper configurations, (BLOCK_M, BLOCK_N, warps, stages), by padded head dim, the first
# the default. Derived from the build Triton's launcher really makes (`tiledsl ptx --all`,
# sm_90, Triton 3.9, B=4 H=16 M=N=4096, f16, causal or not): every one compiles without
# spills and with wgmma N >= 64 at head dims 64 and 128. One warpgroup (4 warps) per 64
# query rows: 8 warps on a 64-row tile split the key tile and issue m64n32 wgmmas.
# 128 x 128 at head dim 128 with 3 stages takes 225 KiB of shared memory, under the 227
# an H100 block may have. At head dim 64, 128 x 128 is the default: the loop's overhead
# over twice the scores of 128 x 64 (static_sm90.py: 343 -> 265 warp instructions per
# 1000 scores, the reference's 254); programs drawing random numbers, or with many
# transcendental score ops, walk 64 keys.
HOPPER_CONFIGS = {
    64: ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)),
    128: ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3)),
    256: ((128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2)),
}


class AttentionProgram:
    def __init__(self, kernel: KernelOp, hints: Hints, allow_tf32: bool) -> None:
        require_dot_hints(hints, DOT_HINTS)
        self.kernel, self.hints, self.allow_tf32 = kernel, hints, allow_tf32
        self.region = region = kernel.region
        self.parts: AttentionPlan = kernel.plan
        parts = self.parts
        self.n_in = n_in = len(region.inputs)
        self.qk_op: Op = region.ops[parts.qk - n_in].op
        self.pv_op: Op = region.ops[parts.pv - n_in].op
        self.a_val, self.b_val = region.ops[parts.qk - n_in].operands
        self.v_val = parts.v
        self.q_src, self.k_src = parts.q_source, parts.k_source
        # operands gathered at index expressions (a paged cache): loaded through the index
        # the kernel computes over each tile, never through the source's strides
        self.gathered = {"q": self.has_take(parts.q_chain), "k": self.has_take(parts.k_chain),
                         "v": bool(parts.v_chain)}
        self.k_flipped = parts.k_transposed  # the k tensor is [.., N, D], read as K^T
        self.score_shape, self.out_shape = self.qk_op.shape, self.pv_op.shape
        self.batch = self.out_shape[:-2]
        self.sig, self.body = Signature(), Code()
        self.em = Emitter(self.body)

    def value_type(self, v: int):
        return self.region.value_type(v)

    # --- emission ---------------------------------------------------------------------------

    def declare_io(self) -> None:
        """Every input (tensors, by-value scalars, gathers' sources) and output as parameters:
        the walk's kernel and its combine take the same ones."""
        sig, region = self.sig, self.region
        self.refs = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
                     if not inp.scalar}
        self.scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
        self.em.gather_from(region, self.refs, sig.size)
        self.outs = [sig.tensor("out", j, self.value_type(v).shape) for j, v in enumerate(region.outputs)]

    def emit(self) -> None:
        sig, body, region, em, parts = self.sig, self.body, self.region, self.em, self.parts
        self.declare_io()
        self.M, self.N = sig.size(self.score_shape[-2]), sig.size(self.score_shape[-1])
        self.D = sig.size(self.value_type(self.a_val).shape[-1])
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV"):
            sig.constexpr(name)
        D = self.D

        body("pid = tl.program_id(0)")
        if parts.kv_split:  # SPLITS programs per (query block, batch index), one range of keys each
            sig.constexpr("SPLITS")
            body("if SPLITS > 1:")
            with body.indent():
                body("pid_s = pid % SPLITS")
                body("pid = pid // SPLITS")
        self.program_rows(reverse=parts.bound is not None)
        body("rd = tl.arange(0, BLOCK_D)")
        body("rn_base = tl.arange(0, BLOCK_N)")

        # q, k and v may come through TMA descriptors (zero-filled at the edges) where the
        # call's tensors allow it; the pointer path stays for the others
        # k's source tile: [BLOCK_N, BLOCK_D] read transposed, or [BLOCK_D, BLOCK_N] as it is
        k_blocks = ("BLOCK_N", "BLOCK_D") if self.k_flipped else ("BLOCK_D", "BLOCK_N")
        self.k_at = ("n0", "0") if self.k_flipped else ("0", "n0")
        self.tma = {
            "q": self.descriptors("q", self.q_src, parts.q_chain, self.qk_op.dtype, ("BLOCK_M", "BLOCK_D")),
            "k": self.descriptors("k", self.k_src, parts.k_chain, self.qk_op.dtype, k_blocks,
                                  flipped=self.k_flipped, swappable=True),
            "v": None if self.gathered["v"] else self.descriptors(
                "v", self.v_val, {self.v_val}, self.pv_op.dtype, ("BLOCK_N", "BLOCK_DV")),
        }
        # the rank-0 inputs the operand prologues read (a by-value scale, a 0-d tensor another
        # kernel stored), read once per program
        chains = set(parts.q_chain) | set(parts.k_chain) | set(parts.v_chain)
        self.prologue_scalars = {i: self.load(i, "score") for i in sorted(chains)
                                 if i < self.n_in and region.inputs[i].type.rank == 0}
        with self.tma_or_pointers("q", "q", ("pid_m * BLOCK_M", "0"), self.qk_op.dtype):
            operand_tile(em, region, "q", self.operand_ptrs("q", self.q_src, "rm[:, None]", "rd[None, :]",
                                                            "[BLOCK_M, BLOCK_D]"),
                         f"(rm[:, None] < {self.M}) & (rd[None, :] < {D})",
                         self.a_val, self.q_src, set(parts.q_chain), self.prologue_scalars, self.qk_op.dtype,
                         index=self.operand_index("q", "rm[:, None]", "rd[None, :]"))

        # values known for the whole program: scalars, rank-0 tensors, inputs that do not
        # vary along the keys
        outer: dict[int, Val] = {}
        score_inputs = inputs_read(self.region, parts.score_ops)
        for i in score_inputs:  # (a rank-0 one a prologue reads too is read once)
            if not self.varies_along_keys(i):
                outer[i] = self.prologue_scalars[i] if i in self.prologue_scalars else self.load(i, "score")
        self.run(outer, tuple(v for v in parts.score_ops if self.value_type(v).rank == 0), "score")
        self.outer = outer
        self.offsets = None if parts.bound is None else \
            bound_offsets(sig, body, em, outer, parts.bound, self.M, self.N)
        self.fold = self.scale_fold() if parts.softmax is not None else None
        if self.fold is not None:  # the scale and the base-2 conversion, one multiply per score
            scale = em.tensor(em.convert(self.fold[1], Compute.F32))
            body(f"qk_scale = {scale.text} * {LOG2E!r}")

        if parts.softmax is None:
            first = "sum"
        else:
            first = "online" if parts.p_out is None else "stats"
            body(f"m_i = tl.full([BLOCK_M], {NEG_INF}, tl.float32)")
            body("l_i = tl.zeros([BLOCK_M], dtype=tl.float32)")
        for k in range(len(parts.row_sums)):
            body(f"rs{k} = tl.zeros([BLOCK_M], dtype=tl.float32)")
        body("acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)")
        # the key blocks every row of this program keeps whole come first, with no masks
        # (no key tail, and no mask where the mask is the plan's bound alone); the rest
        # (the tail block, the blocks a mask cuts through) evaluate every mask
        offsets = self.offsets
        lower = offsets.lower if offsets is not None else None
        if parts.kv_split:  # this program's range of keys: whole blocks, every key at SPLITS 1
            body("if SPLITS > 1:")
            with body.indent():
                body(f"kv_chunk = tl.cdiv(tl.cdiv({self.N}, BLOCK_N), SPLITS) * BLOCK_N")
                body("kv_lo = pid_s * kv_chunk")
                body("kv_hi = kv_lo + kv_chunk")
            body("else:")
            with body.indent():
                body("kv_lo = 0")
                body(f"kv_hi = {self.N}")
        start = "0"
        if lower is not None:
            # a window's start: blocks before the first row's are skipped; for an exact mask
            # the blocks before the last row's start are cut by it
            start = "n_lo"
            body(f"n_hi = {self.key_limit()}")
            n_lo = f"tl.maximum(0, pid_m * BLOCK_M{lower.text()}) // BLOCK_N * BLOCK_N"
            body(f"n_lo = {offsets.limit(f'tl.minimum({self.N}, {n_lo})' if offsets.wide else n_lo)}")
            if parts.bound.exact:
                start = "n_in"
                last_row = f"(pid_m + 1) * BLOCK_M - 1{lower.text()}"
                body("n_in = " + offsets.limit(f"tl.minimum(tl.maximum(n_lo, (tl.maximum(0, {last_row}) "
                                               "+ BLOCK_N - 1) // BLOCK_N * BLOCK_N), n_hi)"))
                body(f"for n0 in range({self.keys_from('n_lo', 'n_in')}, BLOCK_N):")
                with body.indent():
                    self.key_block(masked=True, score_inputs=score_inputs, phase=first)
        body(f"n_full = {self.full_blocks_end()}")
        if start != "0":
            body(f"n_full = tl.maximum({start}, n_full)")
        if offsets is not None and offsets.ok is not None and parts.bound.exact:
            # where the mask's arithmetic wraps at this call, no block runs without the mask
            body(f"n_full = tl.where({offsets.ok}, n_full, {start})")
        body(f"for n0 in range({self.keys_from(start, 'n_full')}, BLOCK_N):")
        with body.indent():
            self.key_block(masked=False, score_inputs=score_inputs, phase=first)
        end = "n_hi" if lower is not None else self.key_limit()
        body(f"for n0 in range({self.keys_from('n_full', end)}, BLOCK_N):")
        with body.indent():
            self.key_block(masked=True, score_inputs=score_inputs, phase=first)
        if parts.kv_split:  # a split program leaves its partials; the combine launch finishes
            body("if SPLITS > 1:")
            with body.indent():
                self.store_partials()
            body("else:")
            with body.indent():
                if parts.softmax is not None:
                    self.normalisers()
                self.finish_rows()
            return
        if parts.softmax is not None:
            self.normalisers()
        if parts.p_out is not None:
            # a returned P: the statistics are final, so a second walk over every key block
            # (masks applied, nothing skipped: P is written whole) stores P and sums P @ v
            body(f"m_fin2 = {online.finite('m_i')}")
            body("acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)")
            body(f"for n0 in range(0, {self.N}, BLOCK_N):")
            with body.indent():
                self.key_block(masked=True, score_inputs=score_inputs, phase="probabilities")
        self.finish_rows()

    def program_rows(self, reverse: bool) -> None:
        """The program's query block and batch index from `pid`, its rows `rm` and output
        columns `rdv`; `reverse`: the blocks of the longest rows (a mask's bound) first."""
        sig, body = self.sig, self.body
        self.M = sig.size(self.score_shape[-2])
        self.DV = sig.size(self.out_shape[-1])
        body(f"m_blocks = tl.cdiv({self.M}, BLOCK_M)")
        body("pid_b = pid // m_blocks")
        if reverse:  # the longest rows first: they bound the launch's tail
            body("pid_m = m_blocks - 1 - pid % m_blocks")
        else:
            body("pid_m = pid % m_blocks")
        self.bnames: list[str | None] = batch_names(self.batch)
        if self.batch:
            body("pb = pid_b.to(tl.int64)")
            decompose(body, "pb", self.batch, self.bnames, sig.size, "pq")
        body("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        body("rdv = tl.arange(0, BLOCK_DV)")

    def keys_from(self, start: str, end: str) -> str:
        """A walk's range of key blocks, `start, end`, within this program's keys when they
        may be split."""
        if not self.parts.kv_split:
            return f"{start}, {end}"
        return f"{'kv_lo' if start == '0' else f'tl.maximum({start}, kv_lo)'}, tl.minimum({end}, kv_hi)"

    # --- split-KV: partials and their combine -----------------------------------------------

    def statistics(self) -> list[str]:
        """What a split program leaves per query row beside its output: the running max and
        sum of a softmax, then each sum over the keys."""
        online_state = ["m_i", "l_i"] if self.parts.softmax is not None else []
        return online_state + [f"rs{k}" for k in range(len(self.parts.row_sums))]

    def partial_rows(self, split: str) -> None:
        """`ws_row`: the workspace rows of this program's query rows in split `split`'s
        partials ([SPLITS, batch, M] rows, whatever the blocks), and `ws_mask`."""
        self.body(f"ws_row = (({split} * {self.sig.numel(self.batch, 'n_batch')} + pid_b) * {self.M} "
                  "+ rm).to(tl.int64)")
        self.body(f"ws_mask = rm < {self.M}")

    def store_partials(self) -> None:
        """This program's unnormalised output and statistics, over its range of keys, in the
        workspaces: f32 [SPLITS, batch, M, DV] and [SPLITS, batch, M, statistics]."""
        body = self.body
        self.partial_rows("pid_s")
        work = self.sig.workspace(0)
        body(f"tl.store({work} + ws_row[:, None] * {self.DV} + rdv[None, :], acc, "
             f"mask=ws_mask[:, None] & (rdv < {self.DV})[None, :])")
        stats = self.statistics()
        if stats:
            work1 = self.sig.workspace(1)
            for k, name in enumerate(stats):
                body(f"tl.store({work1} + ws_row * {len(stats)} + {k}, {name}, mask=ws_mask)")

    def emit_combine(self) -> None:
        """The combine launch: one program per (query block, batch index) merges the SPLITS
        partials of its rows in split order (an online softmax's outputs rescaled by their
        maxima, as the walk rescales key blocks; sums added), then normalises, computes the
        logsumexp, runs the epilogue and stores, as the unsplit kernel does."""
        sig, body, parts = self.sig, self.body, self.parts
        # (every input: the epilogue reads some, the rank-0 values it computes again others,
        # a gather its source)
        self.declare_io()
        for name in ("BLOCK_M", "BLOCK_DV", "SPLITS"):
            sig.constexpr(name)
        body("pid = tl.program_id(0)")
        self.program_rows(reverse=False)
        softmax = parts.softmax is not None
        if softmax:
            body(f"m_i = tl.full([BLOCK_M], {NEG_INF}, tl.float32)")
            body("l_i = tl.zeros([BLOCK_M], dtype=tl.float32)")
        for k in range(len(parts.row_sums)):
            body(f"rs{k} = tl.zeros([BLOCK_M], dtype=tl.float32)")
        body("acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)")
        stats = self.statistics()
        body("for sp in range(0, SPLITS):")
        with body.indent():
            self.partial_rows("sp")
            body(f"o_s = tl.load({sig.workspace(0)} + ws_row[:, None] * {self.DV} + rdv[None, :], "
                 f"mask=ws_mask[:, None] & (rdv < {self.DV})[None, :], other=0.0)")
            loaded = {}
            for k, name in enumerate(stats):
                other = NEG_INF if name == "m_i" else "0.0"
                loaded[name] = f"{name}_s"
                body(f"{name}_s = tl.load({sig.workspace(1)} + ws_row * {len(stats)} + {k}, mask=ws_mask, "
                     f"other={other})")
            if softmax:  # both partials rescaled to the larger max (1 where it did not move)
                body("m_new = tl.maximum(m_i, m_i_s)")
                body(f"m_safe = {online.finite('m_new')}")
                body(f"alpha = {online.rescale('m_i', 'm_new', 'm_safe', exp='tl.exp2')}")
                body(f"beta = {online.rescale('m_i_s', 'm_new', 'm_safe', exp='tl.exp2')}")
                body("l_i = l_i * alpha + l_i_s * beta")
                body("acc = acc * alpha[:, None] + o_s * beta[:, None]")
                body("m_i = m_new")
            else:
                body("acc = acc + o_s")
            for k in range(len(parts.row_sums)):
                body(f"rs{k} = rs{k} + rs{k}_s")
        if softmax:
            self.normalisers()
        self.finish_rows()

    def key_block(self, masked: bool, score_inputs: list[int], phase: str = "online") -> None:
        """One step over the key block at n0. Unmasked blocks lie inside the keys and, for an
        exact mask bound, inside the mask for every row. `phase`: "online", the online softmax
        and p @ v; "stats", its running max and sum only; "probabilities", with the row
        statistics final, the normalised P stored and multiplied by v (a returned P); "sum",
        with no softmax, the scores' function times v, added up as it is."""
        body, em, region, parts = self.body, self.em, self.region, self.parts
        N, D = self.N, self.D
        body("rn = n0 + rn_base")
        k_rows, k_cols = ("rn[None, :]", "rd[:, None]") if self.k_flipped else \
            ("rd[:, None]", "rn[None, :]")
        k_ptrs = self.operand_ptrs("k", self.k_src, k_rows, k_cols, "[BLOCK_D, BLOCK_N]")
        k_mask = f"(rd[:, None] < {D}) & (rn[None, :] < {N})" if masked else f"rd[:, None] < {D}"
        with self.tma_or_pointers("k", "kt", self.k_at, self.qk_op.dtype):
            operand_tile(em, region, "kt", k_ptrs, k_mask, self.b_val, self.k_src, set(parts.k_chain),
                         self.prologue_scalars, self.qk_op.dtype,
                         index=self.operand_index("k", k_rows, k_cols))
        body(f"s = tl.dot(q, kt{dot_kwargs(self.qk_op.dtype, self.allow_tf32)})")
        vals = dict(self.outer)
        vals[parts.qk] = Val("s", Compute.F32)
        for i in score_inputs:
            if i not in vals:
                vals[i] = self.load(i, "score")
        score_ops, scores = parts.score_ops, parts.scores
        if phase == "sum":
            self.sum_step(vals, masked)
            self.pv_step(masked, phase)
            return
        if not masked and parts.bound is not None and parts.bound.exact:
            # the mask keeps every score here: its where is its kept operand
            _, scores, _ = region.ops[scores - self.n_in].operands
        folded = self.fold is not None and self.fold[0] == scores
        if folded:  # s * scale is computed with the base-2 conversion
            scores = parts.qk
        needed = region.depends(scores).union(*(region.depends(x) for x in self.summed()))
        self.run(vals, tuple(v for v in score_ops if v in needed), "score")
        if phase != "probabilities":
            self.add_row_sums(vals, masked)
        # the online softmax in base 2; columns past the keys are -inf
        x = em.tensor(em.convert(vals[scores], Compute.F32))
        if folded:
            t = f"{x.text} * qk_scale"
        elif x.text in em.scaled:  # a tile times a scalar: one multiply by (scalar * log2 e)
            base, scalar = em.scaled[x.text]
            t = f"{base.text} * ({scalar.text} * {LOG2E!r})"
        else:
            t = f"{x.text} * {LOG2E!r}"
        if masked:
            body(f"t = tl.where((rn < {N})[None, :], {t}, {NEG_INF})")
        else:
            body(f"t = {t}")
        if phase == "probabilities":
            body("p = tl.exp2(t - m_fin2[:, None]) * inv[:, None]")
            self.modify_probabilities(vals)  # P returned is the modified one p @ v reads
            (j,) = [j for j, v in enumerate(region.outputs) if v == parts.p_out]
            t_p = self.value_type(parts.p_out)
            ptrs = tile_ptrs(self.outs[j], t_p.rank, self.bnames, "rm[:, None]", "rn[None, :]",
                             "[BLOCK_M, BLOCK_N]")
            body(f"tl.store({ptrs}, {em.store_value(Val('p', Compute.F32), t_p)}, "
                 f"mask=(rm[:, None] < {self.M}) & (rn[None, :] < {N}))")
        else:
            body("m_new = tl.maximum(m_i, tl.max(t, 1))")
            # an infinite max is replaced by 0: -inf (all masked so far) gives p = 0, +inf
            # (torch: a NaN row, logsumexp +inf) gives l_i = +inf, never inf - inf
            body(f"m_safe = {online.finite('m_new')}")
            body(f"alpha = {online.rescale('m_i', 'm_new', 'm_safe', exp='tl.exp2')}")
            body("p = tl.exp2(t - m_safe[:, None])")
            body("l_i = l_i * alpha + tl.sum(p, 1)")
            if phase == "stats":
                body("m_i = m_new")
                return
            self.modify_probabilities(vals)  # its sum already in the normaliser
        self.pv_step(masked, phase)

    def modify_probabilities(self, vals: dict[int, Val]) -> None:
        """`p` becomes what p @ v reads: the ops linear in the probabilities (dropout's
        mask and scale) applied to this key block's p, with the score ops they read that the
        block skipped (an exact mask's index). Nothing when there are none."""
        region, parts = self.region, self.parts
        if not parts.p_ops:
            return
        vals[parts.softmax] = Val("p", Compute.F32)
        needed = set().union(*(region.depends(x) for x in parts.p_ops))
        todo = (*parts.score_ops, *parts.p_ops)
        self.run(vals, tuple(v for v in todo if v in needed and v not in vals), "score")
        modified = vals[region.ops[parts.pv - self.n_in].operands[0]]
        self.body(f"p = {self.em.tensor(self.em.convert(modified, Compute.F32)).text}")

    def sum_step(self, vals: dict[int, Val], masked: bool) -> None:
        """With no softmax: p, the scores' function, and the sums over the keys at this key
        block, columns past the keys 0 (a score function of a zero-padded key is not)."""
        region, parts, bound = self.region, self.parts, self.parts.bound
        if not masked and bound is not None and bound.exact and parts.bound_cond is not None:
            vals[parts.bound_cond] = literal(True, Compute.BOOL)  # the mask keeps the whole tile
        needed = region.depends(parts.scores).union(*(region.depends(x) for x in self.summed()))
        self.run(vals, tuple(v for v in parts.score_ops if v in needed), "score")
        self.add_row_sums(vals, masked)
        self.body(self.key_tail("p", vals[parts.scores], masked))

    def summed(self) -> list[int]:
        """The score-space values summed over the keys beside p @ v."""
        return [self.region.ops[v - self.n_in].operands[0] for v in self.parts.row_sums]

    def add_row_sums(self, vals: dict[int, Val], masked: bool) -> None:
        for k, x in enumerate(self.summed()):
            self.body(self.key_tail(f"rx{k}", vals[x], masked))
            self.body(f"rs{k} = rs{k} + tl.sum(rx{k}, 1)")

    def key_tail(self, name: str, val: Val, masked: bool) -> str:
        """`name = val` in f32, 0 in the columns past the keys (a function of a zero-padded
        key's score is not 0)."""
        x = self.em.tensor(self.em.convert(val, Compute.F32)).text
        return f"{name} = tl.where((rn < {self.N})[None, :], {x}, 0.0)" if masked else f"{name} = {x}"

    def pv_step(self, masked: bool, phase: str) -> None:
        """p (f32, this key block's) times the v tile, added to the accumulator (rescaled
        first by the online softmax)."""
        body, em, region = self.body, self.em, self.region
        N, DV = self.N, self.DV
        v_ptrs = self.operand_ptrs("v", self.v_val, "rn[:, None]", "rdv[None, :]", "[BLOCK_N, BLOCK_DV]")
        v_mask = f"(rn[:, None] < {N}) & (rdv[None, :] < {DV})" if masked else f"rdv[None, :] < {DV}"
        with self.tma_or_pointers("v", "vt", ("n0", "0"), self.pv_op.dtype):
            operand_tile(em, region, "vt", v_ptrs, v_mask, self.v_val, self.v_val,
                         set(self.parts.v_chain) or {self.v_val}, self.prologue_scalars, self.pv_op.dtype,
                         index=self.operand_index("v", "rn[:, None]", "rdv[None, :]"))
        pv_dtype = self.pv_op.dtype
        body(f"p = {em.narrow('p', pv_dtype)}")
        if pv_dtype is DType.BF16:
            body("if INTERPRETER:")
            with body.indent():
                body(f"p = {em.widen('p', DType.BF16)}")
        if phase in ("probabilities", "sum"):
            body(f"acc = tl.dot(p, vt, acc{dot_kwargs(pv_dtype, self.allow_tf32)})")
            return
        body("acc = acc * alpha[:, None]")
        body(f"acc = tl.dot(p, vt, acc{dot_kwargs(pv_dtype, self.allow_tf32)})")
        body("m_i = m_new")

    def descriptors(self, name: str, src: int, chain, dot: DType, tile: tuple[str, str],
                    flipped: bool = False, swappable: bool = False) -> tma.Descriptors | None:
        """TMA descriptors for an operand that is its source tensor as it is (transposes
        aside): `tile` is the block of the source's last two dims, `flipped` says the operand
        is that block transposed."""
        t, n_in = self.region.inputs[src].type, self.n_in
        plain = all(v == src or (v >= n_in and self.region.ops[v - n_in].op.kind == "transpose")
                    for v in chain)
        if not plain or not tma.eligible(t, dot):
            return None
        return tma.declare(self.sig, self.body, name, src, self.refs[src], t, tile, flipped, swappable)

    def tma_or_pointers(self, role: str, target: str, at: tuple[str, str], dot: DType):
        return tma.load_or_pointers(self.em, self.tma[role], target, at, self.bnames, dot)

    def scale_fold(self) -> tuple[int, Val] | None:
        """(the value, its scale) when the scores of the unmasked key blocks are q @ k.T
        times a scalar known for the whole program: that multiply and the base-2
        conversion's fold into one multiply by `qk_scale`."""
        parts, region, n_in = self.parts, self.region, self.n_in
        x = parts.scores
        if parts.bound is not None and parts.bound.exact:
            _, x, _ = region.ops[x - n_in].operands
        if x < n_in or region.ops[x - n_in].op.kind != "mul":
            return None
        a, b = region.ops[x - n_in].operands
        other = b if a == parts.qk else (a if b == parts.qk else None)
        if other is None or self.value_type(other).rank != 0:
            return None
        if other in self.outer:
            return x, self.outer[other]
        op = region.ops[other - n_in].op if other >= n_in else None
        if op is not None and op.kind == "const":
            return x, literal(op.attr("value"), Compute.F32)
        return None

    def key_limit(self) -> str:
        """How far this program walks the keys: all of them, or up to a mask's bound (the
        last row's, exclusive)."""
        offsets = self.offsets
        if offsets is None:
            return self.N
        last_row = f"(pid_m + 1) * BLOCK_M{offsets.upper.text()}"
        return offsets.limit(f"tl.minimum({self.N}, tl.maximum(0, {last_row}))")

    def full_blocks_end(self) -> str:
        """Where the key blocks that need no mask end: the last whole block of keys, and
        for an exact mask bound the last block the first row keeps whole."""
        whole = f"{self.N} // BLOCK_N * BLOCK_N"
        offsets = self.offsets
        if offsets is None:
            return whole
        if not self.parts.bound.exact:
            return f"tl.minimum({whole}, tl.maximum(0, {self.key_limit()}) // BLOCK_N * BLOCK_N)"
        first_row = f"pid_m * BLOCK_M + 1{offsets.upper.text()}"
        return offsets.limit(f"tl.minimum({whole}, tl.maximum(0, {first_row}) // BLOCK_N * BLOCK_N)")

    def normalisers(self) -> None:
        """1 / the row sums, once the recurrence is finished. All masked: l_i == 0, output 0,
        lse -inf; a NaN score makes l_i NaN and a +inf one m_i +inf: the row is NaN like
        torch's softmax, lse NaN or +inf like torch's logsumexp."""
        self.body(f"nan_row = {online.nan_row('m_i', 'l_i')}")
        self.body(f'inv = tl.where(nan_row, float("nan"), {online.positive_inverse("l_i")})')

    def finish_rows(self) -> None:
        """Normalise the output (a returned P was normalised already), compute logsumexp,
        run the epilogue, store."""
        body, em, region, parts = self.body, self.em, self.region, self.parts
        body("o = acc" if parts.p_out is not None or parts.softmax is None else "o = acc * inv[:, None]")
        vals: dict[int, Val] = {parts.pv: Val("o", Compute.F32)}
        # one value per query row: a logsumexp, a sum over the keys
        per_row = {v: "lse" for v in parts.lse} | {v: f"rs{k}" for k, v in enumerate(parts.row_sums)}
        if parts.lse:
            body('m_fin = tl.where(m_i == float("inf"), 0.0, m_i)')
            body(f"lse = tl.where(l_i > 0.0, (m_fin + tl.log2(l_i)) * {LN2!r}, "
                 f'tl.where(l_i == 0.0, {NEG_INF}, float("nan")))')
        for v, name in per_row.items():  # with a kept key dim: broadcast along the output's
            keepdims = self.value_type(v).rank == len(self.score_shape)
            vals[v] = Val(f"{name}[:, None]" if keepdims else name, Compute.F32)
        for i in inputs_read(self.region, parts.epilogue):
            vals[i] = self.load(i, "out")
        self.run(vals, parts.epilogue, "out")
        M, DV = self.M, self.DV
        row_shape = self.out_shape[:-1] + (1,)
        for j, v in enumerate(region.outputs):
            if v == parts.p_out:  # stored by the second walk over the keys
                continue
            t = self.value_type(v)
            text = em.store_value(Val(per_row[v], Compute.F32) if v in per_row else vals[v], t)
            ref = self.outs[j]
            if v in per_row or (t.shape in (row_shape, row_shape[:-1]) and row_shape != self.out_shape):
                # one value per query row (a value of the epilogue per row with the key dim kept
                # is a [BLOCK_M, 1] tile, without it a [BLOCK_M] one)
                shape = t.shape[:len(self.score_shape) - 1]  # without a kept size-1 key dim
                column = v not in per_row and t.rank == len(self.score_shape)
                rows = [*self.space_indices("score")[:-2], "rm[:, None]" if column else "rm"]
                idx = [None if d == 1 else rows[len(rows) - len(shape) + k] for k, d in enumerate(shape)]
                offset = ref.offset(idx + [None] * (t.rank - len(shape)))
                mask = f"(rm < {M})[:, None]" if column else f"rm < {M}"
                row = "rm[:, None]" if column else "rm"
                if row not in idx:  # one query row (a literal 1): row 0's lane stores it, by a pointer tile
                    offset = f"{offset} + 0 * {row}"
                    if column:
                        text = f"tl.broadcast_to({text}, [BLOCK_M, 1])"
                body(f"tl.store({ref.ptr} + {offset}, {text}, mask={mask})")
            else:
                ptrs = tile_ptrs(ref, t.rank, self.bnames, "rm[:, None]", "rdv[None, :]",
                                 "[BLOCK_M, BLOCK_DV]")
                store = f"tl.store({ptrs}, {text}, mask=(rm[:, None] < {M}) & (rdv[None, :] < {DV}))"
                if t.shape != self.out_shape or 1 in t.shape or t.dtype not in (DType.F16, DType.BF16) \
                        or t.weak:
                    body(store)
                    continue
                # a whole output tile through a TMA descriptor (rows past M are clipped)
                flag = self.sig.tma_ready(j, role="out")
                block = ", ".join(["1"] * len(self.batch) + ["BLOCK_M", "BLOCK_DV"])
                body(f"if {flag}:")
                with body.indent():
                    body(f"out_desc = tl.make_tensor_descriptor({ref.ptr}, "
                         f"shape=[{', '.join(self.sig.size(d) for d in t.shape)}], "
                         f"strides=[{ref.descriptor_strides(range(t.rank))}], block_shape=[{block}])")
                    body(f"out_desc.store([{tma.coordinates(self.bnames, ['pid_m * BLOCK_M', '0'])}], "
                         f"({text}).reshape([{block}]))")
                body("else:")
                with body.indent():
                    body(store)

    # --- helpers -------------------------------------------------------------------------------

    def tile(self, i: int, rows: str, cols: str, shape: str) -> str:
        return tile_ptrs(self.refs[i], self.value_type(i).rank, self.bnames, rows, cols, shape)

    def has_take(self, chain) -> bool:
        return any(v >= self.n_in and self.region.ops[v - self.n_in].op.kind == "take" for v in chain)

    def operand_ptrs(self, role: str, src: int, rows: str, cols: str, shape: str) -> str | None:
        """`{role}_ptrs`, the pointers of an operand's source tile, assigned; None for a
        gathered operand (its gather loads the tile)."""
        if self.gathered[role]:
            return None
        self.body(f"{role}_ptrs = {self.tile(src, rows, cols, shape)}")
        return f"{role}_ptrs"

    def operand_index(self, role: str, rows: str, cols: str):
        """The `index` ops of a gathered operand's chain at its tile (None when it is not
        gathered): along the batch dims the program's, along the last two `rows` and `cols`
        (the tile's indices in the gather's orientation)."""
        if not self.gathered[role]:
            return None

        def index(op: Op) -> Val:
            rank, axis = len(op.shape), op.attr("axis") % len(op.shape)
            if op.shape[axis] == 1:
                return self.em.index(None)
            if axis >= rank - 2:
                return self.em.index((rows, cols)[axis - (rank - 2)])
            return self.em.index(self.bnames[len(self.bnames) - (rank - 2) + axis])
        return index

    def run(self, vals: dict[int, Val], values: tuple[int, ...], space: str) -> None:
        """Emit the elementwise ops `values` (and the constants they read) at a tile."""
        wanted = with_scalar_operands(self.region, values, vals)
        for i in inputs_read(self.region, wanted):
            if i not in vals:
                vals[i] = self.load(i, space)
        self.em.run(self.region, vals, lambda op: self.index(op, space), skip=lambda v: v not in wanted)

    def space_indices(self, space: str) -> list[str | None]:
        """Index expressions of each dim of the score tile or the output tile."""
        shape = self.score_shape if space == "score" else self.out_shape
        names = self.bnames[len(self.bnames) - (len(shape) - 2):]
        col = "rn[None, :]" if space == "score" else "rdv[None, :]"
        return [*names, "rm[:, None]", col]

    def indices_of(self, i: int, space: str) -> list[str | None]:
        shape = self.value_type(i).shape
        full = self.space_indices(space)
        return [None if d == 1 else full[len(full) - len(shape) + k] for k, d in enumerate(shape)]

    def varies_along_keys(self, i: int) -> bool:
        return not self.region.inputs[i].scalar and "rn[None, :]" in self.indices_of(i, "score")

    def load(self, i: int, space: str) -> Val:
        """A region input at the score tile or the output tile, read through its strides."""
        inp = self.region.inputs[i]
        if inp.scalar:
            return self.em.scalar(self.scalars[i], inp.type)
        ref = self.refs[i]
        idx = self.indices_of(i, space)
        offset = ref.offset(idx)
        if offset == "0":
            return self.em.load(f"tl.load({ref.ptr})", inp.type)
        col = "rn" if space == "score" else "rdv"
        limit = self.N if space == "score" else self.DV
        masks = []
        if "rm[:, None]" in idx:
            masks.append(f"(rm < {self.M})[:, None]")
        if f"{col}[None, :]" in idx:
            masks.append(f"({col} < {limit})[None, :]")
        mask = " & ".join(masks)
        return self.em.load_at(f"{ref.ptr} + {offset}", mask or None, inp.type)

    def index(self, op: Op, space: str) -> Val:
        axis = op.attr("axis")
        full = self.space_indices(space)
        expr = None if op.shape[axis] == 1 else full[len(full) - len(op.shape) + axis]
        return self.em.index(expr)

    # --- launch ----------------------------------------------------------------------------------

    def launch_rules(self):
        user = {n: hint(self.hints, n, 0) for n in (*DOT_HINTS, "num_warps", "num_stages")}
        user_splits = hint(self.hints, "SPLITS", 0)
        dims_of = (self.score_shape[-2], self.score_shape[-1], self.value_type(self.a_val).shape[-1],
                   self.out_shape[-1])
        batch = self.batch
        half = self.qk_op.dtype is not DType.F32
        # random numbers drawn per score (dropout's mask): 128 keys a tile spill (688 bytes at
        # 128 x 128, 512 at 64 x 128)
        drawn = any(r.op.kind == "random" for r in self.kernel.region.ops)
        # a score modification of many transcendentals (the trig score mod's 5: 4888 bytes
        # at 128 x 128, head dim 64) walks 64 keys too
        n_in = len(self.region.inputs)
        score_kinds = [self.region.ops[v - n_in].op.kind for v in self.parts.score_ops if v >= n_in]
        narrow_at = {64: drawn or transcendentals(score_kinds) > 2}
        # at head dim 128 the accumulator holds twice the registers: a score modification of
        # more than 12 ops walks 64 keys (the neighborhood mask's 15 spill 656 bytes at
        # 128 x 128; the dilated window's 11 do not)
        narrow_at[128] = narrow_at[64] or len(score_kinds) > 12

        def sizes(dims: Mapping[str, int]) -> tuple[int, ...]:
            return tuple(evaluate(d, dims) for d in dims_of)

        def config(dims, bm: int, bn: int, warps: int | None, stages: int | None,
                   hinted: bool = True) -> LaunchConfig:
            """A configuration, with the program's tile hints in place of ours (`hinted`)."""
            m, n, d, dv = sizes(dims)
            given = user if hinted else dict.fromkeys(user, 0)
            widths = {"BLOCK_D": max(16, next_pow2(d)), "BLOCK_DV": max(16, next_pow2(dv))}
            rows = fit_rows({"BLOCK_M": given["BLOCK_M"] or bm, "BLOCK_N": given["BLOCK_N"] or bn},
                            widths.values(), [n for n in DOT_HINTS if given[n]])
            constexprs = {**rows, **widths}
            grid = (cdiv(m, constexprs["BLOCK_M"]) * numel(batch, dims),)
            if warps is not None and constexprs["BLOCK_M"] <= 64:
                warps = min(warps, 4)  # one warpgroup per 64 query rows
            return LaunchConfig(grid, constexprs, given["num_warps"] or warps, given["num_stages"] or stages)

        def width(d: int, dv: int) -> int:
            return max(64, next_pow2(d), next_pow2(dv))

        def hopper(d: int, dv: int) -> tuple:
            return HOPPER_CONFIGS.get(width(d, dv), ((64, 32, 4, 2),))

        def narrow(d: int, dv: int) -> bool:
            """Whether the tiles walk at most 64 keys."""
            return narrow_at[min(width(d, dv), 128)]

        def with_splits(cfg: LaunchConfig, splits: int) -> LaunchConfig:
            if not self.parts.kv_split:
                return cfg
            return LaunchConfig((cfg.grid[0] * splits,), {**cfg.constexprs, "SPLITS": splits},
                                cfg.num_warps, cfg.num_stages)

        def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
            cfg = unsplit(dims, device)
            return with_splits(cfg, self.split_count(dims, cfg, user_splits))

        def unsplit(dims: Mapping[str, int], device: str) -> LaunchConfig:
            m, n, d, dv = sizes(dims)
            if device == "cuda":
                bm, bn, warps, stages = next(c for c in hopper(d, dv) if not narrow(d, dv) or c[1] <= 64)
                # a warpgroup's wgmma is 64 rows; a decode's few query rows take a 16-row
                # tile (mma.sync) instead of wasting most of each dot and its registers
                bm = min(bm, 16 if m <= 16 else max(64, next_pow2(m)))
                if m <= 16:  # a decode walks 64 keys a step: its 16 x 128 tile took 168 registers
                    bn = min(bn, 64)
                return config(dims, bm, bn if half else min(bn, 32), warps, stages)
            # the interpreter: few, large programs
            return config(dims, max(16, min(next_pow2(m), 128)), max(16, min(next_pow2(n), 128)), 4, 1)

        def candidates(dims: Mapping[str, int], device: str) -> list[LaunchConfig]:
            m, n, d, dv = sizes(dims)
            if device != "cuda" or not half or m < 128:
                return []
            # every candidate splits the keys as the default does (the workspace is sized so)
            splits = configure(dims, device).constexprs.get("SPLITS", 1)
            found = [with_splits(config(dims, bm, bn, w, s, hinted=False), splits)
                     for bm, bn, w, s in hopper(d, dv)
                     if bn <= next_pow2(n) and (not narrow(d, dv) or bn <= 64)]
            return hinted_first(configure(dims, device) if any(user.values()) else None, found)

        return configure, candidates

    def split_count(self, dims: Mapping[str, int], cfg: LaunchConfig, user: int) -> int:
        """How many ranges the keys split into at these sizes (`AttentionPlan.kv_split`), from
        the sizes and blocks alone, so the bits do not depend on the device: the SPLITS hint
        (at most one range per key block), else where the (query block, batch) programs are
        fewer than `SPLIT_MIN_PROGRAMS`, enough ranges for `SPLIT_PROGRAMS` programs, each
        walking at least `SPLIT_MIN_BLOCKS` key blocks; 1 otherwise."""
        if not self.parts.kv_split:
            return 1
        key_blocks = cdiv(evaluate(self.score_shape[-1], dims), cfg.constexprs["BLOCK_N"])
        if user:
            return max(1, min(user, key_blocks))
        programs = cfg.grid[0]
        if programs >= SPLIT_MIN_PROGRAMS:
            return 1
        return max(1, min(cdiv(SPLIT_PROGRAMS, max(programs, 1)), key_blocks // SPLIT_MIN_BLOCKS))


# split-KV (`AttentionProgram.split_count`): the keys split where the (query block, batch)
# programs are fewer than an H100's SMs, into ranges enough for two programs per SM (B=1,
# H=32 decode: 9 ranges, 288 programs), each at least 4 key blocks long
SPLIT_MIN_PROGRAMS = 132
SPLIT_PROGRAMS = 264
SPLIT_MIN_BLOCKS = 4
# query rows times head dim a combine program merges at once (f32)
COMBINE_TILE = 8192


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    prog = AttentionProgram(kernel, hints, allow_tf32)
    prog.emit()
    configure, candidates = prog.launch_rules()
    if not kernel.plan.kv_split:
        emitted = finish(kernel, prog.sig, prog.body, configure, prog.em, hints)
        return emitted.with_candidates(candidates)
    stats = len(prog.statistics())
    out_shape = prog.out_shape

    def rows(dims: Mapping[str, int]) -> tuple[int, int, int]:
        """(query rows, batch, head dim of the output) at these sizes."""
        return (evaluate(prog.score_shape[-2], dims), numel(prog.batch, dims), evaluate(out_shape[-1], dims))

    def workspace(dims: Mapping[str, int], target: str) -> tuple[tuple[int, str], ...]:
        """The partial outputs and statistics of every split, f32 [SPLITS, batch, M, DV] and
        [SPLITS, batch, M, statistics] (nothing unsplit)."""
        splits = configure(dims, target).constexprs["SPLITS"]
        m, b, dv = rows(dims)
        n = 0 if splits == 1 else splits * b * m
        return ((n * dv, "float32"), (n * stats, "float32"))

    comb = AttentionProgram(kernel, hints, allow_tf32)
    comb.emit_combine()

    def combine(dims: Mapping[str, int], device: str) -> LaunchConfig:
        """One program per (query block, batch index); none at sizes the keys do not split."""
        splits = configure(dims, device).constexprs["SPLITS"]
        m, b, dv = rows(dims)
        block_dv = max(16, next_pow2(dv))
        block_m = max(1, min(next_pow2(m), COMBINE_TILE // block_dv))
        grid = (0 if splits == 1 else cdiv(m, block_m) * b,)
        return LaunchConfig(grid, {"BLOCK_M": block_m, "BLOCK_DV": block_dv, "SPLITS": splits}, num_warps=4)

    then = finish(kernel, comb.sig, comb.body, combine, comb.em, hints,
                  fn_name=f"{kernel.name}_attention_combine")
    emitted = finish(kernel, prog.sig, prog.body, configure, prog.em, hints, workspace=workspace,
                     then=(then,))
    return emitted.with_candidates(candidates)


# a bound's literal offset this small keeps `(pid_m + 1) * BLOCK_M + offset` inside int32:
# dims are below 2^31 - 2^20 where a kernel computes in int32 (`launch.DIM_LIMIT`) and blocks
# hold at most 2^16 rows; a larger one, or one with scalars, is an int64 scalar
SMALL_OFFSET = 2**19


@dataclass(frozen=True, slots=True)
class Offset:
    """A mask bound's offset as source text: a literal, or (`name`) an int64 scalar that the
    kernel computes before its walk."""

    constant: int = 0
    name: str | None = None

    def text(self, sign: int = 1) -> str:
        """` + offset` (` - offset` for `sign` -1), to follow a block's first or last row."""
        if self.name is not None:
            return f" {'-' if sign < 0 else '+'} {self.name}"
        c = self.constant * sign
        return f" {'-' if c < 0 else '+'} {abs(c)}" if c else ""


@dataclass(frozen=True, slots=True)
class BoundOffsets:
    """What a walk's limits read of a mask bound (`KeyBound`): row i keeps keys
    j <= i + upper and j >= i + lower; `ok` names the flag that the mask's i32 sums do not
    wrap at this call (None: none can), without which every key is kept and masked."""

    upper: Offset
    lower: Offset | None
    ok: str | None
    index_type: str | None = None  # the kernel's index type, where the offsets are int64

    @property
    def wide(self) -> bool:
        return self.upper.name is not None

    def limit(self, text: str) -> str:
        """A walk's limit computed from the offsets: int64 from int64 ones, so back in the
        kernel's index type (its value is a key or query position, in range)."""
        return f"({text}).to({self.index_type})" if self.wide else text


def bound_offsets(sig: Signature, body: Code, em: Emitter, outer: Mapping[int, Val], bound: KeyBound,
                  rows: str, keys: str) -> BoundOffsets:
    """Emit before the walk what its limits need of a mask bound, and return it: the
    offsets, small literals or int64 scalars (`kb_hi`, `kb_lo`: there the bound cannot
    overflow; each scalar is taken as i32, as the mask's arithmetic takes it), and where a
    sum of the mask could wrap (`KeyBound.checks`) the flag `kb_ok` that none does at this
    call: each sum's extremes over the call's `rows` and `keys` lie inside i32. Where it is
    false the offsets keep every key (j <= i + keys, j >= i - rows): the mask decides alone."""
    lower = bound.lower
    upper_constant = bound.constant - int(bound.strict)
    constants = [upper_constant] + ([lower.constant] if lower is not None else [])
    if not bound.checks and not bound.offsets and (lower is None or not lower.offsets) \
            and all(abs(c) <= SMALL_OFFSET for c in constants):
        return BoundOffsets(Offset(upper_constant), None if lower is None else Offset(lower.constant), None)

    terms: dict[int, str] = {}

    def int64(offsets, constant: int) -> str:
        text = f"tl.full([], {constant}, tl.int64)"
        for sign, v in offsets:
            if v not in terms:
                terms[v] = em.tensor(em.convert(em.convert(outer[v], Compute.I32), Compute.I64)).text
            text += f" {'-' if sign < 0 else '+'} {terms[v]}"
        return text

    ok = None
    if bound.checks:
        body(f"kb_rows = tl.full([], 0, tl.int64) + {rows}")
        body(f"kb_keys = tl.full([], 0, tl.int64) + {keys}")
        fits = []
        for k, c in enumerate(bound.checks):
            body(f"kb_sum{k} = {int64(c.offsets, c.constant)}")
            ends = {"lo": f"kb_sum{k}", "hi": f"kb_sum{k}"}
            for coefficient, size in ((c.i_coefficient, "kb_rows"), (c.j_coefficient, "kb_keys")):
                if coefficient:  # the index runs over [0, size - 1]
                    times = "" if abs(coefficient) == 1 else f"{abs(coefficient)} * "
                    ends["hi" if coefficient > 0 else "lo"] += \
                        f" {'+' if coefficient > 0 else '-'} {times}({size} - 1)"
            fits.append(f"({ends['lo']} >= {I32_MIN}) & ({ends['hi']} <= {I32_MAX})")
        ok = "kb_ok"
        body(f"kb_ok = {' & '.join(fits)}")

    def scalar(name: str, offsets, constant: int, keep_all: str) -> Offset:
        text = int64(offsets, constant)
        body(f"{name} = {text}" if ok is None else f"{name} = tl.where({ok}, {text}, {keep_all})")
        return Offset(name=name)

    upper = scalar("kb_hi", bound.offsets, upper_constant, "kb_keys")
    low = None if lower is None else scalar("kb_lo", lower.offsets, lower.constant, "-kb_rows")
    return BoundOffsets(upper, low, ok, f"tl.int64 if {sig.wide()} else tl.int32")
