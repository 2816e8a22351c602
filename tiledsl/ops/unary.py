"""Elementwise ops of one operand: math builtins, `-x`, `cast`."""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from tiledsl import diagnostics as diag
from tiledsl.types import Compute, DType, TensorType, compute_type

from .core import SLOW_PATH_UNITS, BParam, Category, Infer, Reads, RuleError, define
from .render import any_of, in_wide_type, is_rounded_to_bf16, unary
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


def _math(kind, fold, reference, triton, vjp, units=4) -> None:
    """A float math builtin: integer and bool inputs compute in f32."""
    define(kind, 1, ELEMENTWISE, _float_result, params=(X,), fold=fold, reference=reference,
           triton=triton, vjp=vjp, units=units)


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


# exp/exp2/sin/cos of an f32 go through f64: Triton's f32 forms are fast approximations
PRECISE = "tl.{0}({{x}}.to(tl.float64)).to(tl.float32)"
_math("exp", math.exp, torch.exp, unary("tl.exp({x})", PRECISE.format("exp")),
      lambda d, w: (d.mul(d.g, d.y),))
_math("exp2", lambda a: 2.0**a, torch.exp2, unary("tl.exp2({x})", PRECISE.format("exp2")),
      lambda d, w: (d.mul(d.g, d.y, d.c(LN2)),))
_math("log", math.log, torch.log, unary("tl.log({x})"),
      lambda d, w: (d.div(d.g, d.x(0)),))
_math("log2", math.log2, torch.log2, unary("tl.log2({x})"),
      lambda d, w: (d.div(d.g, d.mul(d.x(0), d.c(LN2))),))
# sqrt_rn is f32 only; f64 sqrt is IEEE anyway
_math("sqrt", math.sqrt, torch.sqrt, unary("tl.sqrt_rn({x})", wide="tl.sqrt({x})"),
      lambda d, w: (d.div(d.g, d.mul(d.c(2.0), d.y)),))
_math("rsqrt", lambda a: 1.0 / math.sqrt(a), torch.rsqrt,
      unary("tl.rsqrt({x})", "tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn({x}))"),
      lambda d, w: (d.mul(d.c(-0.5), d.g, d.y, d.y, d.y),))
_math("sigmoid", _sigmoid, torch.sigmoid, unary("tl.sigmoid({x})"),
      _d_sigmoid)
_math("silu", lambda a: a * _sigmoid(a), F.silu, unary("{x} * tl.sigmoid({x})"),
      _d_silu)
_math("erf", math.erf, torch.erf, unary("tl.erf({x})"),
      lambda d, w: (d.mul(d.g, d.c(2 / math.sqrt(math.pi)), d.call("exp", d.neg(d.mul(d.x(0), d.x(0))))),))


_math("sin", math.sin, torch.sin, unary("tl.sin({x})", PRECISE.format("sin")),
      lambda d, w: (d.mul(d.g, d.call("cos", d.x(0))),), units=SLOW_PATH_UNITS)
_math("cos", math.cos, torch.cos, unary("tl.cos({x})", PRECISE.format("cos")),
      lambda d, w: (d.neg(d.mul(d.g, d.call("sin", d.x(0)))),), units=SLOW_PATH_UNITS)


def _render_tan(em, op, args, out):
    """sin / cos: Triton has no tan outside libdevice, which the interpreter lacks. In
    the wide type (f64) for f32 ops, so the quotient's error stays below an f32 ulp."""
    cat, x = in_wide_type(em, op, out, args[0])
    v = em.assign(f"tl.sin({x}) / tl.cos({x})", cat)
    return em.convert(v, out)


_math("tan", math.tan, torch.tan, _render_tan,
      lambda d, w: (d.mul(d.g, d.add(d.c(1.0), d.mul(d.y, d.y))),), units=SLOW_PATH_UNITS)


INF = 'float("inf")'


def log1p_of(em, x: str, cat: Compute):
    """log(u) * x / (u - 1) with u = 1 + x (Goldberg): the rounding of u cancels, so small x
    keep full precision without libdevice. `x`: a tensor's text in `cat`."""
    u = em.assign(f"1.0 + {x}", cat).text
    special = any_of(f"{u} == 1.0", f"{u} == {INF}")
    return em.assign(f"tl.where({special}, {x}, tl.log({u}) * ({x} / ({u} - 1.0)))", cat)


def expm1_of(em, x: str, cat: Compute):
    """(u - 1) * x / log(u) with u = exp(x) (Kahan): exact enough for small x. `x`: a
    tensor's text in `cat`."""
    u = em.assign(f"tl.exp({x})", cat).text
    saturated = any_of(f"{u} - 1.0 == -1.0", f"{u} == {INF}")
    return em.assign(f"tl.where({u} == 1.0, {x}, tl.where({saturated}, "
                     f"{u} - 1.0, ({u} - 1.0) * ({x} / tl.log({u}))))", cat)


def _render_log1p(em, op, args, out):
    """f32 ops compute it in f64."""
    cat, x = in_wide_type(em, op, out, args[0])
    return em.convert(log1p_of(em, x, cat), out)


def _render_expm1(em, op, args, out):
    """f32 ops compute it in f64."""
    cat, x = in_wide_type(em, op, out, args[0])
    return em.convert(expm1_of(em, x, cat), out)


_math("log1p", math.log1p, torch.log1p, _render_log1p,
      lambda d, w: (d.div(d.g, d.add(d.c(1.0), d.x(0))),))
_math("expm1", math.expm1, torch.expm1, _render_expm1,
      lambda d, w: (d.mul(d.g, d.add(d.y, d.c(1.0))),))


def tanh_of(em, x, approximate: bool = False):
    """tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): no overflow for any x. With
    `approximate` (an op rounded to bf16: `is_rounded_to_bf16`), the hardware's
    tanh.approx.f32 on a GPU (the `tanh` helper: relative error about 2^-11)."""
    if approximate and x.cat is Compute.F32:
        em.helpers.add("tanh")
        return em.assign(f"tanh_approx({x.text}, INTERPRETER)", x.cat)
    e = em.assign(f"tl.exp(-2.0 * tl.abs({x.text}))", x.cat)
    return em.assign(f"tl.where({x.text} < 0, -1.0, 1.0) * (1.0 - {e.text}) / (1.0 + {e.text})",
                     x.cat)


_math("tanh", math.tanh, torch.tanh,
      lambda em, op, args, out: tanh_of(em, em.tensor(args[0]), is_rounded_to_bf16(op, out)),
      lambda d, w: (d.mul(d.g, d.sub(d.c(1.0), d.mul(d.y, d.y))),))


def _render_gelu(em, op, args, out):
    x = em.tensor(args[0]).text
    if op.attr("approximate") == "tanh":
        inner = em.assign(f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})", out)
        tanh = tanh_of(em, inner, is_rounded_to_bf16(op, out))
        return em.assign(f"0.5 * {x} * (1.0 + {tanh.text})", out)
    return em.assign(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", out)


define("gelu", 1, ELEMENTWISE, _float_result,
       params=(X, BParam("approximate", "str", "none", ("none", "tanh"))),
       fold=_gelu, reference=F.gelu, triton=_render_gelu, units=4, vjp=_d_gelu)


def _render_relu(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"tl.where({x} < 0, {em.literal(0, out).text}, {x})", out)


define("neg", 1, ELEMENTWISE, _signed("-"), symbol="-", fold=operator.neg, reference=torch.neg,
       triton=unary("-{x}"), units=1, vjp=lambda d, w: (d.neg(d.g),))
define("abs", 1, ELEMENTWISE, _signed("abs"), params=(X,), fold=abs, reference=torch.abs,
       triton=unary("tl.abs({x})"), units=1,
       vjp=lambda d, w: (d.mul(d.g, d.call("sign", d.x(0))),))
# torch's threshold_backward: the gradient is 0 where the result is at most 0 and passes
# elsewhere, a NaN included (a test `result > 0` stopped it there: 0 where torch has NaN)
define("relu", 1, ELEMENTWISE, _signed("relu"), params=(X,), fold=lambda a: max(a, type(a)(0)),
       reference=torch.relu, triton=_render_relu, units=1,
       vjp=lambda d, w: (d.where(d.call("le", d.y, d.c(0)), d.c(0.0), d.g),))


def _cast(types, attrs):
    (x,) = types
    return TensorType(attrs["dtype"], x.shape, x.weak)


def _render_cast(em, op, args, out):
    """A cast to f16/bf16/f8 rounds there, because the user asked for it; the value then
    computes in f32 again. A cast to an integer wraps into it there, even where the result
    computes wider (a weak one, in i64)."""
    (x,) = args
    if op.dtype.is_float and op.dtype.itemsize < 4:
        v = em.tensor(em.convert(x, Compute.F32))
        v = em.assign(em.widen(em.narrow(v.text, op.dtype), op.dtype), Compute.F32)
        return em.convert(v, out)
    if op.dtype.is_int:
        return em.convert(em.convert(x, compute_type(op.dtype)), out)
    return em.convert(x, out)


# reading the operand in the result's type is the conversion; the op itself is the identity
define("cast", 1, ELEMENTWISE, _cast, params=(X, BParam("dtype", "dtype")),
       fold=lambda a, dtype: a, reference=lambda x, dtype: x, triton=_render_cast, units=1,
       vjp=lambda d, w: (d.g,))


def _zero(d, wanted):
    """Piecewise constant (floor, ceil, round, sign): a zero gradient, as in torch."""
    return (None,)


def _rounding(kind, fold, reference, text) -> None:
    """floor/ceil/round: integers pass through unchanged (as in torch)."""
    def render(em, op, args, out):
        (x,) = args
        if not out.is_float:
            return x
        return em.assign(text.format(x=em.tensor(x).text), out)

    define(kind, 1, ELEMENTWISE, _signed(kind), params=(X,), fold=fold, reference=reference,
           triton=render, units=1, vjp=_zero)


def _integral_fold(function):
    """floor/ceil of a Python scalar: ints unchanged, floats stay floats (math.floor gives
    an int), infinities and NaN as they are."""
    return lambda a: a if isinstance(a, int) or not math.isfinite(a) else float(function(a))


_rounding("floor", _integral_fold(math.floor), torch.floor, "tl.floor({x})")
_rounding("ceil", _integral_fold(math.ceil), torch.ceil, "tl.ceil({x})")


def _render_round(em, op, args, out):
    """Half to even, from exact steps: x - floor(x) is exact, and so is the parity test."""
    (x,) = args
    if not out.is_float:
        return x
    x = em.tensor(x).text
    f = em.assign(f"tl.floor({x})", out).text
    d = em.assign(f"{x} - {f}", out).text
    odd = em.assign(f"{f} - 2.0 * tl.floor({f} * 0.5)", out).text
    return em.assign(f"tl.where({d} > 0.5, {f} + 1.0, tl.where({d} == 0.5, {f} + {odd}, "
                     f"tl.where({x} == {x}, {f}, {x})))", out)


define("round", 1, ELEMENTWISE, _signed("round"), params=(X,),
       fold=_integral_fold(round), reference=torch.round,
       triton=_render_round, units=1, vjp=_zero)


def _render_sign(em, op, args, out):
    """1, -1 or 0 (NaN gives 0, as in torch); bools are their own sign."""
    (x,) = args
    if out is Compute.BOOL:
        return x
    x = em.tensor(x).text
    one, zero = em.literal(1, out).text, em.literal(0, out).text
    return em.assign(f"tl.where({x} > {zero}, {one}, {zero}) - tl.where({x} < {zero}, {one}, {zero})",
                     out)


def _sign(a):
    if isinstance(a, bool):
        return a
    return type(a)((a > 0) - (a < 0))


define("sign", 1, ELEMENTWISE, lambda types, attrs: types[0], params=(X,), fold=_sign,
       reference=torch.sign, triton=_render_sign, units=1, vjp=_zero)


def _predicate(kind, fold, reference, text) -> None:
    def render(em, op, args, out):
        (x,) = args
        x = em.tensor(x).text
        return em.assign(text.format(x=x) if args[0].cat.is_float else f"{x} != {x}", Compute.BOOL)

    def infer(types, attrs):
        (x,) = types
        return TensorType(DType.BOOL, x.shape, x.weak)

    define(kind, 1, ELEMENTWISE, infer, reads=Reads.OPERAND, params=(X,), fold=fold,
           reference=reference, triton=render, units=1)


_predicate("isnan", lambda a: isinstance(a, float) and math.isnan(a), torch.isnan, "{x} != {x}")
_predicate("isinf", lambda a: isinstance(a, float) and math.isinf(a), torch.isinf,
           'tl.abs({x}) == float("inf")')


def _not(types, attrs):
    (x,) = types
    if x.dtype.is_float:
        raise RuleError(diag.DTypeError, (0,), message=(
            f"'~' needs a bool or integer operand, got {x.dtype}; compare first, e.g. ~(x > 0)"))
    return x


def _render_not(em, op, args, out):
    (x,) = args
    x = em.tensor(x).text
    if out is Compute.BOOL:
        return em.assign(f"{x} == 0", out)
    # u8's complement as an xor with 255: the same instruction, and Triton's interpreter
    # before 3.9 computes `~` on u8 as an xor with -1, which numpy refuses
    return em.assign(f"{x} ^ 255" if out is Compute.U8 else f"~{x}", out)


define("not", 1, ELEMENTWISE, _not, symbol="~",
       fold=lambda a: (not a) if isinstance(a, bool) else ~a, reference=operator.invert,
       triton=_render_not, units=1)
