"""The reduce template: sum / max / min / mean / logsumexp along any axis.

Elementwise ops in the region before the reduction are evaluated at the tile
(a prologue); the reduction accumulates in a [BLOCK_O, BLOCK_R] tile over
chunks of the row and is collapsed once at the end. logsumexp keeps a running
max `m` and a running sum `s` rescaled by exp(m_old - m_new); a row that is
all -inf gives -inf, and the rescale never computes inf - inf.
"""

from __future__ import annotations

from tiledsl import ops
from tiledsl.ir import KernelOp
from tiledsl.types import DType

from .base import EmittedKernel, Hints, finish
from .codegen import Code, Signature
from .expr import Val
from .rows import row_configure, row_tile

_COMBINE = {"sum": "{acc} + {x}", "mean": "{acc} + {x}", "max": "tl.maximum({acc}, {x})",
            "min": "tl.minimum({acc}, {x})"}
_COLLAPSE = {"sum": "tl.sum", "mean": "tl.sum", "max": "tl.max", "min": "tl.min"}


def _identity(kind: str, cat: str) -> str:
    if kind in ("sum", "mean"):
        return "0.0" if cat == "f" else "0"
    if cat == "f":
        return '-float("inf")' if kind == "max" else 'float("inf")'
    return "-2147483648" if kind == "max" else "2147483647"


def find_op(kernel: KernelOp, category: str) -> int:
    """The value id of the single op of `category` in a kernel's region."""
    region = kernel.region
    found = [len(region.inputs) + i for i, r in enumerate(region.ops)
             if ops.category(r.op.kind) == category]
    assert len(found) == 1 and region.outputs == (found[0],), (
        f"{kernel.name}: the {category} template computes one {category} op as its only output")
    return found[0]


def emit(kernel: KernelOp, hints: Hints) -> EmittedKernel:
    region = kernel.region
    red = find_op(kernel, "reduction")
    rop = region.ops[red - len(region.inputs)]
    op, (operand,) = rop.op, rop.operands
    src_type = region.value_type(operand)
    kind, axis = op.kind, op.attr("axis")

    sig, body = Signature(), Code()
    refs = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
            if not inp.scalar}
    scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
    out = sig.tensor("out", 0, ()).ptr
    tile = row_tile(sig, body, src_type.shape, axis)
    em = tile.em
    cat = "f" if kind in ("mean", "logsumexp") or src_type.dtype.is_float else "i"
    compute = {"f": "tl.float32", "i": "tl.int32"}[cat]

    body("r_base = tl.arange(0, BLOCK_R)")
    if kind == "logsumexp":
        body('m = tl.full([BLOCK_O], -float("inf"), tl.float32)')
        body("s = tl.zeros([BLOCK_O], tl.float32)")
    else:
        body(f"acc = tl.full([BLOCK_O, BLOCK_R], {_identity(kind, cat)}, {compute})")
    body(f"for r0 in range(0, {tile.length}, BLOCK_R):")
    with body.indent():
        body("r = r0 + r_base")
        body(f"tmask = omask[:, None] & (r < {tile.length})[None, :]")
        inputs = tile.emit_inputs(region, refs, scalars, "r", "tmask")
        vals = em.run(region, inputs, lambda o: tile.index(o, "r"), skip=lambda v: v == red)
        x = em.tensor(em.convert(vals[operand], cat))
        if kind == "logsumexp":
            body(f'x = tl.where(tmask, {x.text}, -float("inf"))')
            body("m_new = tl.maximum(m, tl.max(x, axis=1))")
            # guard: a row that is all -inf (or hits +inf) must not compute inf - inf
            body('m_safe = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)')
            body("s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)")
            body("m = m_new")
        else:
            body(f"x = tl.where(tmask, {x.text}, {_identity(kind, cat)})")
            body("acc = " + _COMBINE[kind].format(acc="acc", x="x"))
    if kind == "logsumexp":
        body('m_safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)')
        body("res = m_safe + tl.log(s)")
    else:
        body(f"res = {_COLLAPSE[kind]}(acc, axis=1)")
        if kind == "mean":
            body(f"res = res / {tile.length}")
    result = Val("res", cat)
    body(f"tl.store({out} + o, {em.store_value(result, op.dtype)}, mask=omask)")
    assert op.dtype is not DType.BOOL or kind in ("max", "min")
    return finish(kernel, "reduce", sig, body, em=tile.em, configure=row_configure(src_type.shape, axis))
