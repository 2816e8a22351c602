"""Activation functions, as torch.nn.functional defines them and torch's derivatives.yaml
differentiates them (the convention at each kink is torch's). At a NaN or an infinite input
a gradient is what torch's elementwise formula gives, its CUDA kernels' and its CPU
kernels' on a scalar: the side of the kink a NaN takes is the one its test sends it to
(`x <= 0 ? below : above` passes it above). torch's CPU vector loops of elu, hardtanh and
hardswish test the other side, so on a CPU tensor the answer depends on where a NaN lies.

Integer and bool inputs compute in f32, f16/bf16 ones in f32, and f32 ones with a
transcendental in f64 (their error then stays below an f32 ulp), like the math builtins in
`unary.py`. Each is one elementwise op, so it fuses wherever one does (a GEMM epilogue).
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from tiledsl import diagnostics as diag
from tiledsl.types import TensorType

from .core import BParam, Category, RuleError, define
from .rules import float_of

X = BParam("x")
# torch's SELU constants (torch/csrc/api/include/torch/nn/options/activation.h)
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _float_result(types, attrs):
    (x,) = types
    return TensorType(float_of(x.dtype), x.shape, x.weak)


def _activation(kind, fold, reference, vjp, *params: BParam, infer=_float_result,
                units: int = 4) -> None:
    define(kind, 1, Category.ELEMENTWISE, infer, params=(X, *params), fold=fold,
           reference=reference, vjp=vjp, units=units)


def _scaled(d, g, *factors: float):
    """`g` times the constants that are not 1."""
    return d.mul(g, *(d.c(f) for f in factors if f != 1.0))


# --- softplus, logsigmoid, mish: log1p(exp(.)) ------------------------------------------------


def _softplus(a, beta=1.0, threshold=20.0):
    return a if a * beta > threshold else math.log1p(math.exp(a * beta)) / beta


def _d_softplus(d, wanted):
    bx = _scaled(d, d.x(0), d.attr("beta"))
    below = d.mul(d.g, d.call("sigmoid", bx))  # exp(bx) / (exp(bx) + 1)
    return (d.where(d.call("gt", bx, d.c(d.attr("threshold"))), d.g, below),)


_activation("softplus", _softplus, F.softplus, _d_softplus,
            BParam("beta", "float", 1.0), BParam("threshold", "float", 20.0))


_activation("logsigmoid", lambda a: min(a, 0) - math.log1p(math.exp(-abs(a))), F.logsigmoid,
            lambda d, w: (d.mul(d.g, d.call("sigmoid", d.neg(d.x(0)))),))


def _d_mish(d, wanted):
    x = d.x(0)
    t = d.call("tanh", d.call("softplus", x, beta=1.0, threshold=20.0))
    slope = d.mul(x, d.call("sigmoid", x), d.sub(d.c(1.0), d.mul(t, t)))
    return (d.mul(d.g, d.add(t, slope)),)


_activation("mish", lambda a: a * math.tanh(_softplus(a)), F.mish, _d_mish, units=8)


# --- elu, selu, celu: scale * (x > 0 ? x : alpha * expm1(x * input_scale)) -------------------


def _elu_fold(alpha: float, scale: float, input_scale: float):
    return lambda a: scale * (a if a > 0 else alpha * math.expm1(a * input_scale))


def _elu_vjp(alpha, scale: float, input_scale):
    """torch's elu_backward of the input: g * alpha * scale * input_scale * exp(x *
    input_scale) at and below 0, g * scale elsewhere, a NaN input included (its test is
    `x <= 0`; testing `x > 0` sent a NaN to the exponential: NaN where torch has the scale)."""

    def vjp(d, wanted):
        x, a, s = d.x(0), alpha(d), input_scale(d)
        below = _scaled(d, d.call("exp", _scaled(d, x, s)), a * scale * s)
        return (d.where(d.call("le", x, d.c(0.0)), d.mul(d.g, below), _scaled(d, d.g, scale)),)

    return vjp


def _alpha(op) -> float:
    return op.attr("alpha")


def _one(op) -> float:
    return 1.0


def _celu_infer(types, attrs):
    if attrs["alpha"] == 0:
        raise RuleError(diag.ConstantExpected, what="'alpha' of 'celu'", expected="nonzero")
    return _float_result(types, attrs)


_activation("elu", lambda a, alpha: _elu_fold(alpha, 1.0, 1.0)(a), F.elu,
            _elu_vjp(_alpha, 1.0, _one),
            BParam("alpha", "float", 1.0))
_activation("selu", _elu_fold(SELU_ALPHA, SELU_SCALE, 1.0), F.selu,
            _elu_vjp(lambda d: SELU_ALPHA, SELU_SCALE, _one))
_activation("celu", lambda a, alpha: _elu_fold(alpha, 1.0, 1.0 / alpha)(a), F.celu,
            _elu_vjp(_alpha, 1.0, lambda d: 1.0 / d.attr("alpha")),
            BParam("alpha", "float", 1.0), infer=_celu_infer)


# --- piecewise linear: leaky_relu, hardtanh, hardsigmoid, hardswish; softsign --------------


# torch's leaky_relu_backward: the slope's side at 0
_activation("leaky_relu", lambda a, slope: a if a > 0 else a * slope,
            lambda x, slope: F.leaky_relu(x, slope),
            lambda d, w: (d.where(d.call("gt", d.x(0), d.c(0.0)), d.g, _scaled(d, d.g, d.attr("slope"))),),
            BParam("slope", "float", 0.01), units=1)


def _hardtanh_infer(types, attrs):
    if attrs["min_val"] > attrs["max_val"]:
        raise RuleError(diag.ConstantExpected, what="'max_val' of 'hardtanh'",
                        expected=f"at least its min_val ({attrs['min_val']})")
    return _float_result(types, attrs)


def _d_hardtanh(d, wanted):
    """torch's hardtanh_backward: 0 at and outside the bounds."""
    x, zero = d.x(0), d.c(0.0)
    inside = d.where(d.call("ge", x, d.c(d.attr("max_val"))), zero, d.g)
    return (d.where(d.call("le", x, d.c(d.attr("min_val"))), zero, inside),)


_activation("hardtanh", lambda a, min_val, max_val: min(max(a, min_val), max_val), F.hardtanh,
            _d_hardtanh, BParam("min_val", "float", -1.0),
            BParam("max_val", "float", 1.0), infer=_hardtanh_infer, units=1)


def _d_hardsigmoid(d, wanted):
    """torch's hardsigmoid_backward: g / 6 strictly inside (-3, 3), else 0, a NaN input
    included (it tests `-3 < x < 3`; testing the outside, `x <= -3 or x >= 3`, let a NaN
    through as g / 6)."""
    x, zero = d.x(0), d.c(0.0)
    inside = d.where(d.call("lt", x, d.c(3.0)), d.div(d.g, d.c(6.0)), zero)
    return (d.where(d.call("gt", x, d.c(-3.0)), inside, zero),)


def _d_hardswish(d, wanted):
    """torch's hardswish_backward: 0 at and below -3, g * (x / 3 + 1/2) up to 3, g from 3."""
    x = d.x(0)
    ramp = d.mul(d.g, d.add(d.div(x, d.c(3.0)), d.c(0.5)))
    inside = d.where(d.call("lt", x, d.c(3.0)), ramp, d.g)
    return (d.where(d.call("le", x, d.c(-3.0)), d.c(0.0), inside),)


def _relu6(a):
    return min(max(a + 3, 0), 6)


_activation("hardsigmoid", lambda a: _relu6(a) / 6, F.hardsigmoid,
            _d_hardsigmoid)
_activation("hardswish", lambda a: a * _relu6(a) / 6, F.hardswish, _d_hardswish)


def _d_softsign(d, wanted):
    """g / (1 + |x|)^2, and NaN at an infinite x as torch's: its softsign is x / (1 + |x|),
    differentiated by the quotient rule, which is inf / inf there (the form here, exact
    where the quotient rule cancels, would give the limit 0)."""
    x = d.x(0)
    s = d.add(d.c(1.0), d.call("abs", x))
    return (d.where(d.call("isinf", x), d.c(math.nan), d.div(d.g, d.mul(s, s))),)


_activation("softsign", lambda a: a / (1 + abs(a)), F.softsign, _d_softsign)
