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
from tiledsl.types import DType, TensorType, all_weak, result_dtype

from .core import BParam, Category, Infer, Reads, RuleError, define
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


def _operator(kind, symbol, infer, function, units=1, vjp=None) -> None:
    define(kind, 2, ELEMENTWISE, infer, reads=Reads.PROMOTED, symbol=symbol, fold=function,
           reference=function, units=units, vjp=vjp)


# derivative rules (`tiledsl.autodiff`), as torch's derivatives.yaml writes them
def _d_div(d, wanted):
    return d.div(d.g, d.x(1)), d.neg(d.div(d.mul(d.g, d.x(0)), d.mul(d.x(1), d.x(1))))


_operator("add", "+", _arith, operator.add, units=1,
          vjp=lambda d, w: (d.g, d.g))
_operator("sub", "-", _arith, operator.sub, units=1,
          vjp=lambda d, w: (d.g, d.neg(d.g)))
_operator("mul", "*", _arith, operator.mul, units=1,
          vjp=lambda d, w: (d.mul(d.g, d.x(1)), d.mul(d.g, d.x(0))))


_operator("div", "/", _true_div, operator.truediv, units=4, vjp=_d_div)


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


_floordiv_ref, _floordiv_fold = _int_division(operator.floordiv)
_mod_ref, _mod_fold = _int_division(operator.mod)
# a floor quotient is piecewise constant: no gradient; torch.remainder's gradient is
# (g, -g * floor(a / b))
define("floordiv", 2, ELEMENTWISE, _numeric("//"), reads=Reads.PROMOTED, symbol="//",
       fold=_floordiv_fold, reference=_floordiv_ref, units=2,
       vjp=lambda d, w: (None, None))
define("mod", 2, ELEMENTWISE, _numeric("%"), reads=Reads.PROMOTED, symbol="%", fold=_mod_fold,
       reference=_mod_ref, units=2,
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
       units=8, vjp=_d_pow)


_operator("and", "&", _logical("&"), operator.and_)
_operator("or", "|", _logical("|"), operator.or_)


# on bools a != b (the exclusive or); on integers bitwise, in the promoted type
_operator("xor", "^", _logical("^", "write x ** y for a power"), operator.xor)
# shifts in the promoted type: `>>` is arithmetic on signed integers and logical on u8, as
# torch's (a shift by the type's width or more is undefined in Triton: torch gives 0 or -1)
_operator("shl", "<<", _shift("<<"), operator.lshift)
_operator("shr", ">>", _shift(">>"), operator.rshift)

for _kind, _symbol, _function in (("lt", "<", operator.lt), ("le", "<=", operator.le),
                                  ("gt", ">", operator.gt), ("ge", ">=", operator.ge),
                                  ("eq", "==", operator.eq), ("ne", "!=", operator.ne)):
    define(_kind, 2, ELEMENTWISE, _compare, reads=Reads.COMPARE, symbol=_symbol, fold=_function,
           reference=_function, units=1)

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
       units=1, vjp=_d_extremum("gt"))
define("minimum", 2, ELEMENTWISE, _arith, params=_AB, fold=min, reference=torch.minimum,
       units=1, vjp=_d_extremum("lt"))


def _where(types, attrs):
    cond, a, b = types
    if cond.dtype is not DType.BOOL:
        raise RuleError(diag.DTypeError, (0,),
                        message=f"the condition of 'where' must be bool, got {cond.dtype}")
    return TensorType(result_dtype((a, b)), broadcast(types), all_weak(types))


define("where", 3, ELEMENTWISE, _where, reads=Reads.SELECT,
       params=(BParam("cond"), BParam("a"), BParam("b")),
       fold=lambda c, a, b: a if c else b, reference=torch.where, units=1,
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
       fold=_clamp_fold, reference=torch.clamp, units=1, vjp=_d_clamp)
