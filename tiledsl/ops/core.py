"""What an op declaration holds, and the registry every layer reads.

An `OpDef` is the whole of an op: its arity and category (what fusion keys on),
its type rule, how the DSL calls it by name, how it reads its operands, how it
folds on Python scalars, what it means in torch (the reference backend) and
how it renders in Triton. `define` adds one to `OPS`; nothing else anywhere
says what an op is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiledsl import diagnostics as diag
from tiledsl.types import DType, TensorType, all_weak, result_dtype


class Category(str, enum.Enum):
    """What the fusion passes and templates key on (a str enum: prints as its value)."""

    SOURCE = "source"  # param, const, dim: values bound at call time or compile time
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    SOFTMAX = "softmax"
    SCAN = "scan"  # a running combination along one axis (cumsum): no extra pass over the row
    SELECT = "select"  # topk along one axis: k of a row's elements, in order, and their positions
    MATMUL = "matmul"
    SCATTER = "scatter"  # writes or adds its operand at indices: a kernel of its own (put)
    LAYOUT = "layout"  # a view: consumers read it through permuted strides
    RETURN = "return"

    def __str__(self) -> str:
        return self.value


class Reads(enum.Enum):
    """How an op reads its operands, which every backend and the constant folder honour."""

    RESULT = "result"  # every operand converted to the result's type first
    PROMOTED = "promoted"  # a binary operator: operands promote like torch's (scalars stay weak)
    COMPARE = "compare"  # like PROMOTED, but the result is bool
    SELECT = "select"  # a bool condition, then branches in the result's type (where)
    OPERAND = "operand"  # each operand in its own compute type (isnan: the result is bool)


def read_types(kind: str, types: Sequence[TensorType], out: TensorType) -> tuple[TensorType | None, ...]:
    """The type an op of `kind` and type `out` reads each operand (of `types`) in, as its
    `Reads` says; None: as it is. The one answer the builder, the Triton emitter (in the
    type's `value_compute`) and the reference backend read.

    A comparison reads both sides in their promoted type (torch.result_type, weak where both
    are); `where` its condition as it is (a bool) and its branches in its result's type; an
    OPERAND op each operand as it is; every other op, a binary operator too, each in its
    result's type."""
    reads = OPS[kind].reads
    if reads is Reads.OPERAND:
        return (None,) * len(types)
    if reads is Reads.COMPARE:
        return (TensorType(result_dtype(types), out.shape, all_weak(types)),) * len(types)
    if reads is Reads.SELECT:
        return (types[0],) + (out,) * (len(types) - 1)
    return (out,) * len(types)


class RuleError(Exception):
    """A type rule refused its operands; `operands` are the ones to blame."""

    def __init__(
        self, cls: type[diag.TileDSLError], operands: tuple[int, ...] = (), **fields: object
    ) -> None:
        super().__init__(cls.template.format(**fields))
        self.cls, self.operands, self.fields = cls, operands, fields


class NotDifferentiable(Exception):
    """A derivative rule cannot differentiate this use of its op; `tiledsl.autodiff` makes
    it a `GradientError` located at the op."""


REQUIRED = object()


@dataclass(frozen=True, slots=True)
class BParam:
    """A parameter of a DSL builtin. `kind` says what the argument must be: a tensor
    expression ("value": an operand) or a compile-time constant ("int", "float", "bool",
    "dtype", "str", "shape": an attribute of the same name)."""

    name: str
    kind: str = "value"  # value | int | float | bool | dtype | str | shape
    default: object = REQUIRED
    choices: tuple[str, ...] = ()


# the attribute of a `wide` reduction or scan that accumulates in f32 all the same (set by
# sum-precision where only 16-bit results depend on it)
ACCUMULATE = "accumulator"


def in_f64(op: Any) -> bool:
    """Does an op accumulate in f64: an f32 reduction or scan declared `wide` (sum, mean,
    prod, cumsum, cumprod), unless sum-precision found only 16-bit results depend on it."""
    declared = OPS[op.kind].reduction or OPS[op.kind].scan
    return declared is not None and declared.wide and op.dtype is DType.F32 and op.attr(ACCUMULATE) != "f32"


@dataclass(frozen=True, slots=True)
class Reduction:
    """How a reduction computes, which every template and pass reads instead of its name.

    A row is reduced in partials (one per lane of a tile, or per block of a row) that merge
    into a total, starting from `identity`, and the total gives the result; each backend says
    how it merges and finishes them, by op (the Triton backend's `renderings.REDUCTIONS`).
    The torch meaning is the op's `reference`, its derivative the op's `vjp`. A reduction
    accumulates in f32 when its operand or its result is a float (an f32 one in f64 when
    `wide`), otherwise in its operand's integer type (i32 for bool)."""

    # the partial that changes nothing: 0, 1, -inf or inf (an integer's lowest or highest)
    identity: float
    # partials add (sum, mean): what a GEMM accumulates from its A tiles in its K loop
    additive: bool = False
    # float partials are NaN when one of theirs is (Triton's tl.max drops NaN; torch's
    # amax keeps it)
    nan: bool = False
    # an f32 result accumulates in f64, so an f32 row sum is as good as correctly rounded
    # (unless the op says `ACCUMULATE` = "f32": passes/sum_precision.py)
    wide: bool = False
    # logsumexp: a running max and a sum rescaled as it grows (backends/triton/online.py)
    online: bool = False
    # argmax/argmin: the result is the position of the partial the merge keeps (the first of
    # equal ones, a NaN before any number), not its value
    index: bool = False
    # the result over an empty axis exists (sum: 0, mean: NaN, logsumexp: -inf); max and min
    # have none, and torch raises (`diagnostics.EmptyReductionError`)
    empty: bool = True


@dataclass(frozen=True, slots=True)
class Scan:
    """How a scan computes, which the rows template reads instead of its name.

    Each element of the row is lifted to a tuple of partials (as many as `identity` has);
    element t of the result is finished from the combination of the partials of elements
    0..t (t..n-1 with `reverse=true`) by an associative function of two tuples of partials
    whose left one covers the elements before the right one's. Each backend says how it
    lifts, combines and finishes them, by op (the Triton backend's `renderings.SCANS`)."""

    # per partial: the one that changes nothing, what masked lanes hold (0, 1, -inf or inf:
    # an integer's lowest or highest)
    identity: tuple[float, ...]
    # an f32 result accumulates in f64, as a sum does
    wide: bool = False
    # the partials of the state a row starts from, combined on the left of its first element
    # (its last with `reverse=true`); None: the identity, which changes nothing. A recurrence
    # from h[-1] = 0 is not the identity function: linear_scan's first element is
    # a[0] * 0 + b[0], NaN where a[0] is NaN or inf
    start: tuple[float, ...] | None = None


Infer = Callable[[tuple[TensorType, ...], Mapping[str, Any]], TensorType]


@dataclass(frozen=True, slots=True)
class OpDef:
    kind: str
    arity: int  # -1: any number (return)
    category: Category
    infer: Infer  # (operand types, attrs) -> result type, or RuleError
    reads: Reads = Reads.RESULT
    params: tuple[BParam, ...] | None = None  # the DSL signature when called by name
    symbol: str | None = None  # the infix operator that builds it
    fold: Callable[..., Any] | None = None  # fold(*python_scalars, **attrs)
    reference: Callable[..., Any] | None = None  # reference(*torch_values, **attrs)
    # an elementwise op's cost per element in units of one instruction (the scale below): what
    # prologue admission, recompute and the templates' spill rules sum
    units: int | None = None
    # the operand this op reads at indices it computes (`take`): kernels hold it as a
    # pointer, never load it at the tile's index, and never fuse its producer
    gathers: int | None = None
    # a reduction's declaration (Category.REDUCTION ops have one, no other op does)
    reduction: Reduction | None = None
    # a scan's declaration (Category.SCAN ops have one, no other op does)
    scan: Scan | None = None
    # the vector-Jacobian product, vjp(adjoint, wanted) -> a contribution per operand or None
    # (`tiledsl.autodiff`); None here: the op has no derivative (differentiating through it
    # is an error naming it)
    vjp: Callable[..., Any] | None = None
    # attributes that say how to compute or differentiate it, not what it computes (MLIR's
    # discardable attributes): its `reference` does not take them. A `wide` reduction's or
    # scan's `ACCUMULATE` is one (`define` adds it)
    discardable: frozenset[str] = frozenset()


OPS: dict[str, OpDef] = {}

# The scale of `OpDef.units`, an elementwise op's arithmetic per element: an add, a compare, a
# select, a shift or a cast is 1; an integer division or a gather's address and cached load 2;
# a division, square root or one transcendental (libdevice's f32 exp, log, tanh, erf) 4; two
# of them 8; an f64 libdevice call with a slow path (sin, cos, tan of a large argument, a
# reduction across which the GPU spills every live value of its tile) `SLOW_PATH_UNITS`.
SLOW_PATH_UNITS = 16


def define(kind: str, arity: int, category: Category, infer: Infer, **parts: Any) -> OpDef:
    assert kind not in OPS, f"op {kind!r} is declared twice"
    declared = parts.get("reduction") or parts.get("scan")
    if declared is not None and declared.wide:  # sum-precision may say it accumulates in f32
        parts["discardable"] = frozenset(parts.get("discardable", ())) | {ACCUMULATE}
    op = OPS[kind] = OpDef(kind, arity, category, infer, **parts)
    return op


def reference_attrs(op: Any) -> dict[str, Any]:
    """The attributes of `op` (an IR op) its torch reference takes: all but its discardable
    ones."""
    discardable = OPS[op.kind].discardable
    return {k: v for k, v in op.attr_map.items() if k not in discardable}


def units(kind: str) -> int:
    """The arithmetic one element of an op of `kind` costs (`OpDef.units`); an op that
    computes nothing per element (a constant, a dim, a view) costs 1, its read."""
    declared = OPS[kind].units if kind in OPS else None
    return 1 if declared is None else declared


def category(kind: str) -> Category:
    return OPS[kind].category


def is_elementwise(kind: str) -> bool:
    return kind in OPS and OPS[kind].category is Category.ELEMENTWISE


def gathers_at(kind: str, slot: int) -> bool:
    """Does an op of `kind` read operand `slot` at indices it computes (not element for
    element)?"""
    d = OPS.get(kind)
    return d is not None and d.gathers == slot


def linear_in(graph, node: int, slot: int) -> bool:
    """Is the op `node` of `graph` linear in its operand `slot`, the others fixed: a cast to a
    float, a product, `where(c, x, 0)` or `where(c, 0, x)`? What may stand between attention's
    probabilities and p @ v (fuse-attention's probability modification, autodiff's flash
    form): applied to each key block's p, scaled by the normaliser after, it is the same."""
    op = graph.op(node)
    if op.kind == "cast":
        return op.dtype.is_float
    if op.kind == "mul":
        return True
    if op.kind != "where" or slot == 0:
        return False
    other = graph.op(graph.operands(node)[3 - slot])
    return other.kind == "const" and other.attr("value") == 0


_F8_OPS = (Category.SOURCE, Category.MATMUL, Category.LAYOUT, Category.RETURN)


def infer(kind: str, types: tuple[TensorType, ...], attrs: Mapping[str, Any]) -> TensorType:
    d = OPS[kind]
    if d.category not in _F8_OPS and kind != "cast":
        for i, t in enumerate(types):
            if t.dtype.is_f8:
                raise RuleError(diag.DTypeError, (i,), message=(
                    f"'{d.symbol or kind}' cannot compute on {t.dtype} values: f8 is for storage and "
                    f"matmul operands; cast(x, f32) first"))
    return d.infer(types, attrs)
