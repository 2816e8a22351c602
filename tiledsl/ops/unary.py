"""Elementwise ops of one operand: math builtins, `-x`, `cast`."""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from tiledsl import diagnostics as diag
from tiledsl.types import Compute, DType, TensorType

from .core import BParam, Category, Infer, RuleError, define
from .render import unary
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


def _math(kind, fold, reference, triton) -> None:
    """A float math builtin: integer and bool inputs compute in f32."""
    define(kind, 1, ELEMENTWISE, _float_result, params=(X,), fold=fold, reference=reference,
           triton=triton)


# exp/exp2 of an f32 go through f64: Triton's f32 exp is a fast approximation
PRECISE_EXP = "tl.{0}({{x}}.to(tl.float64)).to(tl.float32)"
_math("exp", math.exp, torch.exp, unary("tl.exp({x})", PRECISE_EXP.format("exp")))
_math("exp2", lambda a: 2.0**a, torch.exp2, unary("tl.exp2({x})", PRECISE_EXP.format("exp2")))
_math("log", math.log, torch.log, unary("tl.log({x})"))
_math("log2", math.log2, torch.log2, unary("tl.log2({x})"))
# sqrt_rn is f32 only; f64 sqrt is IEEE anyway
_math("sqrt", math.sqrt, torch.sqrt, unary("tl.sqrt_rn({x})", wide="tl.sqrt({x})"))
_math("rsqrt", lambda a: 1.0 / math.sqrt(a), torch.rsqrt,
      unary("tl.rsqrt({x})", "tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn({x}))"))
_math("sigmoid", _sigmoid, torch.sigmoid, unary("tl.sigmoid({x})"))
_math("silu", lambda a: a * _sigmoid(a), F.silu, unary("{x} * tl.sigmoid({x})"))
_math("erf", math.erf, torch.erf, unary("tl.erf({x})"))


def _tanh(em, x):
    # tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): no overflow for any x.
    e = em.assign(f"tl.exp(-2.0 * tl.abs({x.text}))", x.cat)
    return em.assign(f"tl.where({x.text} < 0, -1.0, 1.0) * (1.0 - {e.text}) / (1.0 + {e.text})",
                     x.cat)


_math("tanh", math.tanh, torch.tanh, lambda em, op, args, out: _tanh(em, em.tensor(args[0])))


def _render_gelu(em, op, args, out):
    x = em.tensor(args[0]).text
    if op.attr("approximate") == "tanh":
        inner = em.assign(f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})", out)
        return em.assign(f"0.5 * {x} * (1.0 + {_tanh(em, inner).text})", out)
    return em.assign(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", out)


define("gelu", 1, ELEMENTWISE, _float_result,
       params=(X, BParam("approximate", "str", "none", ("none", "tanh"))),
       fold=_gelu, reference=F.gelu, triton=_render_gelu)


def _render_relu(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"tl.where({x} < 0, {em.literal(0, out).text}, {x})", out)


define("neg", 1, ELEMENTWISE, _signed("-"), symbol="-", fold=operator.neg, reference=torch.neg,
       triton=unary("-{x}"), cheap=True)
define("abs", 1, ELEMENTWISE, _signed("abs"), params=(X,), fold=abs, reference=torch.abs,
       triton=unary("tl.abs({x})"), cheap=True)
define("relu", 1, ELEMENTWISE, _signed("relu"), params=(X,), fold=lambda a: max(a, 0),
       reference=torch.relu, triton=_render_relu, cheap=True)


def _cast(types, attrs):
    (x,) = types
    return TensorType(attrs["dtype"], x.shape, x.weak)


def _render_cast(em, op, args, out):
    """A cast to f16/bf16 rounds there, because the user asked for it; the value then
    computes in f32 again."""
    (x,) = args
    if op.dtype in (DType.F16, DType.BF16):
        v = em.tensor(em.convert(x, Compute.F32))
        v = em.assign(em.widen(em.narrow(v.text, op.dtype), op.dtype), Compute.F32)
        return em.convert(v, out)
    return em.convert(x, out)


# reading the operand in the result's type is the conversion; the op itself is the identity
define("cast", 1, ELEMENTWISE, _cast, params=(X, BParam("dtype", "dtype")),
       fold=lambda a, dtype: a, reference=lambda x, dtype: x, triton=_render_cast, cheap=True)
