"""Elementwise ops of two or three operands: arithmetic, comparisons, logic, `where`.

The infix operators (`+ - * / & |` and comparisons) promote like torch's, with
literals and dims as weak Python scalars; the reference backend calls Python's
`operator` functions on them, so a scalar on either side means what it means
in torch code.
"""

from __future__ import annotations

import operator

import torch

from tiledsl import diagnostics as diag
from tiledsl.types import Compute, DType, TensorType, all_weak, result_dtype

from .core import BParam, Category, Infer, Reads, RuleError, define
from .render import binary, compare, nan_propagating
from .rules import broadcast, float_of

ELEMENTWISE = Category.ELEMENTWISE


def _arith(types, attrs):
    return TensorType(result_dtype(types), broadcast(types), all_weak(types))


def _true_div(types, attrs):
    return TensorType(float_of(result_dtype(types)), broadcast(types), all_weak(types))


def _compare(types, attrs):
    return TensorType(DType.BOOL, broadcast(types), all_weak(types))


def _logical(symbol: str) -> Infer:
    def infer(types, attrs):
        for i, t in enumerate(types):
            if t.dtype.is_float:
                raise RuleError(diag.DTypeError, (i,), message=(
                    f"'{symbol}' needs bool (or i32) operands, got {t.dtype}; "
                    "compare first, e.g. (x > 0)"))
        return TensorType(result_dtype(types), broadcast(types), all_weak(types))

    return infer


def _operator(kind, symbol, infer, function, triton, cheap=False) -> None:
    define(kind, 2, ELEMENTWISE, infer, reads=Reads.PROMOTED, symbol=symbol, fold=function,
           reference=function, triton=triton, cheap=cheap)


_operator("add", "+", _arith, operator.add, binary("{a} + {b}"), cheap=True)
_operator("sub", "-", _arith, operator.sub, binary("{a} - {b}"), cheap=True)
_operator("mul", "*", _arith, operator.mul, binary("{a} * {b}"), cheap=True)
_operator("div", "/", _true_div, operator.truediv, binary("{a} / {b}", "tl.div_rn({a}, {b})"))


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

for _kind, _symbol, _function in (("lt", "<", operator.lt), ("le", "<=", operator.le),
                                  ("gt", ">", operator.gt), ("ge", ">=", operator.ge),
                                  ("eq", "==", operator.eq), ("ne", "!=", operator.ne)):
    define(_kind, 2, ELEMENTWISE, _compare, reads=Reads.COMPARE, symbol=_symbol, fold=_function,
           reference=_function, triton=compare(_symbol))

# functions, not operators: torch.maximum takes no Python scalars, so both operands are
# read in the result's type
_AB = (BParam("a"), BParam("b"))
define("maximum", 2, ELEMENTWISE, _arith, params=_AB, fold=max, reference=torch.maximum,
       triton=nan_propagating("maximum"), cheap=True)
define("minimum", 2, ELEMENTWISE, _arith, params=_AB, fold=min, reference=torch.minimum,
       triton=nan_propagating("minimum"), cheap=True)


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
       fold=lambda c, a, b: a if c else b, reference=torch.where, triton=_render_where)
