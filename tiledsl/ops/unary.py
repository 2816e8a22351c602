"""Elementwise ops of one operand: math builtins, `-x`, `cast`."""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from tiledsl import diagnostics as diag
from tiledsl.types import DType, TensorType

from .core import SLOW_PATH_UNITS, BParam, Category, Infer, Reads, RuleError, define
from .rules import float_of

X = BParam("x")
ELEMENTWISE = Category.ELEMENTWISE


def _float_result(types, attrs):
    (x,) = types
    return TensorType(float_of(x.dtype), x.shape, x.weak)


def _signed(name: str) -> Infer:
    def infer(types, attrs):
        (x,) = types
        if x.dtype is DType.BOOL:
            raise RuleError(diag.DTypeError, (0,),
                            message=f"'{name}' is not defined for bool values")
        return x

    return infer


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _gelu(x: float, approximate: str) -> float:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _math(kind, fold, reference, vjp, units=4) -> None:
    """A float math builtin: integer and bool inputs compute in f32."""
    define(kind, 1, ELEMENTWISE, _float_result, params=(X,), fold=fold, reference=reference,
           vjp=vjp, units=units)


# derivative rules (`tiledsl.autodiff`): d is the op's adjoint, the result one contribution
# per operand; they follow torch's derivatives.yaml
LN2 = math.log(2.0)


def _d_sigmoid(d, wanted):
    return (d.mul(d.g, d.y, d.sub(d.c(1.0), d.y)),)


def _d_silu(d, wanted):
    s = d.call("sigmoid", d.x(0))
    return (d.mul(d.g, s, d.add(d.c(1.0), d.mul(d.x(0), d.sub(d.c(1.0), s)))),)


def _d_gelu(d, wanted):
    x = d.x(0)
    if d.attr("approximate") == "tanh":
        beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
        inner = d.mul(d.c(beta), d.add(x, d.mul(d.c(kappa), x, x, x)))
        t = d.call("tanh", inner)
        left = d.mul(d.c(0.5), d.add(d.c(1.0), t))
        right = d.mul(d.c(0.5), x, d.sub(d.c(1.0), d.mul(t, t)),
                      d.mul(d.c(beta), d.add(d.c(1.0), d.mul(d.c(3.0 * kappa), x, x))))
        return (d.mul(d.g, d.add(left, right)),)
    cdf = d.mul(d.c(0.5), d.add(d.c(1.0), d.call("erf", d.mul(x, d.c(1 / math.sqrt(2.0))))))
    pdf = d.mul(d.c(1 / math.sqrt(2.0 * math.pi)), d.call("exp", d.mul(d.c(-0.5), x, x)))
    return (d.mul(d.g, d.add(cdf, d.mul(x, pdf))),)


_math("exp", math.exp, torch.exp, lambda d, w: (d.mul(d.g, d.y),))
_math("exp2", lambda a: 2.0**a, torch.exp2, lambda d, w: (d.mul(d.g, d.y, d.c(LN2)),))
_math("log", math.log, torch.log, lambda d, w: (d.div(d.g, d.x(0)),))
_math("log2", math.log2, torch.log2, lambda d, w: (d.div(d.g, d.mul(d.x(0), d.c(LN2))),))
_math("sqrt", math.sqrt, torch.sqrt, lambda d, w: (d.div(d.g, d.mul(d.c(2.0), d.y)),))
_math("rsqrt", lambda a: 1.0 / math.sqrt(a), torch.rsqrt,
      lambda d, w: (d.mul(d.c(-0.5), d.g, d.y, d.y, d.y),))
_math("sigmoid", _sigmoid, torch.sigmoid, _d_sigmoid)
_math("silu", lambda a: a * _sigmoid(a), F.silu, _d_silu)
_math("erf", math.erf, torch.erf,
      lambda d, w: (d.mul(d.g, d.c(2 / math.sqrt(math.pi)), d.call("exp", d.neg(d.mul(d.x(0), d.x(0))))),))


_math("sin", math.sin, torch.sin,
      lambda d, w: (d.mul(d.g, d.call("cos", d.x(0))),), units=SLOW_PATH_UNITS)
_math("cos", math.cos, torch.cos,
      lambda d, w: (d.neg(d.mul(d.g, d.call("sin", d.x(0)))),), units=SLOW_PATH_UNITS)


_math("tan", math.tan, torch.tan,
      lambda d, w: (d.mul(d.g, d.add(d.c(1.0), d.mul(d.y, d.y))),), units=SLOW_PATH_UNITS)


_math("log1p", math.log1p, torch.log1p,
      lambda d, w: (d.div(d.g, d.add(d.c(1.0), d.x(0))),))
_math("expm1", math.expm1, torch.expm1,
      lambda d, w: (d.mul(d.g, d.add(d.y, d.c(1.0))),))


_math("tanh", math.tanh, torch.tanh,
      lambda d, w: (d.mul(d.g, d.sub(d.c(1.0), d.mul(d.y, d.y))),))


define("gelu", 1, ELEMENTWISE, _float_result,
       params=(X, BParam("approximate", "str", "none", ("none", "tanh"))),
       fold=_gelu, reference=F.gelu, units=4, vjp=_d_gelu)


define("neg", 1, ELEMENTWISE, _signed("-"), symbol="-", fold=operator.neg, reference=torch.neg,
       units=1, vjp=lambda d, w: (d.neg(d.g),))
define("abs", 1, ELEMENTWISE, _signed("abs"), params=(X,), fold=abs, reference=torch.abs, units=1,
       vjp=lambda d, w: (d.mul(d.g, d.call("sign", d.x(0))),))
# torch's threshold_backward: the gradient is 0 where the result is at most 0 and passes
# elsewhere, a NaN included (a test `result > 0` stopped it there: 0 where torch has NaN)
define("relu", 1, ELEMENTWISE, _signed("relu"), params=(X,), fold=lambda a: max(a, type(a)(0)),
       reference=torch.relu, units=1,
       vjp=lambda d, w: (d.where(d.call("le", d.y, d.c(0)), d.c(0.0), d.g),))


def _cast(types, attrs):
    (x,) = types
    return TensorType(attrs["dtype"], x.shape, x.weak)


# reading the operand in the result's type is the conversion; the op itself is the identity
define("cast", 1, ELEMENTWISE, _cast, params=(X, BParam("dtype", "dtype")),
       fold=lambda a, dtype: a, reference=lambda x, dtype: x, units=1,
       vjp=lambda d, w: (d.g,))


def _zero(d, wanted):
    """Piecewise constant (floor, ceil, round, sign): a zero gradient, as in torch."""
    return (None,)


def _rounding(kind, fold, reference) -> None:
    """floor/ceil/round: integers pass through unchanged (as in torch)."""
    define(kind, 1, ELEMENTWISE, _signed(kind), params=(X,), fold=fold, reference=reference,
           units=1, vjp=_zero)


def _integral_fold(function):
    """floor/ceil of a Python scalar: ints unchanged, floats stay floats (math.floor gives
    an int), infinities and NaN as they are."""
    return lambda a: a if isinstance(a, int) or not math.isfinite(a) else float(function(a))


_rounding("floor", _integral_fold(math.floor), torch.floor)
_rounding("ceil", _integral_fold(math.ceil), torch.ceil)


define("round", 1, ELEMENTWISE, _signed("round"), params=(X,),
       fold=_integral_fold(round), reference=torch.round,
       units=1, vjp=_zero)


def _sign(a):
    if isinstance(a, bool):
        return a
    return type(a)((a > 0) - (a < 0))


define("sign", 1, ELEMENTWISE, lambda types, attrs: types[0], params=(X,), fold=_sign,
       reference=torch.sign, units=1, vjp=_zero)


def _predicate(kind, fold, reference) -> None:
    def infer(types, attrs):
        (x,) = types
        return TensorType(DType.BOOL, x.shape, x.weak)

    define(kind, 1, ELEMENTWISE, infer, reads=Reads.OPERAND, params=(X,), fold=fold,
           reference=reference, units=1)


_predicate("isnan", lambda a: isinstance(a, float) and math.isnan(a), torch.isnan)
_predicate("isinf", lambda a: isinstance(a, float) and math.isinf(a), torch.isinf)


def _not(types, attrs):
    (x,) = types
    if x.dtype.is_float:
        raise RuleError(diag.DTypeError, (0,), message=(
            f"'~' needs a bool or integer operand, got {x.dtype}; compare first, e.g. ~(x > 0)"))
    return x


define("not", 1, ELEMENTWISE, _not, symbol="~",
       fold=lambda a: (not a) if isinstance(a, bool) else ~a, reference=operator.invert,
       units=1)
