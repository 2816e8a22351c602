"""Fusion profitability: which legal fusions are worth forming.

Legality keeps fusions that never add memory traffic or recompute (a consumer
reading its producer at another index is refused there). What is left to
weigh here is work that a fused kernel repeats:

- a GEMM operand prologue is recomputed for every column tile of the output,
  so its ops at the operand's shape may sum to at most `PROLOGUE_BUDGET` units
  per element (the registry's `units`: a cast, a scale, a shift 1; a division or an
  exponential 4): a per-token quantizer `cast(cast(x / s, f8), f32)` qualifies, a chain of
  transcendentals would cost more than the one extra pass over A that materializing it takes.
  A B operand loaded through gathers (a packed int4 weight, a 4-bit code looked up in
  a 16-entry table) is unpacked in the K loop while its ops per element sum to at most
  `GATHERED_PROLOGUE_BUDGET` units;
- a prologue value that something else also uses must be stored anyway, so
  fusing it would only duplicate work;
- an epilogue is capped at `MAX_EPILOGUE_INPUTS` extra tensors, beyond which
  the loads and registers outgrow the benefit;
- a row program longer than a block reads its rows once per reduction phase
  (a reduction that needs an earlier one's result, like layernorm's variance
  after its mean) and recomputes every value between them in each loop, so
  it is capped at `MAX_ROW_PHASES` phases, where storing an intermediate row
  and starting a new kernel costs less; and at `MAX_ROW_OPS` ops, which keeps
  each kernel's registers, source and compile time bounded (and compile time
  linear in the program's length).

And work a fused kernel adds: a cheap elementwise value of a smaller shape
(`sqrt(abs(y))` with `y: [N]` read by an `[M, N]` chain, document ids compared
as `[M, 1] == [1, N]` in an attention mask) can be computed again by every
kernel that reads it, at every element of the reader, instead of by a kernel
of its own. Its own kernel costs a launch (a few microseconds, more than a
small kernel's whole run) and a round trip of its result through memory; the
recompute costs arithmetic in readers that are memory-bound (an H100 does
about 18 f32 operations in the time it loads one byte), so it pays while the
value's expression stays short: `RECOMPUTE_BUDGET` operation units per read
element, each op costing the `units` the registry declares for it (an add 1, an
integer division 2, a transcendental or a division 4).
"""

from __future__ import annotations

from tiledsl import ops

# the most the ops of a plain prologue may cost per element of its operand: a tensor core does
# BLOCK_N (128) products per loaded A element and column tile, in the time of about 16 of them
# per f32 instruction on an H100's CUDA cores (989 dense bf16 TFLOPS against 67 f32), so about 8
# instructions per element hide under the dot (4 under an f8 dot, twice as fast)
PROLOGUE_BUDGET = 8
# a B operand loaded through gathers (a packed int4 weight, its zero points and scales read at
# k // 8, k // G; an NF4 code's value in a 16-entry table) unpacks each tile element with the
# ops computing it at the operand's shape: GPTQ's take 14 units (three gathers, two shifts and
# masks, the zero point's subtraction, the cast and the scale; NF4's 11, MXFP4's 17), against
# a stored f16 weight's pass through memory and a tensor core's 64 or more products per loaded
# element; ops at a smaller shape (`k // 8` along K) are computed once per row or column of the tile
GATHERED_PROLOGUE_BUDGET = 24
MAX_EPILOGUE_INPUTS = 8
# a dual GEMM keeps one f32 accumulator tile per matmul in registers: two of 128 x 128 fill
# a Hopper warpgroup pair's budget
MAX_ACCUMULATORS = 2
MAX_ROW_PHASES = 8
MAX_ROW_OPS = 256
# a kernel moving less than this (at sizes fixed in the program) is launch-bound: at ~3 TB/s
# it runs for about a microsecond, less than a launch costs
LAUNCH_BOUND_BYTES = 4 << 20
RECOMPUTE_BUDGET = 16


def recompute_refusal(units: int) -> str | None:
    """Why a value costing `units` per element should not be computed again by each reader."""
    if units > RECOMPUTE_BUDGET:
        return (f"recomputing it costs {units} operation units per element, more than the "
                f"{RECOMPUTE_BUDGET} a memory-bound reader hides")
    return None


def prologue_refusal(kind: str, users_outside: bool, spent: int = 0,
                     budget: int = PROLOGUE_BUDGET) -> str | None:
    """Why an elementwise op on a GEMM operand should not fuse into the operand load, where
    the prologue's ops admitted so far cost `spent` units per element of its `budget`."""
    if users_outside:
        return "its value is also used elsewhere, so it is stored anyway"
    if spent + ops.units(kind) > budget:
        return (f"{kind} would be recomputed for every column tile of the output; with it the "
                f"prologue costs {spent + ops.units(kind)} units per element, more than the "
                f"{budget} the dot hides")
    return None


def unpacking_refusal(units: int) -> str | None:
    """Why a gathered operand whose ops cost `units` per element should not be unpacked in
    the K loop."""
    if units > GATHERED_PROLOGUE_BUDGET:
        return (f"unpacking it costs {units} units per element of every tile, more than the "
                f"{GATHERED_PROLOGUE_BUDGET} a GEMM's K loop hides")
    return None
