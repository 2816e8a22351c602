"""Elementwise ops of two or three operands: arithmetic, comparisons, logic and bits, `where`.

The infix operators (`+ - * / & | ^ << >>` and comparisons) promote like torch's, with
literals and dims as weak Python scalars; the reference backend calls Python's
`operator` functions on them, so a scalar on either side means what it means
in torch code.
"""

from __future__ import annotations

import math
import operator

import torch

from tiledsl import diagnostics as diag
from tiledsl.types import NARROW, Compute, DType, TensorType, all_weak, result_dtype

from .core import BParam, Category, Infer, Reads, RuleError, define
from .render import NAN_ALL, all_of, any_of, binary, compare, in_wide_type, is_precise, nan_propagating
from .rules import broadcast, float_of

ELEMENTWISE = Category.ELEMENTWISE


def _arith(types, attrs):
    return TensorType(result_dtype(types), broadcast(types), all_weak(types))


def _true_div(types, attrs):
    return TensorType(float_of(result_dtype(types)), broadcast(types), all_weak(types))


def _compare(types, attrs):
    return TensorType(DType.BOOL, broadcast(types), all_weak(types))


def _logical(symbol: str, hint: str = "compare first, e.g. (x > 0)") -> Infer:
    def infer(types, attrs):
        for i, t in enumerate(types):
            if t.dtype.is_float:
                raise RuleError(diag.DTypeError, (i,), message=(
                    f"'{symbol}' needs bool or integer operands, got {t.dtype}; {hint}"))
        return TensorType(result_dtype(types), broadcast(types), all_weak(types))

    return infer


def _shift(symbol: str) -> Infer:
    def infer(types, attrs):
        for i, t in enumerate(types):
            if not t.dtype.is_int:
                raise RuleError(diag.DTypeError, (i,), message=(
                    f"'{symbol}' shifts integers, got {t.dtype}"))
        return _arith(types, attrs)

    return infer


def _operator(kind, symbol, infer, function, triton, units=1, vjp=None) -> None:
    define(kind, 2, ELEMENTWISE, infer, reads=Reads.PROMOTED, symbol=symbol, fold=function,
           reference=function, triton=triton, units=units, vjp=vjp)


# derivative rules (`tiledsl.autodiff`), as torch's derivatives.yaml writes them
def _d_div(d, wanted):
    return d.div(d.g, d.x(1)), d.neg(d.div(d.mul(d.g, d.x(0)), d.mul(d.x(1), d.x(1))))


_operator("add", "+", _arith, operator.add, binary("{a} + {b}"), units=1,
          vjp=lambda d, w: (d.g, d.g))
_operator("sub", "-", _arith, operator.sub, binary("{a} - {b}"), units=1,
          vjp=lambda d, w: (d.g, d.neg(d.g)))
_operator("mul", "*", _arith, operator.mul, binary("{a} * {b}"), units=1,
          vjp=lambda d, w: (d.mul(d.g, d.x(1)), d.mul(d.g, d.x(0))))
def _render_true_div(em, op, args, out):
    """IEEE division, except that a divisor which is one value for the whole program (a
    by-value argument, a literal, or their products) becomes a product with its reciprocal,
    computed once: what eager torch does on a GPU for a scalar divisor ("may lose one bit of
    precision", `div_true_kernel_cuda`), so within the oracle, and one multiply an element
    instead of a division (Gemma-2's `s / cap`; a softmax's temperature). The reciprocal is
    correctly rounded for f32 ops, Triton's fast one for the others (rounded to 16 bits)."""
    a, b = args
    if out is Compute.F32 and (b.uniform or b.literal) and op.type.rank > 0:
        return em.assign(f"{em.tensor(a).text} * {em.reciprocal(b, is_precise(op, out)).text}", out)
    return _DIVIDE(em, op, args, out)


_DIVIDE = binary("{a} / {b}", "tl.div_rn({a}, {b})")
_operator("div", "/", _true_div, operator.truediv, _render_true_div, units=4, vjp=_d_div)


def _numeric(symbol: str) -> Infer:
    def infer(types, attrs):
        for i, t in enumerate(types):
            if t.dtype is DType.BOOL:
                raise RuleError(diag.DTypeError, (i,),
                                message=f"'{symbol}' is not defined for bool values")
        return _arith(types, attrs)

    return infer


def _integral(a, b) -> bool:
    return not torch.result_type(a, b).is_floating_point


def _int_division(function):
    """torch's `//` and `%` on tensors, except that an integer divisor of 0 gives 0 (torch
    raises; a GPU kernel cannot, and NumPy gives 0 too)."""
    def reference(a, b):
        if not _integral(a, b):
            return function(a, b)
        b = torch.as_tensor(b)
        return torch.where(b == 0, 0, function(a, torch.where(b == 0, 1, b)))

    def fold(a, b):
        if isinstance(a, int) and isinstance(b, int) and b == 0:
            return 0
        return function(a, b)

    return reference, fold


def _render_division(remainder: bool):
    """Floor semantics (Python's, torch's) from Triton's truncating `%` (C's fmod)."""
    def render(em, op, args, out):
        if out.is_float:
            return _float_division(em, args, out, remainder)
        if out in NARROW:  # in i32, where a - r cannot wrap; the result fits the narrow type
            wide = [em.convert(x, Compute.I32) for x in args]
            return em.convert(_int_division_render(em, wide, Compute.I32, remainder), out)
        return _int_division_render(em, args, out, remainder)

    return render


def _int_division_render(em, args, out, remainder):
    a, b = args
    a = em.tensor(a).text
    if b.literal and b.value not in (0, -1):
        # a literal divisor (`i // 2`, `j % w`): one fix-up of the remainder's sign
        fix = "<" if b.value > 0 else ">"
        r = em.assign(f"{a} % {b.text}", out).text
        r = em.assign(f"tl.where({r} {fix} 0, {r} + {b.text}, {r})", out).text
        return em.assign(r if remainder else f"({a} - {r}) // {b.text}", out)
    b = em.tensor(b).text
    # 0 and -1 divide as 1 (x // 0 is 0; INT_MIN // -1 wraps to INT_MIN, as in torch)
    zero_or_minus_one = any_of(f"{b} == 0", f"{b} == -1")
    safe = em.assign(f"tl.where({zero_or_minus_one}, 1, {b})", out).text
    r = em.assign(f"{a} % {safe}", out).text
    cross = all_of(f"{r} != 0", f"({r} < 0) != ({safe} < 0)")
    r = em.assign(f"tl.where({cross}, {r} + {safe}, {r})", out).text
    if remainder:
        return em.assign(f"tl.where({zero_or_minus_one}, 0, {r})", out)
    q = em.assign(f"({a} - {r}) // {safe}", out).text
    return em.assign(f"tl.where({b} == 0, 0, tl.where({b} == -1, 0 - {a}, {q}))", out)


def _float_division(em, args, out, remainder):
    """torch's floor division and remainder of floats: from fmod, with the quotient rounded
    to the nearest integer when fmod's rounding left it just below one."""
    a, b = (em.tensor(x).text for x in args)
    m = em.assign(f"{a} % {b}", out).text
    cross = all_of(f"{m} != 0", f"({b} < 0) != ({m} < 0)")
    if remainder:
        return em.assign(f"tl.where({cross}, {m} + {b}, {m})", out)
    div = "tl.div_rn({0}, {1})" if out is Compute.F32 else "{0} / {1}"
    d = em.assign(div.format(f"{a} - {m}", b), out).text
    d = em.assign(f"tl.where({cross}, {d} - 1.0, {d})", out).text
    f = em.assign(f"tl.floor({d})", out).text
    f = em.assign(f"tl.where({d} - {f} > 0.5, {f} + 1.0, {f})", out).text
    return em.assign(f"tl.where({b} == 0, {div.format(a, b)}, {f})", out)


_floordiv_ref, _floordiv_fold = _int_division(operator.floordiv)
_mod_ref, _mod_fold = _int_division(operator.mod)
# a floor quotient is piecewise constant: no gradient; torch.remainder's gradient is
# (g, -g * floor(a / b))
define("floordiv", 2, ELEMENTWISE, _numeric("//"), reads=Reads.PROMOTED, symbol="//",
       fold=_floordiv_fold, reference=_floordiv_ref, triton=_render_division(False), units=2,
       vjp=lambda d, w: (None, None))
define("mod", 2, ELEMENTWISE, _numeric("%"), reads=Reads.PROMOTED, symbol="%", fold=_mod_fold,
       reference=_mod_ref, triton=_render_division(True), units=2,
       vjp=lambda d, w: (d.g, d.neg(d.mul(d.g, d.call("floordiv", d.x(0), d.x(1))))))


def _int_negative_power(a, b):
    """An integer to a negative integer power: the true value truncated (0 unless |a| is 1)."""
    return 1 if a == 1 else ((-1 if b & 1 else 1) if a == -1 else 0)


def _pow_fold(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return _int_negative_power(a, b) if b < 0 else a**b
    return math.pow(a, b)  # a ValueError (a negative base to a fraction) stays a run-time NaN


def _pow_reference(a, b):
    if not _integral(a, b):
        return torch.pow(a, b)
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    negative = torch.where(a == 1, 1, torch.where(a == -1, 1 - 2 * (b & 1), 0))
    return torch.where(b < 0, negative, torch.pow(a, torch.where(b < 0, 0, b)))


# x ** literal: the forms torch uses for these exponents
_LITERAL_POWERS = {0: "{x} * 0 + 1", 1: "{x}", 2: "{x} * {x}", 3: "{x} * {x} * {x}"}
_RECIPROCALS = {-0.5: "{sqrt}", -1: "{x}", -2: "{x} * {x}"}


def _render_pow(em, op, args, out):
    a, b = args
    if b.literal and b.value in _LITERAL_POWERS and (out.is_float or b.value >= 0):
        x = em.tensor(a).text
        if b.value == 0 and out.is_float:
            return em.assign(f"tl.zeros_like({x}) + 1.0", out)  # NaN ** 0 is 1
        return em.assign(_LITERAL_POWERS[b.value].format(x=x), out)
    if not out.is_float:
        return _int_power(em, em.tensor(a).text, em.tensor(b).text, out)
    if b.literal and (b.value == 0.5 or b.value in _RECIPROCALS):
        x = em.tensor(a).text
        precise = is_precise(op, out)
        sqrt = f"tl.sqrt_rn({x})" if precise else f"tl.sqrt({x})"
        if b.value == 0.5:
            return em.assign(sqrt, out)
        den = em.assign(_RECIPROCALS[b.value].format(x=x, sqrt=sqrt), out).text
        return em.assign(f"tl.div_rn(tl.full([], 1.0, tl.float32), {den})" if precise
                         else f"1.0 / {den}", out)
    return _float_power(em, op, a, b, out)


def _int_power(em, a, b, out):
    """Square and multiply over the exponent's bits (wrapping like torch's integers)."""
    r, base, e = em.fresh(), em.fresh(), em.fresh()
    em.code(f"{r} = {a} * 0 + {b} * 0 + 1")
    em.code(f"{base} = {a} + {b} * 0")
    em.code(f"{e} = {b} + {a} * 0")
    bits = 63 if out is Compute.I64 else 31
    em.code(f"for {em.fresh('k')} in tl.static_range({bits}):")
    with em.code.indent():
        em.code(f"{r} = tl.where(({e} & 1) != 0, {r} * {base}, {r})")
        em.code(f"{base} = {base} * {base}")
        em.code(f"{e} = {e} >> 1")
    negative = f"tl.where({a} == 1, 1, tl.where({a} == -1, 1 - 2 * ({b} & 1), 0))"
    return em.assign(f"tl.where({b} < 0, {negative}, {r})", out)


def _float_power(em, op, a, b, out):
    """exp(b * log|a|) with C's rules for signs, zeros, ones and infinities; f32 ops
    compute it in f64 (its error then stays below an f32 ulp)."""
    cat, a = in_wide_type(em, op, out, a)
    b = in_wide_type(em, op, out, b)[1]
    ax = em.assign(f"tl.abs({a})", cat).text
    r = em.assign(f"tl.exp({b} * tl.log({ax}))", cat).text
    whole = em.assign(f"{b} == tl.floor({b})", Compute.BOOL).text
    odd = em.assign(all_of(whole, f"{b} - 2.0 * tl.floor({b} * 0.5) == 1.0"), Compute.BOOL).text
    negative = any_of(f"{a} < 0", all_of(f"{a} == 0", f"1.0 / {a} < 0"))
    r = em.assign(f"tl.where({negative}, tl.where({whole}, tl.where({odd}, -{r}, {r}), "
                  f"tl.where({a} == -float(\"inf\"), {r}, float(\"nan\"))), {r})", cat).text
    one = any_of(f"{b} == 0", f"{a} == 1", all_of(f"{ax} == 1", f"tl.abs({b}) == float(\"inf\")"))
    return em.convert(em.assign(f"tl.where({one}, 1.0, {r})", cat), out)


def _d_pow(d, wanted):
    """torch's pow_backward (0 where the exponent is 0) and pow_backward_exponent (0 where
    the base is 0 and the exponent not negative)."""
    x, y = d.x(0), d.x(1)
    dx = d.where(d.call("eq", y, d.c(0.0)), d.c(0.0),
                 d.mul(d.g, y, d.call("pow", x, d.sub(y, d.c(1.0)))))
    dy = d.where(d.call("and", d.call("eq", x, d.c(0.0)), d.call("ge", y, d.c(0.0))), d.c(0.0),
                 d.mul(d.g, d.y, d.call("log", x))) if wanted[1] else None
    return dx, dy


define("pow", 2, ELEMENTWISE, _numeric("**"), reads=Reads.PROMOTED, symbol="**",
       params=(BParam("x"), BParam("y")), fold=_pow_fold, reference=_pow_reference,
       triton=_render_pow, units=8, vjp=_d_pow)


def _logic(function: str, bitwise: str):
    """On bools a select: Triton's interpreter cannot `|` a 0-d comparison result (its value
    is a NumPy scalar); on a GPU the select compiles to the same predicate logic. On i32
    bitwise."""
    on_ints = binary(bitwise)

    def render(em, op, args, out):
        if out is Compute.BOOL:
            a, b = (em.tensor(x) for x in args)
            pick = f"{b.text}, False" if function == "and" else f"True, {b.text}"
            return em.assign(f"tl.where({a.text}, {pick})", out)
        return on_ints(em, op, args, out)

    return render


_operator("and", "&", _logical("&"), operator.and_, _logic("and", "{a} & {b}"))
_operator("or", "|", _logical("|"), operator.or_, _logic("or", "{a} | {b}"))
# on bools a != b (the exclusive or); on integers bitwise, in the promoted type
def _render_xor(em, op, args, out):
    a, b = (em.tensor(x).text for x in args)
    return em.assign(f"{a} != {b}" if out is Compute.BOOL else f"{a} ^ {b}", out)


_operator("xor", "^", _logical("^", "write x ** y for a power"), operator.xor, _render_xor)
# shifts in the promoted type: `>>` is arithmetic on signed integers and logical on u8, as
# torch's (a shift by the type's width or more is undefined in Triton: torch gives 0 or -1)
_operator("shl", "<<", _shift("<<"), operator.lshift, binary("{a} << {b}"))
_operator("shr", ">>", _shift(">>"), operator.rshift, binary("{a} >> {b}"))

for _kind, _symbol, _function in (("lt", "<", operator.lt), ("le", "<=", operator.le),
                                  ("gt", ">", operator.gt), ("ge", ">=", operator.ge),
                                  ("eq", "==", operator.eq), ("ne", "!=", operator.ne)):
    define(_kind, 2, ELEMENTWISE, _compare, reads=Reads.COMPARE, symbol=_symbol, fold=_function,
           reference=_function, triton=compare(_symbol), units=1)

# functions, not operators: torch.maximum takes no Python scalars, so both operands are
# read in the result's type
_AB = (BParam("a"), BParam("b"))
def _d_extremum(win: str):
    """torch's maximum/minimum backward: the gradient goes to the operand that is chosen,
    half to each on a tie."""
    lose = "lt" if win == "gt" else "gt"

    def rule(d, wanted):
        a, b = d.x(0), d.x(1)
        half = d.where(d.call("eq", a, b), d.mul(d.g, d.c(0.5)), d.g)
        return (d.where(d.call(lose, a, b), d.c(0.0), half),
                d.where(d.call(win, a, b), d.c(0.0), half))

    return rule


define("maximum", 2, ELEMENTWISE, _arith, params=_AB, fold=max, reference=torch.maximum,
       triton=nan_propagating("maximum"), units=1, vjp=_d_extremum("gt"))
define("minimum", 2, ELEMENTWISE, _arith, params=_AB, fold=min, reference=torch.minimum,
       triton=nan_propagating("minimum"), units=1, vjp=_d_extremum("lt"))


def _where(types, attrs):
    cond, a, b = types
    if cond.dtype is not DType.BOOL:
        raise RuleError(diag.DTypeError, (0,),
                        message=f"the condition of 'where' must be bool, got {cond.dtype}")
    return TensorType(result_dtype((a, b)), broadcast(types), all_weak(types))


def _render_where(em, op, args, out):
    c, a, b = args
    return em.assign(f"tl.where({c.text}, {a.text}, {b.text})", out)


define("where", 3, ELEMENTWISE, _where, reads=Reads.SELECT,
       params=(BParam("cond"), BParam("a"), BParam("b")),
       fold=lambda c, a, b: a if c else b, reference=torch.where, triton=_render_where, units=1,
       vjp=lambda d, w: (None, d.where(d.x(0), d.g, d.c(0.0)), d.where(d.x(0), d.c(0.0), d.g)))


def _clamp(types, attrs):
    for i, t in enumerate(types):
        if t.dtype is DType.BOOL:
            raise RuleError(diag.DTypeError, (i,), message="'clamp' is not defined for bool values")
    return TensorType(result_dtype(types), broadcast(types), all_weak(types))


def _clamp_fold(x, lo, hi):
    if any(isinstance(v, float) and math.isnan(v) for v in (x, lo, hi)):
        return math.nan
    value = min(max(x, lo), hi)
    return float(value) if any(isinstance(v, float) for v in (x, lo, hi)) else value


def _render_clamp(em, op, args, out):
    """min(max(x, lo), hi) with NaN from any operand, as torch.clamp."""
    x, lo, hi = (em.tensor(v).text for v in args)
    nan = NAN_ALL if out.is_float else ""
    return em.assign(f"tl.minimum(tl.maximum({x}, {lo}{nan}), {hi}{nan})", out)


def _d_clamp(d, wanted):
    """torch's clamp_backward and clamp_backward_min_max: x's gradient where lo <= x <= hi,
    lo's where x < lo < hi, hi's where x > hi or hi < lo."""
    x, lo, hi = d.x(0), d.x(1), d.x(2)
    inside = d.call("and", d.call("ge", x, lo), d.call("le", x, hi))
    below = d.call("and", d.call("lt", x, lo), d.call("lt", lo, hi))
    above = d.call("or", d.call("gt", x, hi), d.call("lt", hi, lo))
    return tuple(d.where(m, d.g, d.c(0.0)) if want else None
                 for m, want in zip((inside, below, above), wanted, strict=True))


define("clamp", 3, ELEMENTWISE, _clamp, params=(BParam("x"), BParam("lo"), BParam("hi")),
       fold=_clamp_fold, reference=torch.clamp, triton=_render_clamp, units=1, vjp=_d_clamp)
