"""The graph-IR op set: kinds, categories and type rules.

Each op kind has one `OpDef` with its arity, its category (what the fusion
passes and code generators key on) and a type rule `infer(operand_types,
attrs) -> TensorType`. Semantic analysis, the verifier and rewrite patterns
all use these rules, so an op's type is defined in exactly one place. A rule
that rejects its operands raises `RuleError`, which names the diagnostic
class and which operands to point at; sema turns it into a located error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tiledsl import diagnostics as diag
from tiledsl.types import (
    BroadcastMismatch,
    DType,
    TensorType,
    all_weak,
    broadcast_shapes,
    format_shape,
    normalize_axis,
    result_dtype,
)


class RuleError(Exception):
    """A type rule refused its operands; `operands` are the ones to blame."""

    def __init__(
        self, cls: type[diag.TileDSLError], operands: tuple[int, ...] = (), **fields: object
    ) -> None:
        super().__init__(cls.template.format(**fields))
        self.cls, self.operands, self.fields = cls, operands, fields


Infer = Callable[[tuple[TensorType, ...], Mapping[str, Any]], TensorType]


@dataclass(frozen=True, slots=True)
class OpDef:
    kind: str
    arity: int
    category: str  # source | elementwise | reduction | softmax | matmul | layout | return
    infer: Infer


OPS: dict[str, OpDef] = {}


def _define(kind: str, arity: int, category: str, infer: Infer) -> None:
    OPS[kind] = OpDef(kind, arity, category, infer)


def category(kind: str) -> str:
    return OPS[kind].category


def is_elementwise(kind: str) -> bool:
    return kind in OPS and OPS[kind].category == "elementwise"


# --- helpers -----------------------------------------------------------------


def _broadcast(types: tuple[TensorType, ...]) -> tuple:
    try:
        return broadcast_shapes(*(t.shape for t in types))
    except BroadcastMismatch as err:
        # Find the two operands that disagree, for the notes.
        rank = max(t.rank for t in types)
        culprits = [
            i for i, t in enumerate(types)
            if t.rank > rank - err.dim - 1 and t.shape[err.dim - (rank - t.rank)] in (err.a, err.b)
        ]
        a, b = (culprits + [0, 1])[:2]
        raise RuleError(
            diag.BroadcastError, (a, b), lhs=format_shape(types[a].shape),
            rhs=format_shape(types[b].shape), dim=err.dim, a=err.a, b=err.b,
        ) from None


def _float_of(dtype: DType) -> DType:
    return dtype if dtype.is_float else DType.F32


def _axis(attrs: Mapping[str, Any], rank: int) -> int:
    axis = attrs["axis"]
    norm = normalize_axis(axis, rank)
    if norm is None:
        raise RuleError(diag.AxisError, (0,), axis=axis, rank=rank, lo=-rank, hi=rank - 1)
    return norm


# --- sources -----------------------------------------------------------------


def _from_attrs(types, attrs):
    return attrs["type"]


for _kind in ("param", "const", "dim"):
    _define(_kind, 0, "source", _from_attrs)


def _index(types, attrs):
    shape = attrs["shape"]
    if normalize_axis(attrs["axis"], len(shape)) is None:
        raise RuleError(diag.AxisError, (), axis=attrs["axis"], rank=len(shape),
                        lo=-len(shape), hi=len(shape) - 1)
    return TensorType(DType.I32, shape)


# index has no operands: its value depends only on the shape it was given.
_define("index", 0, "elementwise", _index)


# --- elementwise -------------------------------------------------------------


def _unary_float(types, attrs):
    (x,) = types
    return TensorType(_float_of(x.dtype), x.shape, x.weak)


def _unary_signed(name: str) -> Infer:
    def infer(types, attrs):
        (x,) = types
        if x.dtype is DType.BOOL:
            raise RuleError(diag.DTypeError, (0,),
                            message=f"'{name}' is not defined for bool values")
        return x

    return infer


def _cast(types, attrs):
    (x,) = types
    return TensorType(attrs["dtype"], x.shape, x.weak)


FLOAT_UNARY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "erf",
               "gelu")
for _kind in FLOAT_UNARY:
    _define(_kind, 1, "elementwise", _unary_float)
_define("neg", 1, "elementwise", _unary_signed("-"))
_define("abs", 1, "elementwise", _unary_signed("abs"))
_define("relu", 1, "elementwise", _unary_signed("relu"))
_define("cast", 1, "elementwise", _cast)


def _arith(types, attrs):
    return TensorType(result_dtype(types), _broadcast(types), all_weak(types))


def _true_div(types, attrs):
    return TensorType(_float_of(result_dtype(types)), _broadcast(types), all_weak(types))


def _compare(types, attrs):
    return TensorType(DType.BOOL, _broadcast(types), all_weak(types))


def _logical(symbol: str) -> Infer:
    def infer(types, attrs):
        for i, t in enumerate(types):
            if t.dtype.is_float:
                raise RuleError(diag.DTypeError, (i,), message=(
                    f"'{symbol}' needs bool (or i32) operands, got {t.dtype}; "
                    "compare first, e.g. (x > 0)"))
        return TensorType(result_dtype(types), _broadcast(types), all_weak(types))

    return infer


for _kind in ("add", "sub", "mul", "maximum", "minimum"):
    _define(_kind, 2, "elementwise", _arith)
_define("div", 2, "elementwise", _true_div)
for _kind in ("lt", "le", "gt", "ge", "eq", "ne"):
    _define(_kind, 2, "elementwise", _compare)
_define("and", 2, "elementwise", _logical("&"))
_define("or", 2, "elementwise", _logical("|"))

COMPARE_KINDS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
BINARY_KINDS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "&": "and", "|": "or"}


def _where(types, attrs):
    cond, a, b = types
    if cond.dtype is not DType.BOOL:
        raise RuleError(diag.DTypeError, (0,),
                        message=f"the condition of 'where' must be bool, got {cond.dtype}")
    return TensorType(result_dtype((a, b)), _broadcast(types), all_weak(types))


_define("where", 3, "elementwise", _where)


# --- reductions, softmax -------------------------------------------------------


def _reduced_shape(x: TensorType, attrs) -> tuple:
    axis = _axis(attrs, x.rank)
    if attrs.get("keepdims", False):
        return x.shape[:axis] + (1,) + x.shape[axis + 1 :]
    return x.shape[:axis] + x.shape[axis + 1 :]


def _sum(types, attrs):
    (x,) = types
    dtype = x.dtype if x.dtype.is_float else DType.I32
    return TensorType(dtype, _reduced_shape(x, attrs))


def _minmax(types, attrs):
    (x,) = types
    return TensorType(x.dtype, _reduced_shape(x, attrs))


def _mean(types, attrs):
    (x,) = types
    if not x.dtype.is_float:
        raise RuleError(diag.DTypeError, (0,), message=(
            f"'mean' needs a floating-point input, got {x.dtype}; use cast(x, f32) first"))
    return TensorType(x.dtype, _reduced_shape(x, attrs))


def _logsumexp(types, attrs):
    (x,) = types
    return TensorType(_float_of(x.dtype), _reduced_shape(x, attrs))


def _softmax(types, attrs):
    (x,) = types
    _axis(attrs, x.rank)
    return TensorType(_float_of(x.dtype), x.shape)


_define("sum", 1, "reduction", _sum)
_define("max", 1, "reduction", _minmax)
_define("min", 1, "reduction", _minmax)
_define("mean", 1, "reduction", _mean)
_define("logsumexp", 1, "reduction", _logsumexp)
_define("softmax", 1, "softmax", _softmax)


# --- matmul, layout, return ------------------------------------------------------


def _matmul(types, attrs):
    a, b = types
    for i, t in enumerate(types):
        if t.rank < 2:
            raise RuleError(diag.RankError, (i,), message=(
                f"matmul operands need rank 2 or more; the {'left' if i == 0 else 'right'} "
                f"operand has shape {format_shape(t.shape)}"))
        if not t.dtype.is_float:
            raise RuleError(diag.DTypeError, (i,), message=(
                f"matmul needs floating-point operands, got {t.dtype}"))
    if a.shape[-1] != b.shape[-2]:
        hint = ""
        if b.shape[-1] == a.shape[-1]:
            hint = "; did you mean to transpose the right operand with .T?"
        raise RuleError(diag.MatmulShapeError, (0, 1), message=(
            f"matmul inner dims differ: {format_shape(a.shape)} @ {format_shape(b.shape)} "
            f"contracts {a.shape[-1]} with {b.shape[-2]}{hint}"))
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except BroadcastMismatch as err:
        raise RuleError(diag.MatmulShapeError, (0, 1), message=(
            f"matmul batch dims cannot be broadcast: {format_shape(a.shape[:-2])} and "
            f"{format_shape(b.shape[:-2])} differ at dim {err.dim} ({err.a} vs {err.b})"
        )) from None
    dtype = result_dtype((TensorType(a.dtype, a.shape), TensorType(b.dtype, b.shape)))
    return TensorType(dtype, batch + (a.shape[-2], b.shape[-1]))


def _transpose(types, attrs):
    (x,) = types
    a, b = attrs["dims"]
    na, nb = normalize_axis(a, x.rank), normalize_axis(b, x.rank)
    for given, norm in ((a, na), (b, nb)):
        if norm is None:
            raise RuleError(diag.AxisError, (0,), axis=given, rank=x.rank, lo=-x.rank,
                            hi=x.rank - 1)
    shape = list(x.shape)
    shape[na], shape[nb] = shape[nb], shape[na]
    return TensorType(x.dtype, tuple(shape), x.weak)


def _return(types, attrs):
    return TensorType(DType.BOOL, ())  # `return` has no value of its own


_define("matmul", 2, "matmul", _matmul)
_define("transpose", 1, "layout", _transpose)
OPS["return"] = OpDef("return", -1, "return", _return)


def infer(kind: str, types: tuple[TensorType, ...], attrs: Mapping[str, Any]) -> TensorType:
    return OPS[kind].infer(types, attrs)
