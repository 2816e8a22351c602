"""The combine launch of a split row program: its partials merged, its tail computed.

A split row program (`RowPlan.split`, `row_split.py`) leaves, for each reduction across its
rows, one partial per chunk of CHUNK rows, group (an index of the other kept dims) and
position along the row: a workspace of [chunks, groups, positions]; or, where the reduced
value is one per row, one per block of BLOCK_O rows and group: [blocks, groups]. Program
`grp`, `wb` of the combine merges the partials of its group at BLOCK_W positions, a tile of
them at a time, in chunk or block order (the same order at every grid: the bits do not
depend on how the rows were split among programs; for blocks, not on CHUNK either),
finalizes each reduction (a mean divides by the dim's size), computes the elementwise ops
of the plan's `tail` from them (constants, scalars and inputs at its positions recomputed)
and stores the tail's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tiledsl.ir import KernelOp, walk

from .base import EmittedKernel, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, next_pow2
from .expr import TRITON_TYPE, Emitter, Val, literal
from .row_reduce import F32, collapse

# partials a combine program merges at once (a literal: the merge order is the kernel's):
# chunks' at each of its positions along the row, and blocks' of a value one per row (a loss
# over a million tokens, a block each, merged in a thousand steps)
COMBINE_CHUNKS = 16
COMBINE_BLOCKS = 1024
# positions along the row a combine program merges (a [BLOCK_W, COMBINE_CHUNKS] tile)
COMBINE_WIDTH = 256


def emit_combine(prog, kernel: KernelOp, main: Callable[[Mapping[str, int], str], LaunchConfig]) \
        -> EmittedKernel:
    """The combine launch of the split row program `prog` (a `rows.RowProgram` that has
    emitted its body); `main` configures the program, whose CHUNK the combine reads."""
    from tiledsl.types import compute_type

    plan, region = prog.plan, prog.region
    sig, body = Signature(), Code()
    em = Emitter(body)
    shape, axes, across = plan.shape, plan.axes, plan.across
    kept = prog.kept
    groups = sig.numel(tuple(shape[d] for d in kept), "n_rows")
    length = sig.size(shape[axes[0]]) if len(axes) == 1 else \
        sig.numel(tuple(shape[a] for a in axes), "n_cols")
    size = sig.size(shape[across])
    wide_rows = any(plan.full(v) for v in plan.tail)  # some tail value varies along the row
    width = length if wide_rows else "1"
    for name in ("BLOCK_W", "CHUNK", "BLOCK_O"):
        sig.constexpr(name)
    body("pid = tl.program_id(0)")
    kinds = {plan.full(prog.operands(v)[0]) for v in plan.across_reducing}  # along the row, or not
    if True in kinds:
        body(f"n_chunks = tl.cdiv({size}, CHUNK)")
    if False in kinds:
        body(f"n_blocks = tl.cdiv({size}, BLOCK_O)")
    body(f"n_w = tl.cdiv({width}, BLOCK_W)")
    body("grp = pid // n_w")
    body("w = pid % n_w * BLOCK_W + tl.arange(0, BLOCK_W)")
    body(f"wmask = w < {width}")
    names = [None if shape[d] == 1 else f"j{d}" for d in kept]
    decompose(body, "grp", [shape[d] for d in kept], names, sig.size, "q")
    if len(axes) > 1 and wide_rows:
        decompose(body, "w", [shape[a] for a in axes], [None if shape[a] == 1 else f"k{a}" for a in axes],
                  sig.size, "kq")
    vals: dict[int, Val] = {}
    for k, v in enumerate(sorted(plan.across_reducing)):
        red, cat = prog.reduction(v), prog.reduce_cat(v)
        full = plan.full(prog.operands(v)[0])
        work = sig.workspace(k)
        identity = prog.identity(red.identity, cat)
        compute = "tl.float64" if prog.wide(v) else TRITON_TYPE[cat]
        acc = em.fresh("acc")
        # a value along the row: its chunks' partials at the program's positions; one per
        # row: its blocks' (more of them), a thousand at a time, then given to every position
        body(f"{acc} = tl.full([{'BLOCK_W' if full else '1'}, 1], {identity}, {compute})")
        nan = ", propagate_nan=tl.PropagateNan.ALL" if red.nan and cat is F32 else ""
        count, step = ("n_chunks", COMBINE_CHUNKS) if full else ("n_blocks", COMBINE_BLOCKS)
        body(f"for c0 in range(0, {count}, {step}):")
        with body.indent():
            body(f"cs = c0 + tl.arange(0, {step})")
            row = f"(cs[None, :] * {groups} + grp).to(tl.int64)"
            at, mask = (f"{row} * {length} + w[:, None]", f"(cs < {count})[None, :] & wmask[:, None]") \
                if full else (row, f"(cs < {count})[None, :]")
            tile = em.fresh("t")
            body(f"{tile} = tl.load({work} + {at}, mask={mask}, other={identity})")
            body(f"{acc} = {red.combine.format(a=acc, b=collapse(em, red, cat, tile), nan=nan)}")
        if not full:
            body(f"{acc} = tl.broadcast_to({acc}, [BLOCK_W, 1])")
        total = Val(acc, cat)
        if red.finalize is not None:
            total = em.assign("(" + red.finalize.format(total=acc, length=size) + ")", cat)
        if prog.wide(v):
            total = em.assign(f"{total.text}.to(tl.float32)", cat)
        vals[v] = total

    def at(ref, v: int) -> tuple[str, str]:
        """The pointers and mask of value `v`'s elements at the combine's positions: along
        the row where it varies along it (else the position's first lane holds it)."""
        index = []
        for d in plan.layouts[v]:
            if d is None or shape[d] == 1:
                index.append(None)
            elif d in axes:
                index.append("w[:, None]" if len(axes) == 1 else f"k{d}[:, None]")
            else:
                index.append(f"j{d}")
        full = plan.full(v)
        ptr = f"{ref.ptr} + {ref.offset(index)}" + ("" if full else " + w[:, None] * 0")
        return ptr, "wmask[:, None]" if full else "(w == 0)[:, None]"

    # the tail's outputs and what they read: the merged reductions, and the constants,
    # scalars and inputs read at the combine's positions (and elementwise ops of those)
    # computed again here
    tail_outputs = [v for v in region.outputs if v in plan.tail]
    needed = set(walk(tail_outputs, lambda v: () if v in vals else prog.operands(v)))
    for v in sorted(needed - set(vals)):
        if v < len(region.inputs):
            t = region.inputs[v].type
            if region.inputs[v].scalar:
                vals[v] = em.scalar(sig.scalar(v), t)
            elif t.rank == 0:
                vals[v] = em.load_at(sig.tensor("in", v, ()).ptr, None, t)
            else:  # (every lane loads it: the ops reading it are per lane)
                ptr, _ = at(sig.tensor("in", v, t.shape), v)
                vals[v] = em.load_at(ptr, "wmask[:, None]", t)
        elif (rop := region.ops[v - len(region.inputs)]).op.kind == "const":
            vals[v] = literal(rop.op.attr("value"), compute_type(rop.op.dtype))
        else:  # (in the region's order: operands first)
            types = tuple(region.value_type(o) for o in rop.operands)
            vals[v] = em.op(rop.op, [vals[o] for o in rop.operands], types)
    for j, v in enumerate(region.outputs):
        if v not in plan.tail:
            continue
        t = region.value_type(v)
        ptr, mask = at(sig.tensor("out", j, t.shape), v)
        body(f"tl.store({ptr}, {em.store_value(vals[v], t)}, mask={mask})")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        cfg = main(dims, device).constexprs
        w = numel([shape[a] for a in axes], dims) if wide_rows else 1
        block_w = max(2, min(next_pow2(w), COMBINE_WIDTH))
        g = numel([shape[d] for d in kept], dims)
        consts = {"BLOCK_W": block_w, "CHUNK": cfg["CHUNK"], "BLOCK_O": cfg["BLOCK_O"]}
        return LaunchConfig((g * cdiv(w, block_w),), consts, num_warps=4)

    return finish(kernel, sig, body, configure, em, fn_name=f"{kernel.name}_combine")
