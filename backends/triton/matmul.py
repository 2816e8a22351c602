"""The matmul template: batched C = A @ B with f32 accumulation.

One program per (batch index, BLOCK_M x BLOCK_N tile); tiles are visited in
grouped order (GROUP_M rows of tiles at a time) so neighbouring programs
share A and B tiles in L2. Batch dims broadcast through strides (a missing or
size-1 batch dim reads the same matrix); any input strides work, so `k.T` is
read in place. Tails in M, N and K are masked (K = 1 included). fp32 dots use
IEEE precision unless the program opted into tf32. Triton's interpreter
multiplies bf16 dot operands as raw bits, so when `INTERPRETER` is set they
are widened to f32 first.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl.ir import KernelOp
from tiledsl.types import DType

from .base import (
    EmittedKernel,
    Hints,
    LaunchConfig,
    cdiv,
    decompose,
    find_op,
    finish,
    hint,
    numel,
    require_dot_hints,
)
from .codegen import Code, Signature, next_pow2
from .expr import Emitter, Val

DOT_HINTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    require_dot_hints(hints, DOT_HINTS)
    region = kernel.region
    mm = find_op(kernel, "matmul")
    rop = region.ops[mm - len(region.inputs)]
    op = rop.op
    a_val, b_val = rop.operands
    assert a_val < len(region.inputs) and b_val < len(region.inputs), "matmul reads its inputs"
    a_type, b_type = region.value_type(a_val), region.value_type(b_val)
    out_shape = op.shape
    batch = out_shape[:-2]

    sig, body = Signature(), Code()
    em = Emitter(body)
    a = sig.tensor("in", a_val, a_type.shape)
    b = sig.tensor("in", b_val, b_type.shape)
    c = sig.tensor("out", 0, out_shape)
    M, N, K = sig.size(out_shape[-2]), sig.size(out_shape[-1]), sig.size(a_type.shape[-1])
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"):
        sig.constexpr(name)

    body("pid = tl.program_id(0)")
    body(f"tiles_m = tl.cdiv({M}, BLOCK_M)")
    body(f"tiles_n = tl.cdiv({N}, BLOCK_N)")
    body("tiles = tiles_m * tiles_n")
    body("pid_b = pid // tiles")
    body("t = pid % tiles")
    # grouped order: GROUP_M rows of tiles share the columns they read
    body("width = GROUP_M * tiles_n")
    body("first_m = (t // width) * GROUP_M")
    body("group_m = tl.minimum(tiles_m - first_m, GROUP_M)")
    body("pid_m = first_m + (t % width) % group_m")
    body("pid_n = (t % width) // group_m")

    bnames: list[str | None] = [None if d == 1 else f"b{i}" for i, d in enumerate(batch)]
    if batch:
        body("pb = pid_b.to(tl.int64)")
        decompose(body, "pb", batch, bnames, sig.size, "pq")

    def base(ref, rank: int) -> str:
        lead = len(batch) - (rank - 2)
        off = ref.offset(bnames[lead:] + [None, None]) if rank > 2 else "0"
        return ref.ptr if off == "0" else f"{ref.ptr} + {off}"

    body("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
    body("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    body("rk = tl.arange(0, BLOCK_K)")
    def tile(ref, rank: int, rows: str, cols: str, shape: str) -> str:
        """Pointers of a matrix tile; broadcast when a literal size-1 dim has no stride."""
        ptrs = f"{base(ref, rank)} + {ref.offset([None] * (rank - 2) + [rows, cols])}"
        if ref.strides[-2] is None or ref.strides[-1] is None:
            ptrs = f"tl.broadcast_to({ptrs}, {shape})"
        return ptrs

    body(f"a_ptrs = {tile(a, a_type.rank, 'rm[:, None]', 'rk[None, :]', '[BLOCK_M, BLOCK_K]')}")
    body(f"b_ptrs = {tile(b, b_type.rank, 'rk[:, None]', 'rn[None, :]', '[BLOCK_K, BLOCK_N]')}")
    body("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
    dot_dtype = op.dtype
    precision = ""
    if dot_dtype is DType.F32:
        precision = ', input_precision="tf32"' if allow_tf32 else ', input_precision="ieee"'
    body(f"for k0 in range(0, {K}, BLOCK_K):")
    with body.indent():
        body(f"kmask = rk < {K} - k0")
        body(f"a = tl.load(a_ptrs, mask=(rm[:, None] < {M}) & kmask[None, :], other=0.0)")
        body(f"b = tl.load(b_ptrs, mask=kmask[:, None] & (rn[None, :] < {N}), other=0.0)")
        for name, t in (("a", a_type), ("b", b_type)):
            if t.dtype is not dot_dtype:  # mixed operands meet in the promoted dtype (f32)
                body(f"{name} = {em.widen(name, t.dtype)}")
        if dot_dtype is DType.BF16:
            # the interpreter multiplies bf16 dot operands as raw bits
            body("if INTERPRETER:")
            with body.indent():
                body(f"a = {em.widen('a', DType.BF16)}")
                body(f"b = {em.widen('b', DType.BF16)}")
        body(f"acc = tl.dot(a, b, acc{precision})")
        a_step, b_step = a.strides[-1], b.strides[-2]
        if a_step is not None:
            body(f"a_ptrs += BLOCK_K * {a_step}")
        if b_step is not None:
            body(f"b_ptrs += BLOCK_K * {b_step}")
    out = em.store_value(Val("acc", "f"), op.dtype)
    c_ptrs = tile(c, len(out_shape), "rm[:, None]", "rn[None, :]", "[BLOCK_M, BLOCK_N]")
    body(f"tl.store({c_ptrs}, {out}, mask=(rm[:, None] < {M}) & (rn[None, :] < {N}))")

    user = {n: hint(hints, n, 0) for n in (*DOT_HINTS, "GROUP_M", "num_warps", "num_stages")}
    m_dim, n_dim, k_dim = out_shape[-2], out_shape[-1], a_type.shape[-1]

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        size = {s: (d if isinstance(d, int) else dims[d]) for s, d in
                (("M", m_dim), ("N", n_dim), ("K", k_dim))}
        if device == "cuda":
            big, bk = 128, (64 if dot_dtype is not DType.F32 else 32)
        else:
            big, bk = 128, 128
        bm = user["BLOCK_M"] or max(16, min(next_pow2(size["M"]), big))
        bn = user["BLOCK_N"] or max(16, min(next_pow2(size["N"]), big))
        bk = user["BLOCK_K"] or max(16, min(next_pow2(size["K"]), bk))
        tiles = cdiv(size["M"], bm) * cdiv(size["N"], bn) * numel(batch, dims)
        warps = user["num_warps"] or (8 if bm * bn >= 128 * 128 else 4)
        stages = user["num_stages"] or 3
        constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "GROUP_M": user["GROUP_M"] or 8}
        return LaunchConfig((tiles,), constexprs, warps, stages)

    return finish(kernel, "matmul", sig, body, configure, em)
