"""Triton renderings for the common shapes of elementwise op (`renderings.py` says which op
renders how).

A rendering is `render(em, op, args, out) -> value`: `em` is the Triton
emitter (`backends/triton/expr.py`), `args` are the operands already read as
the op's `Reads` says, `out` is the result's compute type. The emitter's
`assign`, `tensor`, `convert` and `literal` are all a rendering needs; the
strings here are Triton source with `{x}` (or `{a}`, `{b}`) for operands.

Ops whose IR dtype is f32 get f32-accurate forms (`precise`): the fast forms
(a GPU's `ex2.approx` and `div.full`, NumPy's SIMD f32 `exp` in the
interpreter) are off by 2 ulp or more, which the test oracle (2 x a correctly
rounded eager error) does not allow at large magnitudes. f16/bf16 ops keep the
fast f32 forms: their error is far below a half-precision ulp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tiledsl.types import Compute, DType

# (emitter, op, operands read as `reads` says, the result's compute type) -> value
Render = Callable[..., Any]

NAN_ALL = ", propagate_nan=tl.PropagateNan.ALL"


def is_precise(op: Any, out: Compute) -> bool:
    """An f32 op computed in f32: it gets the f32-accurate form."""
    return out is Compute.F32 and op.dtype is DType.F32


def is_rounded_to_bf16(op: Any, out: Compute) -> bool:
    """An op of a bf16 value computed in f32: its result rounds to 8 bits of mantissa, so a
    hardware approximation of relative error 2^-11 (tanh.approx.f32) is a quarter of that
    rounding and within the oracle's bound. Not f16: its half-ulp rounding is 2^-12, under
    that error, and the approximation plus the rounding could pass twice eager's error."""
    return out is Compute.F32 and op.dtype is DType.BF16


def in_wide_type(em, op: Any, out: Compute, x) -> tuple[Compute, str]:
    """A form with cancellation computes in f64 for f32 ops (its error then stays below an f32
    ulp), else in the op's compute type: that type, and the operand's text in it."""
    cat = Compute.F64 if is_precise(op, out) else out
    return cat, em.convert(em.tensor(x), cat).text


def unary(text: str, precise: str | None = None, wide: str | None = None) -> Render:
    """One expression over `{x}`; `precise` for f32 ops, `wide` for f64 (weak) values."""

    def render(em, op, args, out):
        (x,) = args
        x = em.tensor(x)
        form = text
        if precise is not None and is_precise(op, out):
            form = precise
        elif wide is not None and out is Compute.F64:
            form = wide
        return em.assign(form.format(x=x.text), out)

    return render


def binary(text: str, precise: str | None = None) -> Render:
    """An infix expression over `{a}` and `{b}` (`precise` for f32 ops). Literal operands stay
    literals so Triton folds them, unless both are (then the expression needs a tensor)."""

    def render(em, op, args, out):
        a, b = args
        if precise is not None and is_precise(op, out):
            a, b = em.tensor(a), em.tensor(b)
            return em.assign(precise.format(a=a.text, b=b.text), out)
        if a.literal and b.literal:
            a = em.tensor(a)
        return em.assign(text.format(a=a.text, b=b.text), out)

    return render


def nan_propagating(function: str) -> Render:
    """`tl.maximum`/`tl.minimum`: NaN wins, as in torch."""

    def render(em, op, args, out):
        a, b = (em.tensor(x) for x in args)
        nan = NAN_ALL if out.is_float else ""
        return em.assign(f"tl.{function}({a.text}, {b.text}{nan})", out)

    return render


def compare(symbol: str) -> Render:
    def render(em, op, args, out):
        a, b = args
        return em.assign(f"{a.text} {symbol} {b.text}", Compute.BOOL)

    return render


def any_of(*conds: str) -> str:
    """Source text of `c1 | c2 | ...` as selects: Triton's interpreter cannot `|` or `&`
    0-d comparison results (NumPy scalars), and a GPU compiles both forms alike."""
    text = conds[-1]
    for c in reversed(conds[:-1]):
        text = f"tl.where({c}, True, {text})"
    return text


def all_of(*conds: str) -> str:
    """`c1 & c2 & ...` as selects (see `any_of`)."""
    text = conds[-1]
    for c in reversed(conds[:-1]):
        text = f"tl.where({c}, {text}, False)"
    return text


def take(em, op, args, out):
    """`x[i0, i1, ...]`: a load through the indices from the source tensor the template
    handed over as `args[0].source` (negative indices count from the end; an index out of
    range reads 0). An index that is the program's own position along an axis of x's size
    (`Val.bound`) needs neither: the template's mask keeps its lanes in range."""
    x, *indices = args
    src = x.source
    terms, inside = [], []
    for i, size, stride in zip(indices, src.sizes, src.ref.strides, strict=True):
        if i.bound is not None and i.bound == size:  # the program's own position along the axis
            j = i  # (times a stride: int64 where the kernel's sizes are, WIDE)
            inside.insert(0, em.mask)
        else:
            # an i64 index (a loaded label) in i64, checked before any narrowing; a narrower one
            # as it is in a template bounding its positions (`mask`: pointwise, whose sizes and
            # strides are int64 where offsets may not fit, WIDE), else widened
            i = em.tensor(i)
            wide = i.cat is Compute.I64 or em.mask is None
            j = em.assign(f"tl.where({i.text} < 0, {i.text} + {size}, {i.text})"
                          + (".to(tl.int64)" if wide else ""), Compute.I64 if wide else i.cat)
            inside += [f"{j.text} >= 0", f"{j.text} < {size}"]
        if stride is not None:
            terms.append(f"{j.text} * {stride}")
    ptrs = " + ".join([src.ref.ptr, *terms])
    # the checks of one index first, combined before the tile's mask (a row's before a column's)
    return em.load_at(ptrs, all_of(*dict.fromkeys(inside)), src.type)
