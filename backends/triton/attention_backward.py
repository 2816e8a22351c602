"""The attention backward templates: FlashAttention-2's dk/dv and dq kernels, from the plan
fuse-attention-backward recorded (`AttentionBackwardPlan`).

`over = "queries"`: one program per (key block, batch element), walking the query blocks;
`over = "keys"`: one program per (query block, batch element), walking the key blocks.
The score tiles are held as [owned, walked] (`axes`): the dk/dv kernel computes
S^T = K Q^T, as FlashAttention-2 does, so each product is `acc += x @ y` with the
score-space value x as the dot's A operand, as it is. A program loads its owned side's
score dot operands once ([BLOCK_own, BLOCK_K]), then per step the walked side's
([BLOCK_K, BLOCK_walk]), the score tiles in f32, the score ops (the recomputed score
modification, the probabilities exp(z - lse), the score gradient; row values such as lse
and delta are read as vectors of the tile) and each product's step with y's
[BLOCK_walk, BLOCK_P] tile: the transpose of a walked operand's tile when y is that tensor
(dK's Q, dQ's K through `KernelOp.transposed_inputs`), else loaded.

Every score-space value a product reads is set to 0 outside the sequences before its
dot (rows past M, keys past N), so tails add nothing whatever the score ops give there;
where every tile is whole (`EVEN`, the launcher's) the bound checks fold away. The x tile
meets y in the product's dtype (f32 dots at IEEE precision unless tf32 is allowed).
The epilogue (a cast, a scale) runs on the f32 accumulator, after a product's scalar
factor (`ScoreProduct.scale`: dK's and dQ's softmax scale, once per sum, not per score);
the result is stored through its strides, so a transposed product (`(q.T @ ds).T`) lands
in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack

from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp, Op
from tiledsl.plans import AttentionBackwardPlan, ScoreProduct
from tiledsl.types import Compute, DType, TensorType, value_compute

from .attention import LOG2E, bound_offsets, transcendentals
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

DOT_HINTS = ("BLOCK_M", "BLOCK_N")


class ProbabilityEmitter(Emitter):
    """The score ops' `exp` of an f32 (the probabilities `exp(z - lse)`) as the forward's
    attention kernel computes them: `exp2` of the argument times log2(e), Triton's fast
    form, not the f64 round trip of an f32 `exp` elsewhere. Forward and backward agree,
    and the exp costs what it does in FlashAttention. A `where` whose condition is the
    literal True (a mask on a block inside its bound, `step(unmasked=True)`) is its
    first branch. A cast of an f32 score value to f16 or bf16 (the probabilities and the
    score gradient autodiff rounds to the program's dtype) stays in f32 (the numerics
    contract: elementwise math in f32, rounded once): it is rounded where a product's
    dot reads it, and the score ops after it read it unrounded, as FlashAttention's
    dS = P * (dP - delta) reads the f32 P.

    The exp of a tile minus a row's value (`z - lse`, z maybe a tile times a scalar, the
    softmax scale) folds log2(e) into the scalar and the row's value: one FMA a score,
    `exp2(s * (scale * log2 e) - lse * log2 e)`, FlashAttention's form."""

    def __init__(self, code: Code) -> None:
        super().__init__(code)
        self.shifted: dict[str, tuple[Val, Val]] = {}  # a tile minus a row's value: (tile, row)

    def op(self, op: Op, args: list[Val], types: tuple[TensorType, ...]) -> Val:
        if op.kind == "where" and args[0].literal and args[0].text == "True":  # a mask inside it
            return self.convert(args[1], value_compute(op.type))
        if op.kind == "cast" and op.dtype in (DType.F16, DType.BF16) and types[0].dtype is DType.F32:
            return self.convert(args[0], Compute.F32)
        if op.kind != "exp" or op.dtype is not DType.F32:
            out = super().op(op, args, types)
            self.note_form(op, args, types, out)
            return out
        x = self.tensor(self.convert(args[0], Compute.F32))
        if x.text in self.shifted:
            z, row = self.shifted[x.text]
            z, scale = self.scaled.get(z.text, (z, None))
            factor = repr(LOG2E) if scale is None else f"({scale.text} * {LOG2E!r})"
            return self.assign(f"tl.exp2({z.text} * {factor} - {row.text} * {LOG2E!r})", Compute.F32)
        return self.assign(f"tl.exp2({x.text} * {LOG2E!r})", Compute.F32)

    def note_form(self, op: Op, args: list[Val], types: tuple[TensorType, ...], out: Val) -> None:
        """Record an f32 tile minus a row's value (a vector of the score tile: a size-1 score
        dim, or a scalar), for the exp that reads it (the base emitter records a tile times a
        scalar: `scaled`)."""
        if out.literal or op.type.rank < 2 or any(a.literal or a.cat is not Compute.F32 for a in args):
            return
        if op.kind == "sub" and types[0].shape == op.shape and \
                (types[1].rank == 0 or 1 in types[1].shape[-2:]):
            self.shifted[out.text] = (args[0], args[1])


def below(index: str, size: str) -> str:
    """A bound check of a tile's index, true throughout when `EVEN` (the launcher's: every
    block and head dim fills its tile), where Triton folds it away, the loads unmasked."""
    return f"(({index} < {size}) | EVEN)"


class AttentionBackwardProgram:
    def __init__(self, kernel: KernelOp, hints: Hints, allow_tf32: bool) -> None:
        require_dot_hints(hints, DOT_HINTS)
        self.kernel, self.hints, self.allow_tf32 = kernel, hints, allow_tf32
        self.region = region = kernel.region
        self.plan: AttentionBackwardPlan = kernel.plan
        self.n_in = len(region.inputs)
        # (a kernel whose products read no score dot, p of saved scores, has none)
        first = self.plan.dots[0].matmul if self.plan.dots else self.plan.products[0].x
        self.score_shape = region.value_type(first).shape
        self.batch = self.score_shape[:-2]
        self.sig, self.body = Signature(), Code()
        self.em = ProbabilityEmitter(self.body)
        # the loop walks the queries (rm) or the keys (rn); the program owns the other
        self.walk, self.own = ("rm", "rn") if self.plan.over == "queries" else ("rn", "rm")
        # the score tiles' axes: the owned index first, so a product's score-space operand is
        # the A operand of its dot as it is (FlashAttention-2's dk/dv kernel computes
        # S^T = K Q^T, not S and its transpose through shared memory)
        self.axes = (self.own, self.walk)
        self.ix = {a: f"{a}[:, None]" if k == 0 else f"{a}[None, :]" for k, a in enumerate(self.axes)}
        self.blocks = {"rm": "BLOCK_M", "rn": "BLOCK_N"}
        self.tile = f"[{self.blocks[self.axes[0]]}, {self.blocks[self.axes[1]]}]"
        # input i -> input j it is the transpose of (a view of the same tensor)
        self.transposes = dict(kernel.transposed_inputs)
        # this step's walked score dot operand tiles a product may read transposed:
        # (name, input, the input's dim the walk runs along, the K dim, dtype)
        self.walked_tiles: list[tuple[str, int, int, object, DType]] = []

    def value_type(self, v: int):
        return self.region.value_type(v)

    def emit(self) -> None:
        sig, body, region, plan = self.sig, self.body, self.region, self.plan
        self.refs = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
                     if not inp.scalar}
        self.scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
        self.em.gather_from(region, self.refs, sig.size)
        self.outs = [sig.tensor("out", j, self.value_type(v).shape) for j, v in enumerate(region.outputs)]
        self.M, self.N = sig.size(self.score_shape[-2]), sig.size(self.score_shape[-1])
        self.K = [sig.size(self.value_type(d.a).shape[-1]) for d in plan.dots]
        self.P = [sig.size(self.width(p)) for p in plan.products]
        for name in ("EVEN", "BLOCK_M", "BLOCK_N", *(f"BLOCK_K{j}" for j in range(len(plan.dots))),
                     *(f"BLOCK_P{j}" for j in range(len(plan.products)))):
            sig.constexpr(name)
        own_size, own_block = (self.N, "BLOCK_N") if plan.over == "queries" else (self.M, "BLOCK_M")
        walk_size, walk_block = (self.M, "BLOCK_M") if plan.over == "queries" else (self.N, "BLOCK_N")
        self.own_size, self.walk_size = own_size, walk_size

        body("pid = tl.program_id(0)")
        body(f"own_blocks = tl.cdiv({own_size}, {own_block})")
        body("pid_b = pid // own_blocks")
        if plan.bound is not None and plan.over == "keys":  # the longest rows first, as forward
            body("pid_o = own_blocks - 1 - pid % own_blocks")
        else:
            body("pid_o = pid % own_blocks")
        self.bnames: list[str | None] = batch_names(self.batch)
        # the batch axes the kernel walks (plan.walked) are not the program's: loops set them
        mine = [None if i in plan.walked else n for i, n in enumerate(self.bnames)]
        if any(mine):
            body("pb = pid_b.to(tl.int64)")
            decompose(body, "pb", self.batch, mine, sig.size, "pq")
        body(f"{self.own} = pid_o * {own_block} + tl.arange(0, {own_block})")
        body(f"{self.walk}_base = tl.arange(0, {walk_block})")
        for j in range(len(plan.dots)):
            body(f"rk{j} = tl.arange(0, BLOCK_K{j})")
        for j in range(len(plan.products)):
            body(f"rp{j} = tl.arange(0, BLOCK_P{j})")
        # the rank-0 inputs and score ops (the prologues' and score ops' scalars), then the
        # tiles of the owned side, loaded once
        self.outer = self.program_scalars()
        for j in range(len(plan.dots)):
            self.dot_operand(j, fixed=True)
        for j in range(len(plan.products)):
            body(f"acc{j} = tl.zeros([{own_block}, BLOCK_P{j}], dtype=tl.float32)")
        self.rank = len(self.score_shape)
        self.walk_axis = self.rank - (2 if plan.over == "queries" else 1)  # the score axis walked
        self.offsets = None if plan.bound is None else \
            bound_offsets(self.sig, body, self.em, self.outer, plan.bound, self.M, self.N)
        start, end = self.walk_range(walk_size)
        summed = [j for j, r in enumerate(plan.reductions) if self.walk_axis in r.axes]
        with ExitStack() as loops:
            for a in plan.walked:  # a batch axis walked (GQA's query heads of a group)
                body(f"for w{a + 1} in range(0, {sig.size(self.batch[a])}):")
                loops.enter_context(body.indent())
                body(f"{self.bnames[a]} = tl.cast(w{a + 1}, tl.int64)")
            for j in summed:  # summed in registers along the walk
                body(f"red{j} = tl.zeros([{own_block}], dtype=tl.float32)")
            for first, last, unmasked in self.walk_loops(start, end):
                body(f"for w0 in range({first}, {last}, {walk_block}):")
                with body.indent():
                    self.step(unmasked)
            for j in summed:
                self.add_into(j, f"red{j}", (self.own,))
        self.finish()

    def width(self, p: ScoreProduct):
        """The product's free dim: y's last (x.T @ y, x @ y) or second-to-last (y.T @ x)."""
        shape = self.value_type(p.y).shape
        return shape[-2] if p.y_first else shape[-1]

    def dot_operand(self, j: int, fixed: bool) -> None:
        """Load score dot j's operand of the owned side (`fixed`: [BLOCK_own, BLOCK_K], the
        first operand of the dot) or of the walked side ([BLOCK_K, BLOCK_walk], the second),
        each read through the strides of a [.., M, K] a or a [.., K, N] b."""
        d = self.plan.dots[j]
        side_a = (self.own == "rm") == fixed  # a [.., M, K] belongs to the queries
        value = d.a if side_a else d.b
        t = self.value_type(value)
        score, size = ("rm", self.M) if side_a else ("rn", self.N)
        first, second = "[:, None]", "[None, :]"
        at, k_at = (score + first, f"rk{j}{second}") if fixed else (score + second, f"rk{j}{first}")
        rows, cols = (at, k_at) if side_a else (k_at, at)
        shape = f"[{self.blocks[score]}, BLOCK_K{j}]" if fixed else f"[BLOCK_K{j}, {self.blocks[score]}]"
        mask = f"{below(at, size)} & {below(k_at, self.K[j])}"
        name = f"dot{j}_{'a' if side_a else 'b'}"
        source = d.a_source if side_a else d.b_source
        dot = self.dot_dtype(j)
        if dot is not self.value_type(d.matmul).dtype:  # the widened tensors' own tiles
            value = source
        ptrs = tile_ptrs(self.refs[source], t.rank, self.bnames, rows, cols, shape)
        self.operand(name, ptrs, mask, value, source, dot)
        if not fixed and self.plain(value, source, dot):
            # the walk runs along the source's dim -2 (a's M) or -1 (b's N)
            self.walked_tiles.append((name, source, -2 if side_a else -1, t.shape[-1 if side_a else -2], dot))

    def shared_tile(self, p: ScoreProduct, dot: DType) -> str | None:
        """A product's y tile [BLOCK_walk, BLOCK_P] as the transpose of a walked score dot
        operand's tile [BLOCK_K, BLOCK_walk] loaded this step: the same tensor (or a transposed
        view of it, `KernelOp.transposed_inputs`), read whole along the same dims, in the same
        dtype (dK += dS^T Q reads the Q^T tile of S^T = K Q^T, dQ += dS K the K^T tile)."""
        source = p.y if p.y_source is None else p.y_source
        if not self.plain(p.y, source, dot):
            return None
        walk_dim = -1 if p.y_first else -2
        for name, tile_source, tile_walk, k_dim, tile_dot in self.walked_tiles:
            if tile_source == source:
                same = tile_walk == walk_dim
            elif self.transposes.get(tile_source) == source or self.transposes.get(source) == tile_source:
                same = tile_walk != walk_dim
            else:
                continue
            if same and k_dim == self.width(p) and tile_dot is dot:
                return f"tl.trans({name})"
        return None

    def plain(self, value: int, source: int, dot: DType) -> bool:
        """Is the operand `value` its input `source` as loaded, brought to the dot's dtype
        (itself, or a cast of it to the dot's dtype)?"""
        return value == source or self.casts(value, source) and self.value_type(value).dtype is dot

    def operand(self, name: str, ptrs: str, mask: str, value: int, source: int, dot: DType) -> None:
        """Load a tile of `source` into `name` and bring it to the dot's dtype, computing the
        prologue that gives `value` on it (in f32; 0 outside the tile)."""
        if self.plain(value, source, dot):
            self.body(f"{name} = tl.load({ptrs}, mask={mask}, other=0.0)")
            self.to_dot(name, self.value_type(source).dtype, dot)
            return
        chain = self.region.depends(value) - {source}
        operand_tile(self.em, self.region, name, ptrs, mask, value, source, chain, self.outer, dot)

    def dot_dtype(self, j: int) -> DType:
        """The dtype score dot j multiplies in: its own, or, for an f32 dot of two f16 (or
        two bf16) tensors widened to f32 (mixed precision), theirs: products of 11-bit
        (8-bit) significands are exact in f32, and tl.dot sums them in f32, so the result
        is the f32 dot's, from the tensor cores."""
        d = self.plan.dots[j]
        want = self.value_type(d.matmul).dtype
        # a prologue computing more than a cast keeps the dot's own dtype
        have = {self.value_type(source).dtype if value == source or self.casts(value, source) else want
                for value, source in ((d.a, d.a_source), (d.b, d.b_source))}
        if want is DType.F32 and len(have) == 1 and have <= {DType.F16, DType.BF16}:
            return have.pop()
        return want

    def casts(self, value: int, source: int) -> bool:
        """Is `value` a cast of the input `source` (a prologue that only changes the dtype)?"""
        if value < self.n_in:
            return False
        rop = self.region.ops[value - self.n_in]
        return rop.op.kind == "cast" and rop.operands == (source,)

    def to_dot(self, name: str, have: DType, dot: DType) -> None:
        """Bring a loaded tile to the dot's dtype (mixed operands meet in f32; the interpreter
        multiplies bf16 operands as raw bits, so it gets them widened)."""
        body, em = self.body, self.em
        if have is not dot:
            body(f"{name} = {em.narrow(em.widen(name, have), dot)}")
        if dot is DType.BF16:
            body("if INTERPRETER:")
            with body.indent():
                body(f"{name} = {em.widen(name, DType.BF16)}")

    def walk_loops(self, start: str, end: str) -> list[tuple[str, str, bool]]:
        """The walk as loops (first, last, whether its blocks skip the mask): under an exact
        upper key bound (causal), the blocks every row of the program keeps whole run
        without the mask's `where`s, as the forward's do; the others evaluate it. A block
        starts at `start` plus a multiple of its size."""
        bound, plan, offsets = self.plan.bound, self.plan, self.offsets
        if bound is None or not bound.exact or bound.lower is not None or plan.bound_cond is None:
            return [(start, end, False)]
        upper = offsets.upper
        body = self.body
        if plan.over == "queries":
            # key block [n0, n0 + BLOCK_N): rows i >= n0 + BLOCK_N - 1 - a keep all of it
            body(f"w_first = {start}")
            first_row = f"(pid_o + 1) * BLOCK_N - 1{upper.text(sign=-1)}"
            body(f"w_inside = tl.maximum(0, {first_row} - w_first)")
            body("w_inside = " + offsets.limit(
                f"tl.minimum({end}, w_first + (w_inside + BLOCK_M - 1) // BLOCK_M * BLOCK_M)"))
            if offsets.ok is not None:  # the mask's arithmetic wraps: no block skips it
                body(f"w_inside = tl.where({offsets.ok}, w_inside, {end})")
            # the blocks kept whole first: the loop most of the walk runs comes first in the
            # code, as in the keys kernel (and the one `tiledsl ptx` profiles)
            return [("w_inside", end, True), ("w_first", "w_inside", False)]
        # query block [m0, m0 + BLOCK_M): keys j <= m0 + a are kept by all of its rows
        body("w_inside = " + offsets.limit(
            f"tl.minimum({end}, tl.maximum(0, pid_o * BLOCK_M + 1{upper.text()}) // BLOCK_N * BLOCK_N)"))
        if offsets.ok is not None:
            body(f"w_inside = tl.where({offsets.ok}, w_inside, 0)")
        return [("0", "w_inside", True), ("w_inside", end, False)]

    def step(self, unmasked: bool = False) -> None:
        body, em, region, plan = self.body, self.em, self.region, self.plan
        body(f"{self.walk} = w0 + {self.walk}_base")
        self.walked_tiles = []
        for j in range(len(plan.dots)):
            self.dot_operand(j, fixed=False)
        vals: dict[int, Val] = dict(self.outer)
        if unmasked:  # the mask's condition holds on the whole tile
            vals[plan.bound_cond] = literal(True, Compute.BOOL)
        first, second = ("a", "b") if self.own == "rm" else ("b", "a")
        for j, d in enumerate(plan.dots):
            precision = dot_kwargs(self.dot_dtype(j), self.allow_tf32)
            body(f"s{j} = tl.dot(dot{j}_{first}, dot{j}_{second}{precision})")
            vals[d.matmul] = Val(f"s{j}", Compute.F32)
        wanted = with_scalar_operands(region, plan.score_ops, vals) - vals.keys()
        for i in inputs_read(region, wanted):
            vals[i] = self.load(i)
        em.run(region, vals, lambda op: self.index(op), skip=lambda v: v not in wanted)
        inside = self.inside()
        for j, v in enumerate(region.outputs):
            if v in plan.stores:  # a score-space value read whole outside: this tile of it
                t = self.value_type(v)
                ptrs = tile_ptrs(self.outs[j], t.rank, self.bnames, self.ix["rm"], self.ix["rn"], self.tile)
                body(f"tl.store({ptrs}, {em.store_value(vals[v], t)}, mask={inside})")
        for j, r in enumerate(plan.reductions):
            x = em.tensor(em.convert(vals[r.x], Compute.F32))
            body(f"t{j} = tl.where({inside}, {x.text}, 0.0)")
            if self.walk_axis in r.axes:
                body(f"red{j} += tl.sum(t{j}, axis=1)")  # along the walk
            else:
                self.add_into(j, f"t{j}", self.axes)
        walk = self.walk
        walk_size = self.M if walk == "rm" else self.N
        for j, p in enumerate(plan.products):  # x [BLOCK_own, BLOCK_walk] @ y [BLOCK_walk, BLOCK_P]
            dot = self.value_type(p.matmul).dtype
            x = em.tensor(em.convert(vals[p.x], Compute.F32))
            body(f"x{j} = tl.where({inside}, {x.text}, 0.0)")
            body(f"x{j} = {em.narrow(f'x{j}', dot)}")
            self.to_dot(f"x{j}", dot, dot)
            y = self.shared_tile(p, dot)
            if y is None:
                y_t = self.value_type(p.y)
                rows, cols = f"{walk}[:, None]", f"rp{j}[None, :]"
                if p.y_first:
                    rows, cols = cols, rows
                mask = f"{below(f'{walk}[:, None]', walk_size)} & {below(f'rp{j}[None, :]', self.P[j])}"
                source = p.y if p.y_source is None else p.y_source
                ptrs = tile_ptrs(self.refs[source], y_t.rank, self.bnames, rows, cols,
                                 f"[{self.blocks[walk]}, BLOCK_P{j}]")
                self.operand(f"y{j}", ptrs, mask, p.y, source, dot)
                y = f"y{j}"
            body(f"acc{j} = tl.dot(x{j}, {y}, acc{j}{dot_kwargs(dot, self.allow_tf32)})")

    def inside(self) -> str:
        """The score tile's elements inside the sequences (rows below M, keys below N)."""
        own, walk = self.own, self.walk
        return f"{below(own, self.own_size)}{self.ix[own][len(own):]} & " \
               f"{below(walk, self.walk_size)}{self.ix[walk][len(walk):]}"

    def finish(self) -> None:
        body, em, region, plan = self.body, self.em, self.region, self.plan
        vals: dict[int, Val] = {p.matmul: Val(f"acc{j}", Compute.F32) for j, p in enumerate(plan.products)}
        for j, p in enumerate(plan.products):  # a product of x * scale: the sum of x's, scaled
            if p.scale is not None:
                body(f"acc{j} = acc{j} * {self.scalar_value(p.scale, vals).text}")
        for v in plan.batch_sums:  # the walk summed them already (a reshape merges summed axes)
            vals[v] = vals[region.ops[v - self.n_in].operands[0]]
        wanted = with_scalar_operands(region, plan.epilogue, vals)
        for i in inputs_read(region, wanted):  # rank 0: loaded before the walk
            vals[i] = self.outer[i]
        em.run(region, vals, lambda op: em.index(None), skip=lambda v: v not in wanted)
        own_size = self.N if plan.over == "queries" else self.M
        reduced = {r.result for r in plan.reductions}
        for j, v in enumerate(region.outputs):
            if v in plan.stores or v in reduced:
                continue
            k = next(k for k, p in enumerate(plan.products) if p.matmul in region.depends(v))
            p, t = plan.products[k], self.value_type(v)
            if p.y_first:  # [.., P, N]
                rows, cols = f"rp{k}[None, :]", f"{self.own}[:, None]"
            else:
                rows, cols = f"{self.own}[:, None]", f"rp{k}[None, :]"
            block = "BLOCK_N" if plan.over == "queries" else "BLOCK_M"
            bnames = self.bnames if p.batch is None else [None if a is None else self.bnames[a]
                                                          for a in p.batch]
            ptrs = tile_ptrs(self.outs[j], t.rank, bnames, rows, cols, f"[{block}, BLOCK_P{k}]")
            mask = f"{below(f'{self.own}[:, None]', own_size)} & {below(f'rp{k}[None, :]', self.P[k])}"
            body(f"tl.store({ptrs}, {em.store_value(vals[v], t)}, mask={mask})")

    def scalar_value(self, v: int, vals: dict[int, Val]) -> Val:
        """The f32 value of a scalar (an input, or an expression of inputs and constants)
        after the walk, computed into `vals`."""
        if v < self.n_in:
            vals[v] = self.load(v)
        elif v not in vals:
            wanted = with_scalar_operands(self.region, [v], vals)
            for i in inputs_read(self.region, wanted):
                vals[i] = self.load(i)
            self.em.run(self.region, vals, lambda op: self.em.index(None), skip=lambda u: u not in wanted)
        return self.em.tensor(self.em.convert(vals[v], Compute.F32))

    def add_into(self, j: int, part: str, axes: tuple[str, ...]) -> None:
        """Add reduction j's part of the score tile (a tile or vector over the score axes
        `axes`, of "rm" and "rn") to its result: summed first over the axes the result
        reduces, then added atomically at the indices it keeps."""
        body, r = self.body, self.plan.reductions[j]
        names = {"rm": self.rank - 2, "rn": self.rank - 1}
        kept = [a for a in axes if names[a] not in r.axes]
        for k in reversed(range(len(axes))):
            if axes[k] not in kept:
                body(f"part{j} = tl.sum({part}, axis={k})")
                part = f"part{j}"
        at = {names[a]: a if len(kept) == 1 else f"{a}[:, None]" if k == 0 else f"{a}[None, :]"
              for k, a in enumerate(kept)}
        at.update({a: name for a, name in enumerate(self.bnames) if name is not None})
        out = self.region.outputs.index(r.result)
        t = self.value_type(r.result)
        idx = [None if a is None or d == 1 else at[a] for a, d in zip(r.dims, t.shape, strict=True)]
        limits = {"rm": self.M, "rn": self.N}
        mask = " & ".join(below(at[names[a]], limits[a]) for a in kept)
        ptr = f"{self.outs[out].ptr} + {self.outs[out].offset(idx)}"
        body(f"tl.atomic_add({ptr}, {part}{f', mask={mask}' if mask else ''}, sem=\"relaxed\")")

    # --- helpers -------------------------------------------------------------------------------

    def program_scalars(self) -> dict[int, Val]:
        """The rank-0 inputs and the score ops' scalars (a scale, a mask bound's offset),
        computed once before the operand tiles and the walk."""
        region, outer = self.region, {}
        wanted = with_scalar_operands(region, [v for v in self.plan.score_ops
                                               if self.value_type(v).rank == 0], outer)
        scalars = [i for i, inp in enumerate(region.inputs) if inp.type.rank == 0]
        for i in dict.fromkeys([*inputs_read(region, wanted), *scalars]):
            outer[i] = self.load(i)
        self.em.run(region, outer, lambda op: self.em.index(None), skip=lambda v: v not in wanted)
        return outer

    def walk_range(self, size: str) -> tuple[str, str]:
        """Where the walk starts and ends: every block, or those a mask bound keeps (the
        plan's `bound`: row i keeps keys j <= i + a, and with a lower bound j >= i + b)."""
        offsets = self.offsets
        if offsets is None:
            return "0", size
        upper, lower = offsets.upper, offsets.lower

        def start_at(text: str) -> str:  # int64 offsets can put a start past the walk
            return offsets.limit(f"tl.minimum({size}, {text})" if offsets.wide else text)

        if self.plan.over == "queries":  # key block [n0, n1): rows i >= n0 - a, i < n1 - b
            start = start_at(f"tl.maximum(0, pid_o * BLOCK_N{upper.text(sign=-1)})")
            if lower is None:
                return start, size
            end = f"(pid_o + 1) * BLOCK_N{lower.text(sign=-1)}"
            return start, offsets.limit(f"tl.minimum({size}, tl.maximum(0, {end}))")
        # query block [m0, m1): keys j < m1 + a, j >= m0 + b
        end = offsets.limit(f"tl.minimum({size}, tl.maximum(0, (pid_o + 1) * BLOCK_M{upper.text()}))")
        if lower is None:
            return "0", end
        return start_at(f"tl.maximum(0, pid_o * BLOCK_M{lower.text()})"), end

    def indices_of(self, shape) -> list[str | None]:
        """Index expressions of a value of `shape` read at the score tile (right-aligned)."""
        full = [*self.bnames[len(self.bnames) - len(self.batch):], self.ix["rm"], self.ix["rn"]]
        return [None if d == 1 else full[len(full) - len(shape) + k] for k, d in enumerate(shape)]

    def load(self, i: int) -> Val:
        inp = self.region.inputs[i]
        if inp.scalar:
            return self.em.scalar(self.scalars[i], inp.type)
        ref = self.refs[i]
        idx = self.indices_of(inp.type.shape)
        offset = ref.offset(idx)
        if offset == "0":
            return self.em.load(f"tl.load({ref.ptr})", inp.type)
        masks = []
        for a, size in (("rm", self.M), ("rn", self.N)):
            if self.ix[a] in idx:
                masks.append(f"{below(a, size)}{self.ix[a][len(a):]}")
        return self.em.load_at(f"{ref.ptr} + {offset}", " & ".join(masks) or None, inp.type)

    def index(self, op) -> Val:
        axis = op.attr("axis")
        idx = self.indices_of(op.shape)
        return self.em.index(idx[axis])

    # --- launch ----------------------------------------------------------------------------------

    def launch_rules(self):
        plan = self.plan
        user = {n: hint(self.hints, n, 0) for n in (*DOT_HINTS, "num_warps", "num_stages")}
        dims_of = (self.score_shape[-2], self.score_shape[-1],
                   *(self.value_type(d.a).shape[-1] for d in plan.dots),
                   *(self.width(p) for p in plan.products))
        n_dots = len(plan.dots)
        programs = [d for a, d in enumerate(self.batch) if a not in plan.walked]  # batch dims of the grid
        dtypes = [self.dot_dtype(j) for j in range(n_dots)] + [self.value_type(p.matmul).dtype
                                                               for p in plan.products]
        f32_dots = not self.allow_tf32 and DType.F32 in dtypes
        # a score modification whose ops spill 64 x 64 tiles at head dim 128 on sm_90 (the
        # neighborhood mask's 26 tensor ops, the trig score mod's 5 transcendentals)
        kinds = [self.region.ops[v - self.n_in].op.kind for v in plan.score_ops
                 if self.value_type(v).rank > 0]
        transcendental = transcendentals(kinds)
        heavy = len(kinds) > 24 or transcendental > 2
        # few enough score ops for the dk/dv kernel's 128 x 32 score tile on one warpgroup at
        # head dim 64 (plain and document-masked attention; the sink's, the dilated window's
        # and the soft cap's spilled 16-200 bytes)
        light = len(kinds) <= 20 and transcendental <= 1

        def config(dims: Mapping[str, int], bm: int, bn: int, warps: int, stages: int,
                   hinted: bool = True) -> LaunchConfig:
            """A configuration, with the program's tile hints in place of ours (`hinted`)."""
            given = user if hinted else dict.fromkeys(user, 0)
            m, n, *rest = (evaluate(d, dims) for d in dims_of)
            widths = {f"BLOCK_K{j}" if j < n_dots else f"BLOCK_P{j - n_dots}": max(16, next_pow2(size))
                      for j, size in enumerate(rest)}
            consts = {**fit_rows({"BLOCK_M": given["BLOCK_M"] or bm, "BLOCK_N": given["BLOCK_N"] or bn},
                                 widths.values(), [n for n in DOT_HINTS if given[n]]), **widths}
            # every tile inside the sequences and the head dims: no bound checks
            consts["EVEN"] = m % consts["BLOCK_M"] == 0 and n % consts["BLOCK_N"] == 0 \
                and all(size == widths[name] for size, name in zip(rest, widths, strict=True))
            own = n if plan.over == "queries" else m
            block = consts["BLOCK_N" if plan.over == "queries" else "BLOCK_M"]
            grid = (cdiv(own, block) * numel(programs, dims),)
            if given["BLOCK_M"] and block <= 64 and not wide(dims):
                warps = min(warps, 4)  # a hinted 64-row score tile: one warpgroup for its rows
            return LaunchConfig(grid, consts, given["num_warps"] or warps, given["num_stages"] or stages)

        def wide(dims: Mapping[str, int]) -> bool:
            return max((next_pow2(evaluate(d, dims)) for d in dims_of[2:]), default=16) >= 128

        def configure(dims: Mapping[str, int], device: str, hinted: bool = True) -> LaunchConfig:
            if device != "cuda":  # the interpreter: few, large programs
                m, n = (evaluate(d, dims) for d in dims_of[:2])
                return config(dims, max(16, min(next_pow2(m), 64)), max(16, min(next_pow2(n), 64)), 4, 1)
            # sm_90, Triton 3.9 (`tiledsl ptx`, static_sm90.py): each kernel owns 128 rows of
            # the score tile (the walked side's tiles serve twice the scores of 64), with a
            # warpgroup per 64 of them; the dk/dv kernel walks 32 queries (its two [128, D]
            # accumulators; with more score ops, 64 on two warpgroups), the dq kernel 64 keys.
            # At head dim 128 the dk/dv kernel spills with 4 warps (4 KB) or walking 64
            # queries (8 B)
            at_128 = wide(dims)
            stages = 2
            if plan.over == "queries":  # (with 2 stages at head dim 64 the plain one spills 8 B)
                bm, bn, warps = (32, 128, 8) if at_128 else (32, 128, 4) if light else (64, 128, 8)
                stages = 3 if light and not at_128 else 2
            else:
                bm, bn, warps = 128, 64, 8
            if plan.walked:  # walking the group's heads too: 64 x 64 spills (200 B at head dim
                bm, bn, warps = 32, 64, 8  # 128 with 8 warps, 164 at 64 with 4; 32 x 64 with 4: 40)
            if heavy:  # many score ops (a trig score mod, dropout): own 64 rows, no spills
                bm, bn = (32, 64) if plan.over == "queries" else (64, 32)
                warps = 8 if at_128 else 4
            if f32_dots:  # IEEE f32 dots run on the FMA units, not wgmma: smaller tiles
                bm, bn = 32, 32
            return config(dims, bm, bn, warps, stages, hinted)

        def candidates(dims: Mapping[str, int], device: str) -> list[LaunchConfig]:
            """On a GPU, for f16/bf16 dots at sizes worth timing: the default, a deeper
            pipeline, and tiles walking twice as far (dk/dv: 64 queries; dq: 32 keys with one
            warpgroup) or owning 64 rows. Each compiles for sm_90 without spills at head dims
            64 and 128 (`tests/test_attention_backward.py`)."""
            m, n = (evaluate(d, dims) for d in dims_of[:2])
            if device != "cuda" or f32_dots or plan.walked or heavy or min(m, n) < 128:
                return []
            # (BLOCK_M, BLOCK_N, warps, stages) beside the default: the dk/dv kernel walks
            # BLOCK_M queries and owns BLOCK_N keys, the dq kernel owns BLOCK_M queries and
            # walks BLOCK_N keys. At head dim 128 only a deeper pipeline: the others spill
            # (dk/dv walking 64 queries, or with 4 warps) or own 64 rows with 8 warps,
            # which compute S and dP twice
            if plan.over == "queries":
                tiles = ((32, 128, 8, 3),) if wide(dims) else ((64, 128, 8, 2), (64, 64, 4, 2))
            else:
                tiles = ((128, 32, 8, 2),) if wide(dims) else \
                    ((128, 32, 4, 2), (128, 64, 8, 3), (64, 64, 4, 2))
            found = [configure(dims, device, hinted=False)] + [config(dims, *t, hinted=False) for t in tiles]
            return hinted_first(configure(dims, device) if any(user.values()) else None, found)

        return configure, candidates


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    prog = AttentionBackwardProgram(kernel, hints, allow_tf32)
    prog.emit()
    configure, candidates = prog.launch_rules()
    emitted = finish(kernel, prog.sig, prog.body, configure, prog.em, hints)
    return emitted.with_candidates(candidates)
