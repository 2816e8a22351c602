"""The softmax template: softmax along any axis, rows of any length.

When a row fits in one block (`ONE_PASS`), it is read once and kept in
registers. Otherwise a first loop keeps the running max `m` and running sum
`z` (rescaled by exp(m_old - m_new) when the max grows: the composable-kernel
recurrence) and a second loop writes exp(x - m) / z, so the row is read
twice. A row that is all -inf yields 0, never NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl.ir import KernelOp

from .base import EmittedKernel, Hints, LaunchConfig, finish
from .codegen import Code, Signature
from .expr import Val
from .reduce import find_op
from .rows import RowTile, row_configure, row_tile


def emit(kernel: KernelOp, hints: Hints) -> EmittedKernel:
    region = kernel.region
    sm = find_op(kernel, "softmax")
    rop = region.ops[sm - len(region.inputs)]
    op, (operand,) = rop.op, rop.operands
    shape, axis = op.shape, op.attr("axis")

    sig, body = Signature(), Code()
    refs = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
            if not inp.scalar}
    scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
    out = sig.tensor("out", 0, shape)
    tile = row_tile(sig, body, shape, axis)
    sig.constexpr("ONE_PASS")

    def load_row(r: str) -> str:
        """Emit the (masked, -inf padded) scores of one chunk; returns their name."""
        body(f"tmask = omask[:, None] & ({r} < {tile.length})[None, :]")
        inputs = tile.emit_inputs(region, refs, scalars, r, "tmask")
        vals = tile.em.run(region, inputs, lambda o: tile.index(o, r), skip=lambda v: v == sm)
        x = tile.em.tensor(tile.em.convert(vals[operand], "f"))
        body(f'x = tl.where(tmask, {x.text}, -float("inf"))')
        return "x"

    def store(t: RowTile, value: str, r: str) -> None:
        ptr = t.pointer(out, len(shape), r) or f"tl.broadcast_to({out.ptr}, [BLOCK_O, BLOCK_R])"
        text = t.em.store_value(Val(value, "f"), op.dtype)
        body(f"tl.store({ptr}, {text}, mask=tmask)")

    body("r_base = tl.arange(0, BLOCK_R)")
    body("if ONE_PASS:")
    with body.indent():
        body("r = r_base")
        load_row("r")
        body("m = tl.max(x, axis=1)")
        body('m_safe = tl.where(m == -float("inf"), 0.0, m)')
        body("e = tl.exp(x - m_safe[:, None])")
        body("z = tl.sum(e, axis=1)")
        body("inv = tl.where(z > 0.0, 1.0 / z, 0.0)")
        store(tile, "e * inv[:, None]", "r")
    body("else:")
    with body.indent():
        body('m = tl.full([BLOCK_O], -float("inf"), tl.float32)')
        body("z = tl.zeros([BLOCK_O], tl.float32)")
        body(f"for r0 in range(0, {tile.length}, BLOCK_R):")
        with body.indent():
            body("r = r0 + r_base")
            load_row("r")
            body("m_new = tl.maximum(m, tl.max(x, axis=1))")
            body('m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)')
            body("z = z * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)")
            body("m = m_new")
        body('m_safe = tl.where(m == -float("inf"), 0.0, m)')
        body("inv = tl.where(z > 0.0, 1.0 / z, 0.0)")
        body(f"for r0 in range(0, {tile.length}, BLOCK_R):")
        with body.indent():
            body("r = r0 + r_base")
            load_row("r")
            store(tile, "tl.exp(x - m_safe[:, None]) * inv[:, None]", "r")

    rows = row_configure(shape, axis)

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        cfg = rows(dims, device)
        length = shape[axis] if isinstance(shape[axis], int) else dims[shape[axis]]
        one_pass = length <= cfg.constexprs["BLOCK_R"]
        return LaunchConfig(cfg.grid, {**cfg.constexprs, "ONE_PASS": one_pass}, cfg.num_warps)

    return finish(kernel, "softmax", sig, body, em=tile.em, configure=configure)
