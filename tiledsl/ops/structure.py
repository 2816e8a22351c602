"""Ops that are not elementwise math: sources, `index`, reductions, softmax, matmul, views.

Their Triton code belongs to a template (`plans.TEMPLATES`), chosen by category in
lower-kernels (`LOWERED`) or by a fusion pass; sources are bound by the caller, so they have no
reference implementation of their own.
"""

from __future__ import annotations

import functools
import math

import torch

from tiledsl import diagnostics as diag
from tiledsl.dims import evaluate
from tiledsl.types import (
    BroadcastMismatch,
    DType,
    TensorType,
    broadcast_shapes,
    broadcasts_to,
    format_shape,
    normalize_axis,
    result_dtype,
)

from .core import BParam, Category, Reads, Reduction, RuleError, Scan, define
from .rules import axis, float_of, reduced_shape

X = BParam("x")
AXIS = BParam("axis", "int", -1)
KEEPDIMS = BParam("keepdims", "bool", False)


# --- sources -----------------------------------------------------------------


def _from_attrs(types, attrs):
    return attrs["type"]


for _kind in ("param", "const", "dim"):
    define(_kind, 0, Category.SOURCE, _from_attrs)


def _index(types, attrs):
    shape = attrs["shape"]
    if normalize_axis(attrs["axis"], len(shape)) is None:
        raise RuleError(diag.AxisError, (), axis=attrs["axis"], rank=len(shape),
                        lo=-len(shape), hi=len(shape) - 1)
    return TensorType(DType.I32, shape)


def _arange(axis: int, shape: tuple[int, ...]) -> torch.Tensor:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return torch.arange(shape[axis], dtype=torch.int32).view(view).expand(shape).contiguous()


# index has no operands: its value depends only on the shape it was given, so templates
# compute it over their tile (the reference gets the shape with its dims bound)
define("index", 0, Category.ELEMENTWISE, _index, params=(X, BParam("axis", "int")),
       reference=_arange, units=1)


# --- gathers --------------------------------------------------------------------


def _take(types, attrs):
    x, *indices = types
    if len(indices) != x.rank:
        raise RuleError(diag.IndexingError, (0,), message=(
            f"indexing a rank-{x.rank} value needs {x.rank} indices, got {len(indices)}"))
    for k, t in enumerate(indices, start=1):
        if not t.dtype.is_int:
            raise RuleError(diag.IndexingError, (k,), message=index_dtype_message(t.dtype))
    try:
        shape = broadcast_shapes(*(t.shape for t in indices))
    except BroadcastMismatch as err:
        raise RuleError(diag.IndexingError, tuple(range(1, len(types))), message=(
            f"index arrays cannot be broadcast together: they differ at dim {err.dim} "
            f"({err.a} vs {err.b})")) from None
    return TensorType(x.dtype, shape)


def index_dtype_message(dtype: DType) -> str:
    if dtype is DType.BOOL:
        return ("indexing needs an integer value, got bool: a mask selects a data-dependent "
                "number of elements, which tiledsl shapes cannot express; use where(mask, x, 0)")
    return f"indexing needs an integer value, got {dtype}; cast(i, i32) if it holds whole numbers"


def _take_reference(x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
    """x[i0, i1, ...] with NumPy's negative indices; 0 where an index is out of range."""
    shape = torch.broadcast_shapes(*(i.shape for i in indices))
    valid = torch.ones(shape, dtype=torch.bool)
    wrapped = []
    for n, i in zip(x.shape, indices, strict=True):
        i = i.to(torch.int64).expand(shape)
        i = torch.where(i < 0, i + n, i)
        inside = (i >= 0) & (i < n)
        valid &= inside
        wrapped.append(torch.where(inside, i, 0))
    return torch.where(valid, x[tuple(wrapped)], torch.zeros((), dtype=x.dtype))


# take(x, i0, ..., i{r-1}) = x[i0, ..., i{r-1}], the index arrays broadcast together: what
# advanced indexing and gather() build. Kernels load x through the indices (masked: an
# out-of-range index reads 0), so x is never loaded, or fused, element for element.
def _d_take(d, wanted):
    """A gather's gradient: at an index map of positions (a concat's piece, a flip, a pad),
    g read back at the inverse map (`index_maps.gather_adjoint`); otherwise g added at the
    indices it read (a scatter-add, `put`): x's elements read twice get both, those never
    read 0, those read out of range nothing."""
    if not wanted[0]:
        return (None,)  # the indices are integers
    from tiledsl.index_maps import gather_adjoint

    mapped = gather_adjoint(d)
    if mapped is not None:
        return (mapped,)
    g = d.g if d.shape(d.g) == d.op.shape else d.call("expand", d.g, shape=d.op.shape)
    indices = [d.x(k) for k in range(1, d.x_type(0).rank + 1)]
    return (d.call("put", g, *indices, shape=d.x_type(0).shape, accumulate=True),)


define("take", -1, Category.ELEMENTWISE, _take, reads=Reads.OPERAND, reference=_take_reference,
       gathers=0, units=2, vjp=_d_take)


def _put(types, attrs):
    src, *indices = types
    shape = tuple(attrs["shape"])
    if len(indices) != len(shape):
        raise RuleError(diag.IndexingError, (0,), message=(
            f"writing into a rank-{len(shape)} value needs {len(shape)} indices, got {len(indices)}"))
    for k, t in enumerate(indices, start=1):
        if not t.dtype.is_int:
            raise RuleError(diag.IndexingError, (k,), message=index_dtype_message(t.dtype))
        if not broadcasts_to(t.shape, src.shape):
            raise RuleError(diag.IndexingError, (k,), message=(
                f"an index of shape {format_shape(t.shape)} does not broadcast to the written "
                f"values' {format_shape(src.shape)}"))
    dtype = src.dtype
    if attrs["accumulate"]:
        if dtype is DType.BOOL:
            raise RuleError(diag.DTypeError, (0,), message="a scatter-add needs numbers, got bool")
        if dtype in (DType.F16, DType.BF16):
            dtype = DType.F32  # added atomically in f32
    return TensorType(dtype, shape)


def put_reference(src: torch.Tensor, *indices: torch.Tensor, shape, accumulate: bool) -> torch.Tensor:
    """A tensor of `shape`, 0 but where src is written (added, with `accumulate`) at the
    indices; a negative index counts from the end, an out-of-range one writes nothing."""
    dtype = src.dtype
    if accumulate and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return _written(torch.zeros(shape, dtype=dtype), src, indices, accumulate)


def _written(out: torch.Tensor, src: torch.Tensor, indices, accumulate: bool) -> torch.Tensor:
    """`out` with src written (or added) at the indices, in place (put's and put_into's)."""
    valid = torch.ones(src.shape, dtype=torch.bool)
    wrapped = []
    for n, i in zip(out.shape, indices, strict=True):
        i = i.to(torch.int64).expand(src.shape)
        i = torch.where(i < 0, i + n, i)
        inside = (i >= 0) & (i < n)
        valid &= inside
        wrapped.append(i)
    return out.index_put_(tuple(i[valid] for i in wrapped), src[valid].to(out.dtype), accumulate=accumulate)


def _d_put(d, wanted):
    """Each written element's gradient is g where it went (a gather: `take`)."""
    indices = [d.x(k) for k in range(1, len(d.attr("shape")) + 1)]
    return (d.call("take", d.g, *indices),)


# put(src, i0, ..., i{r-1}, shape, accumulate) is `take`'s inverse: a tensor of `shape`, 0 but
# where src[p] is written (or added, accumulate=true) at (i0[p], ..., i{r-1}[p]); the index
# arrays broadcast to src's shape. What scatter, scatter_add, index_add and a gather's
# gradient build; a kernel of its own (Category.SCATTER: the indexed template), whose
# programs store or add atomically into a result that starts at 0.
define("put", -1, Category.SCATTER, _put, reads=Reads.OPERAND, reference=put_reference, vjp=_d_put)


def _put_into(types, attrs):
    x, src, *indices = types
    if src.dtype is not x.dtype:
        raise RuleError(diag.DTypeError, (1,), message=(
            f"writing {src.dtype} values into {x.dtype} needs a cast first"))
    t = _put((src, *indices), {"shape": x.shape, "accumulate": attrs["accumulate"]})
    if t.dtype is not x.dtype:
        raise RuleError(diag.DTypeError, (0,), message=(
            f"adding {src.dtype} values into {x.dtype} atomically loses their sum; put them into "
            f"{t.dtype} and add x after"))
    return TensorType(x.dtype, x.shape)


def _put_into_reference(x: torch.Tensor, src: torch.Tensor, *indices: torch.Tensor,
                        accumulate: bool) -> torch.Tensor:
    return _written(x.clone(), src, indices, accumulate)


def _d_put_into(d, wanted):
    """Written: x's gradient is g where nothing was written (a second put marks what was).
    Added: it is g. Each written or added element's is g where it went."""
    src_shape = d.x_type(1).shape
    indices = [d.x(k) for k in range(2, d.x_type(0).rank + 2)]
    g = d.g if d.shape(d.g) == d.op.shape else d.call("expand", d.g, shape=d.op.shape)
    gx = None
    if wanted[0] and d.attr("accumulate"):
        gx = g
    elif wanted[0]:
        true = d.call("expand", d.c(True), shape=src_shape)
        written = d.call("put", true, *indices, shape=d.x_type(0).shape, accumulate=False)
        gx = d.where(written, d.c(0), g)
    return (gx, d.call("take", g, *indices) if wanted[1] else None) + (None,) * len(indices)


# put_into(x, src, i0, ..., i{r-1}, accumulate) is x with src[p] written (added, accumulate=true)
# at (i0[p], ..., i{r-1}[p]): the out-of-place scatter (torch's scatter, index_copy, `x[i] = v`
# on a clone; scatter_add and index_add of an x whose type the adds keep) as canonicalize folds
# sema's put into zeros and its merge with x into one. Its kernel (the indexed template)
# starts from a copy of x that the launch makes and stores (adds) at the indices: x is not
# read at the written values' index, nor is its producer fused (`gathers`).
define("put_into", -1, Category.SCATTER, _put_into, reads=Reads.OPERAND, reference=_put_into_reference,
       vjp=_d_put_into, gathers=0)

# the operand a scatter op writes at the indices that follow it, by kind
WRITTEN = {"put": 0, "put_into": 1}


# --- reductions, softmax -------------------------------------------------------


def _sum(types, attrs):
    (x,) = types
    dtype = x.dtype if x.dtype.is_float or x.dtype is DType.I64 else DType.I32
    return TensorType(dtype, reduced_shape(x, attrs))


def _minmax(types, attrs):
    (x,) = types
    return TensorType(x.dtype, reduced_shape(x, attrs))


def _mean(types, attrs):
    (x,) = types
    if not x.dtype.is_float:
        raise RuleError(diag.DTypeError, (0,), message=(
            f"'mean' needs a floating-point input, got {x.dtype}; use cast(x, f32) first"))
    return TensorType(x.dtype, reduced_shape(x, attrs))


def _logsumexp(types, attrs):
    (x,) = types
    return TensorType(float_of(x.dtype), reduced_shape(x, attrs))


def _reduction(kind, infer, function, vjp, reduction: Reduction, reads: Reads = Reads.RESULT,
               discardable: frozenset[str] = frozenset()) -> None:
    define(kind, 1, Category.REDUCTION, infer, params=(X, AXIS, KEEPDIMS), reads=reads,
           reference=lambda x, axis, keepdims: function(x, dim=axis, keepdim=keepdims), vjp=vjp,
           reduction=reduction, discardable=discardable)


# derivative rules (`tiledsl.autodiff`): the gradient of a reduction is read back along
# the reduced axis (`d.keep`), broadcasting
def _d_extremum(d, wanted):
    """torch's amax/amin backward: the gradient is shared evenly by the elements equal to
    the result. The result is taken again from the operand as the backward has it, not
    saved: an operand recomputed there may round otherwise than in the forward's fused
    kernel (an attention's output with a sink, stored in 16 bits from f32 there, from f16
    factors here), and no element would equal the saved result (fuzz finding s3:338).
    The values of torch's pair (`values, indices = max(x, axis)`, attribute `pair`) are
    torch.max(x, dim)'s: the gradient goes to the position of the indices alone (the
    first extremum, or the first NaN), taken again from the operand likewise."""
    if d.attr("pair"):
        axis = d.attr("axis")
        at = d.call("arg" + d.op.kind, d.x(0), axis=axis, keepdims=True)
        shape = d.x_type(0).shape
        hit = d.call("eq", d.call("index", axis=axis % len(shape), shape=shape), at)
        return (d.where(hit, d.keep(d.g), d.c(0.0)),)
    top = d.call(d.op.kind, d.x(0), axis=d.attr("axis"), keepdims=True)
    hit = d.call("eq", d.x(0), top)
    count = d.call("sum", d.call("cast", hit, dtype=d.op.dtype), axis=d.attr("axis"), keepdims=True)
    return (d.where(hit, d.div(d.keep(d.g), count), d.c(0.0)),)


def _d_logsumexp(d, wanted):
    """g * exp(x - lse); 0 on a row that is all -inf (its lse is -inf), where torch has NaN."""
    lse = d.keep(d.y)
    p = d.call("exp", d.sub(d.x(0), lse))
    return (d.where(d.call("eq", lse, d.c(-math.inf)), d.c(0.0), d.mul(d.keep(d.g), p)),)


def _d_prod(d, wanted):
    """g times the product of the others, zeros included: with no zero in the row that is
    prod / x; with one, the product of the nonzero elements at the zero and 0 elsewhere;
    with two or more, 0 (torch's rule, without its exclusive cumulative products)."""
    x, axis = d.x(0), d.attr("axis")
    zero = d.call("eq", x, d.c(0.0))
    zeros = d.call("sum", d.call("cast", zero, dtype=DType.I32), axis=axis, keepdims=True)
    rest = d.call("prod", d.where(zero, d.c(1.0), x), axis=axis, keepdims=True)
    g = d.keep(d.g)
    one = d.where(d.call("and", zero, d.call("eq", zeros, d.c(1))), d.mul(g, rest), d.c(0.0))
    return (d.where(d.call("eq", zeros, d.c(0)), d.div(d.mul(g, rest), x), one),)


def _argextremum(kind: str):
    def rule(types, attrs):
        (x,) = types
        if x.dtype is DType.BOOL:  # as torch's
            raise RuleError(diag.DTypeError, (0,), message=(
                f"'{kind}' needs a number, got bool; use cast(x, i32) first"))
        return TensorType(DType.I64, reduced_shape(x, attrs))
    return rule


# sum reads its operand as i32 (bool sums count); torch accumulates integers in i64
_reduction("sum", _sum, torch.sum, lambda d, w: (d.keep(d.g),), Reduction(0.0, additive=True, wide=True))
# `pair` (the values of torch's pair, `values, indices = max(x, axis)`) says only where
# their gradient goes (`_d_extremum`)
_reduction("max", _minmax, torch.amax, _d_extremum, Reduction(-math.inf, nan=True, empty=False),
    discardable=frozenset({"pair"}))
_reduction("min", _minmax, torch.amin, _d_extremum, Reduction(math.inf, nan=True, empty=False),
    discardable=frozenset({"pair"}))
_reduction("mean", _mean, torch.mean, lambda d, w: (d.div(d.keep(d.g), d.axis_size()),),
           Reduction(0.0, additive=True, wide=True))
_reduction("logsumexp", _logsumexp, torch.logsumexp, _d_logsumexp, Reduction(-math.inf, online=True))
# prod has sum's dtypes (an i32 product wraps; torch's is i64)
_reduction("prod", _sum, torch.prod, _d_prod, Reduction(1.0, wide=True))
# argmax/argmin: the position (i64, torch's) of the first extremum; integers have no
# derivative, so they stop the gradient as torch's do
_reduction("argmax", _argextremum("argmax"), torch.argmax, None, Reduction(
    -math.inf, nan=True, index=True, empty=False),
    reads=Reads.OPERAND)
_reduction("argmin", _argextremum("argmin"), torch.argmin, None, Reduction(
    math.inf, nan=True, index=True, empty=False),
    reads=Reads.OPERAND)


def _softmax(types, attrs):
    (x,) = types
    axis(attrs, x.rank)
    return TensorType(float_of(x.dtype), x.shape)


def _softmax_reference(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Softmax of a row that is entirely -inf is 0 (the numerics contract)."""
    out = torch.softmax(x, dim=axis)
    empty = torch.isneginf(x).all(dim=axis, keepdim=True)
    return torch.where(empty, torch.zeros((), dtype=out.dtype), out)


def _d_softmax(d, wanted):
    """y * (g - sum(g * y)): 0 on an empty row (y is 0 there)."""
    dot = d.call("sum", d.mul(d.g, d.y), axis=d.attr("axis"), keepdims=True)
    return (d.mul(d.y, d.sub(d.g, dot)),)


define("softmax", 1, Category.SOFTMAX, _softmax, params=(X, AXIS), reference=_softmax_reference,
       vjp=_d_softmax)


# --- scans ----------------------------------------------------------------------------
# A scan's result has its operand's shape: element t combines elements 0..t along `axis`
# (t..n-1 with reverse=true) as its `Scan` declaration says (the rows template computes
# it); the reference is torch's along the axis, flipped for reverse=true.

REVERSE = BParam("reverse", "bool", False)


def _cumsum(types, attrs):
    (x,) = types
    axis(attrs, x.rank)
    return TensorType(_sum(types, {"axis": attrs["axis"], "keepdims": True}).dtype, x.shape)


def _cumulative_extremum(types, attrs):
    (x,) = types
    axis(attrs, x.rank)
    return x


def _logcumsumexp(types, attrs):
    (x,) = types
    axis(attrs, x.rank)
    return TensorType(float_of(x.dtype), x.shape)


def _linear_scan(types, attrs):
    a, b = types
    for i, t in enumerate(types):
        if not t.dtype.is_float:
            raise RuleError(diag.DTypeError, (i,), message=(
                f"'linear_scan' needs floating-point operands, got {t.dtype}"))
    if a.shape != b.shape:
        raise RuleError(diag.RankError, (0, 1), message=(
            f"'linear_scan' needs a and b of one shape, got {format_shape(a.shape)} and "
            f"{format_shape(b.shape)}; expand(a, [...]) broadcasts one"))
    axis(attrs, a.rank)
    return TensorType(result_dtype(types), a.shape)


def _linear_scan_reference(a: torch.Tensor, b: torch.Tensor, axis: int) -> torch.Tensor:
    """h[t] = a[t] * h[t - 1] + b[t] along `axis`, h[-1] = 0: the loop itself."""
    a, b = a.movedim(axis, 0), b.movedim(axis, 0)
    h, out = torch.zeros_like(b[0]), []
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return (torch.stack(out) if out else torch.zeros_like(b)).movedim(0, axis)


def _shifted(d, v: int, k: int, fill: float) -> int:
    """`v` (of the scan's shape) read k places on along the scan's axis, `fill` past either
    end: a gather at the shifted index."""
    inside, index = _shift(d, k)
    return d.where(inside, d.call("take", v, *index), d.c(fill))


def _shift(d, k: int) -> tuple[int, list[int]]:
    """Whether the position k places on along the scan's axis is inside it, and its index."""
    shape = d.x_type(0).shape
    ax = d.attr("axis") % len(shape)
    index = [d.call("index", axis=a, shape=tuple(n if j == a else 1 for j, n in enumerate(shape)))
             for a in range(len(shape))]
    at = index[ax] = d.add(index[ax], d.c(k))
    return d.call("and", d.call("ge", at, d.c(0)), d.call("lt", at, d.axis_size())), index


def _step(d) -> int:
    """+1 for a scan that runs forward (its adjoint runs backward, reading the next
    element), -1 for a reverse one."""
    return -1 if d.attr("reverse") else 1


def _d_cumsum(d, wanted):
    """The cumulative sum of g the other way."""
    return (d.call("cumsum", d.g, axis=d.attr("axis"), reverse=not d.attr("reverse")),)


def _d_cumprod(d, wanted):
    """g_i = y_{i-1} * sum_{j >= i} g_j * x_{i+1} ... x_j (zeros included, no division): the
    sum is a linear scan the other way, s_i = g_i + x_{i+1} * s_{i+1}."""
    k = _step(d)
    s = d.call("linear_scan", _shifted(d, d.x(0), k, 0.0), d.g, axis=d.attr("axis"),
               reverse=not d.attr("reverse"))
    return (d.mul(_shifted(d, d.y, -k, 1.0), s),)


def _d_cumulative_extremum(d, wanted):
    """torch's: each g_j goes to the position of the extremum at j, the latest of equal ones
    (a NaN is one): where x_i is the running extremum, the sum of g over the positions up to
    the next such one, a linear scan the other way that restarts at each. The running
    extremum is scanned again from the operand as the backward has it, as `_d_extremum`
    takes the extremum again: compared with the saved result, an operand recomputed here
    from 16-bit factors (an attention's output with a sink, rounded once from f32 in the
    forward's kernel) matched it nowhere along most rows, and their gradient went to the
    wrong positions (fuzz finding 0:534, x's gradient 0.214 off where eager's is 3e-4)."""
    x, k = d.x(0), _step(d)
    y = d.call(d.op.kind, x, axis=d.attr("axis"), reverse=d.attr("reverse"))
    new = d.call("or", d.call("eq", x, y), d.call("isnan", x))
    keep = d.call("cast", d.call("not", new), dtype=d.op.dtype)
    s = d.call("linear_scan", _shifted(d, keep, k, 0.0), d.g, axis=d.attr("axis"),
               reverse=not d.attr("reverse"))
    return (d.where(new, s, d.c(0.0)),)


def _d_logcumsumexp(d, wanted):
    """g_i = sum_{j >= i} g_j * exp(x_i - y_j) = exp(x_i - y_i) * s_i, with the linear scan
    the other way s_i = g_i + exp(y_i - y_{i+1}) * s_{i+1} (factors <= 1); 0 where x is
    -inf. The last element's factor multiplies the scan's h[-1] = 0: it is 0 (exp(y_i)
    there would overflow past y = 88, and inf * 0 is NaN)."""
    y, k = d.y, _step(d)
    inside, index = _shift(d, k)
    y_next = d.where(inside, d.call("take", y, *index), d.c(0.0))
    decay = d.where(d.call("eq", y, d.c(-math.inf)), d.c(0.0), d.call("exp", d.sub(y, y_next)))
    decay = d.where(inside, decay, d.c(0.0))
    s = d.call("linear_scan", decay, d.g, axis=d.attr("axis"), reverse=not d.attr("reverse"))
    x = d.x(0)
    return (d.where(d.call("eq", x, d.c(-math.inf)), d.c(0.0),
                    d.mul(d.call("exp", d.sub(x, y)), s)),)


def _d_linear_scan(d, wanted):
    """The adjoint runs the recurrence the other way: dh_t = g_t + a_{t+1} * dh_{t+1};
    db = dh, da_t = dh_t * h_{t-1} (h_{-1} = 0)."""
    k = _step(d)
    dh = d.call("linear_scan", _shifted(d, d.x(0), k, 0.0), d.g, axis=d.attr("axis"),
                reverse=not d.attr("reverse"))
    return (d.mul(dh, _shifted(d, d.y, -k, 0.0)) if wanted[0] else None, dh)


def _along(function):
    """torch's scan `function(x, dim)` along `axis`, run over the flipped axis for reverse."""
    def reference(*operands, axis, reverse):
        if reverse:
            operands = [o.flip(axis) for o in operands]
        out = function(*operands, axis)
        return out.flip(axis) if reverse else out
    return reference


def _scan(kind, arity, infer, function, vjp, scan: Scan) -> None:
    params = (X, AXIS, REVERSE) if arity == 1 else (BParam("a"), BParam("b"), AXIS, REVERSE)
    define(kind, arity, Category.SCAN, infer, params=params, reference=_along(function), vjp=vjp,
           scan=scan)


# cumsum and cumprod keep sum's dtypes (i32 for bool and i32; torch's integer ones are i64)
_scan("cumsum", 1, _cumsum, torch.cumsum, _d_cumsum, Scan((0.0,), wide=True))
_scan("cumprod", 1, _cumsum, torch.cumprod, _d_cumprod, Scan((1.0,), wide=True))
# cummax/cummin: the values of torch's (values, indices); a NaN stays, as torch's
_scan("cummax", 1, _cumulative_extremum, lambda x, dim: torch.cummax(x, dim).values,
      _d_cumulative_extremum, Scan((-math.inf,)))
_scan("cummin", 1, _cumulative_extremum, lambda x, dim: torch.cummin(x, dim).values,
      _d_cumulative_extremum, Scan((math.inf,)))
# logcumsumexp's partials are a running max m and the sum of exp(x - m), as online
# logsumexp's (log(1 + e) in one partial loses e's low bits at every step: 9e-5 over 4k
# elements); a rescale is 1 where the maxima are equal (two -inf or two inf)
_scan("logcumsumexp", 1, _logcumsumexp, torch.logcumsumexp, _d_logcumsumexp, Scan((-math.inf, 0.0)))
# linear_scan(a, b): h[t] = a[t] * h[t-1] + b[t], h[-1] = 0; its partials are (the product
# of a, h) over a stretch of the row, and a row starts from the constant function h = 0
# (0, 0), so its first element is a[0] * 0 + b[0] (NaN where a[0] is NaN or inf, as the
# recurrence says)
_scan("linear_scan", 2, _linear_scan, _linear_scan_reference, _d_linear_scan, Scan(
    (1.0, 0.0), start=(0.0, 0.0)))


# --- selection ------------------------------------------------------------------------
# topk(x, k, axis, largest): the k largest (smallest) elements along `axis` in order, and
# argtopk their positions (i64), torch's pair; sort and argsort are topk with k the axis'
# length (sema). Equal elements keep their order along the axis (the first first, torch's
# sort(stable=True)); NaN is larger than any number, as torch's; -0.0 equals 0.0 and
# comes back as 0.0. The rows template computes both from one sort of (value, position) keys.

K = BParam("k", "dim")
LARGEST = BParam("largest", "bool", True)


def _selection(index: bool):
    def rule(types, attrs):
        (x,) = types
        if x.dtype in (DType.BOOL, DType.I64):
            raise RuleError(diag.DTypeError, (0,), message=(
                f"'topk' and 'sort' need a float or i32 value, got {x.dtype}; cast(x, ...) first"))
        ax = axis(attrs, x.rank)
        shape = x.shape[:ax] + (attrs["k"],) + x.shape[ax + 1:]
        return TensorType(DType.I64 if index else x.dtype, shape)
    return rule


def _sorted(x: torch.Tensor, axis: int, k: int, largest: bool):
    """torch's stable sort along `axis`, its first k."""
    out = torch.sort(x, dim=axis, descending=largest, stable=True)
    return out.values.narrow(axis, 0, k), out.indices.narrow(axis, 0, k)


def _d_topk(d, wanted):
    """Each g_j goes back to the position the j-th selected element came from: the sum over
    j of where(position == index_j, g_j, 0), along an axis of k added after the row's."""
    shape, ax = d.x_type(0).shape, d.attr("axis") % d.x_type(0).rank
    k = d.attr("k")
    idx = d.call("argtopk", d.x(0), axis=ax, k=k, largest=d.attr("largest"))
    pos = d.call("index", axis=ax, shape=shape[:ax + 1] + (1,) + shape[ax + 1:])
    across = shape[:ax] + (1, k) + shape[ax + 1:]
    hit = d.call("eq", pos, d.call("reshape", idx, shape=across, copy=True))
    g = d.call("reshape", d.g, shape=across, copy=True)
    return (d.call("sum", d.where(hit, g, d.c(0.0)), axis=ax + 1, keepdims=False),)


define("topk", 1, Category.SELECT, _selection(False), reads=Reads.OPERAND,
       params=(X, K, AXIS, LARGEST),
       reference=lambda x, axis, k, largest: _sorted(x, axis, k, largest)[0], vjp=_d_topk)
define("argtopk", 1, Category.SELECT, _selection(True), reads=Reads.OPERAND,
       reference=lambda x, axis, k, largest: _sorted(x, axis, k, largest)[1])


# --- matmul, layout, return ------------------------------------------------------


def _matmul(types, attrs):
    a, b = types
    for i, t in enumerate(types):
        if t.rank < 2:
            raise RuleError(diag.RankError, (i,), message=(
                f"matmul operands need rank 2 or more; the {'left' if i == 0 else 'right'} "
                f"operand has shape {format_shape(t.shape)}"))
        if not t.dtype.is_float and t.dtype is not DType.I8:
            raise RuleError(diag.DTypeError, (i,), message=(
                f"matmul needs floating-point or i8 operands, got {t.dtype}"))
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
    if a.dtype.is_f8 or b.dtype.is_f8:
        if not (a.dtype.is_f8 and b.dtype.is_f8):
            i, t = (1, b) if a.dtype.is_f8 else (0, a)
            raise RuleError(diag.DTypeError, (i,), message=(
                f"an f8 matmul needs both operands in f8, got {a.dtype} @ {b.dtype}; "
                f"cast the {t.dtype} operand"))
        dtype = DType.F32  # f8 products accumulate, and are returned, in f32
    elif a.dtype is DType.I8 or b.dtype is DType.I8:
        if a.dtype is not b.dtype:
            i, t = (1, b) if a.dtype is DType.I8 else (0, a)
            raise RuleError(diag.DTypeError, (i,), message=(
                f"an i8 matmul needs both operands in i8, got {a.dtype} @ {b.dtype}; "
                f"cast the {t.dtype} operand"))
        dtype = DType.I32  # i8 products accumulate, and are returned, in i32 (torch._int_mm)
    else:
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


def _slice(types, attrs):
    (x,) = types
    shape = []
    for item in attrs["items"]:
        if item[0] == "range":
            shape.append(item[4])
        elif item[0] == "new":
            shape.append(1)
    return TensorType(x.dtype, tuple(shape), x.weak)


def _slice_reference(x: torch.Tensor, items, dims) -> torch.Tensor:
    return x[python_index(items, dims)]


def python_index(items, dims) -> tuple:
    """A `slice` op's items as a Python index tuple at the bound `dims`."""
    out: list[object] = []
    for item in items:
        if item[0] == "range":
            out.append(slice(evaluate(item[1], dims), evaluate(item[2], dims), item[3]))
        elif item[0] == "at":
            out.append(evaluate(item[1], dims))
        else:
            out.append(None)
    return tuple(out)


def format_items(items) -> str:
    """A `slice` op's items as the subscript that builds them (`:, 0, 64:128, None`)."""
    out = []
    for item in items:
        if item[0] == "range":
            _, start, stop, step, _ = item
            out.append(f"{'' if start == 0 else start}:{stop}" + (f":{step}" if step != 1 else ""))
        elif item[0] == "at":
            out.append(str(item[1]))
        else:
            out.append("None")
    return ", ".join(out)


def _reshape(types, attrs):
    (x,) = types
    return TensorType(x.dtype, tuple(attrs["shape"]), x.weak)


def reshape_view(x: torch.Tensor, shape: tuple[int, ...], source: tuple, fail) -> torch.Tensor:
    """`x` viewed as `shape` (no copy). When its strides do not allow that, `fail(message)`
    is raised with the first pair of dims of `source` (the symbolic shape of x) that a merge
    needs adjacent in memory and this call's tensor does not have adjacent."""
    try:
        return x.view(shape)
    except RuntimeError:
        pass
    sizes, strides = list(x.shape), list(x.stride())
    kept, p = set(), 1  # the element counts at which the new shape starts a dim
    for d in shape:
        kept.add(p)
        p *= d
    real = [k for k, n in enumerate(sizes) if n != 1]
    for a, b in zip(real, real[1:], strict=False):
        before = math.prod(sizes[:b])
        if before not in kept and strides[a] != strides[b] * sizes[b]:  # a new dim spans a and b
            raise fail(
                f"this reshape merges dims {source[a]} and {source[b]} of "
                f"{format_shape(source)}, which are not adjacent in memory at this call "
                f"(strides {strides[a]} and {strides[b]}, {source[b]} = {sizes[b]}); "
                "reshape never copies unless asked: reshape(x, [...], copy=true)")
    raise fail(f"this reshape cannot view a tensor of strides {tuple(strides)}; "
               "reshape(x, [...], copy=true) copies it")


def _return(types, attrs):
    return TensorType(DType.BOOL, ())  # `return` has no value of its own


def _d_matmul(d, wanted):
    """(g @ b.T, a.T @ g); the driver sums them over broadcast batch dims. A 2-D b of a
    batched product (a linear layer's weight, `x[B, T, K] @ w[K, N]`) gets its gradient as
    one GEMM over every row, the batch dims folded into the contracted one: a batch of
    partial products would each be rounded to b's dtype before the sum over the batch (f16
    weight gradients up to 3x eager's error), and run as small GEMMs."""
    a, b = d.x_type(0), d.x_type(1)
    db = None
    if wanted[1] and len(b.shape) == 2 and len(a.shape) > 2 and d.shape(d.g)[:-1] == a.shape[:-1] \
            and not d.scores:  # an attention's score matmul: its fused backward sums over heads
        from tiledsl.dims import Lin

        rows = functools.reduce(lambda x, y: x * y, (Lin.of(n) for n in a.shape[:-1])).dim()
        a2 = d.call("reshape", d.x(0), shape=(rows, a.shape[-1]), copy=True)
        g2 = d.call("reshape", d.g, shape=(rows, d.shape(d.g)[-1]), copy=True)
        db = d.call("matmul", d.transpose(a2), g2)
    elif wanted[1]:
        db = d.call("matmul", d.transpose(d.x(0)), d.g)
    return (d.call("matmul", d.g, d.transpose(d.x(1))) if wanted[0] else None, db)


def _d_slice(d, wanted):
    """A view's gradient is g placed back where the view read: for views that keep whole
    axes, drop the new ones; otherwise each element of x reads g where the view read it and
    is 0 elsewhere (an index map, like `pad`: never a stored scatter)."""
    items = d.attr("items")
    sizes = iter(d.x_type(0).shape)
    whole = [i[0] == "new" or (i[0] == "range" and i[1:] == (0, (n := next(sizes)), 1, n))
             for i in items]
    if all(whole):
        back = [("at", 0) if i[0] == "new" else ("range", 0, i[4], 1, i[4]) for i in items]
        return (d.call("slice", d.g, items=tuple(back)),)
    from tiledsl.dims import Lin, nonnegative

    shape = d.x_type(0).shape
    at, inside, axis = [], [], 0
    for item in items:
        if item[0] == "new":
            at.append(None)
            continue
        i = d.call("index", axis=axis, shape=tuple(n if k == axis else 1 for k, n in enumerate(shape)))
        n = Lin.of(shape[axis])
        axis += 1
        if item[0] == "at":
            inside.append(d.call("eq", i, d.size(item[1])))
            continue
        _, start, _, step, length = item
        rel = i if start == 0 else d.sub(i, d.size(start))
        if start != 0:
            inside.append(d.call("ge", rel, d.c(0)))
        if not nonnegative(Lin.of(length).scale(step) - n + Lin.of(start)):  # (read to the end)
            inside.append(d.call("lt", rel, d.mul(d.size(length), d.c(step))))
        if step != 1:
            inside.append(d.call("eq", d.call("mod", rel, d.c(step)), d.c(0)))
            rel = d.call("floordiv", rel, d.c(step))
        at.append(rel)
    g_shape = d.shape(d.g)  # (broadcast: smaller than the view)
    lead = len(at) - len(g_shape)
    g = d.reread(d.g, [None if n == 1 else at[lead + k] for k, n in enumerate(g_shape)])
    return (d.where(d.all(inside), g, d.c(0.0)) if inside else g,)


def _matmul_reference(a, b):
    """i8 products exactly, in i64 (the result is i32, as torch._int_mm's)."""
    if a.dtype is torch.int32:  # i8 operands read in the result's type
        return torch.matmul(a.to(torch.int64), b.to(torch.int64))
    return torch.matmul(a, b)


define("matmul", 2, Category.MATMUL, _matmul, symbol="@", reference=_matmul_reference, vjp=_d_matmul)
define("transpose", 1, Category.LAYOUT, _transpose, params=(X, BParam("a", "int"), BParam("b", "int")),
       reference=lambda x, dims: x.transpose(*dims),
       vjp=lambda d, w: (d.call("transpose", d.g, dims=d.attr("dims")),))
# x[...] with integers, slices and None: a view (no copy), read through an offset and
# strides; items, one per source axis plus new axes: ("range", start, stop, step, length),
# ("at", index) or ("new",), starts, lengths and indices being dims
define("slice", 1, Category.LAYOUT, _slice, reference=_slice_reference, vjp=_d_slice)
# reshape(x, [d0, ...]): the same elements in row-major order, as a view (the backend
# refuses, naming the dims, a call whose strides need a copy) or, with copy=true, a copy
# where a view cannot be had
define("reshape", 1, Category.LAYOUT, _reshape,
       params=(X, BParam("shape", "shape"), BParam("copy", "bool", False)),
       reference=lambda x, shape, copy: x.reshape(shape),
       vjp=lambda d, w: (d.call("reshape", d.g, shape=d.x_type(0).shape, copy=True),))


def _expand(types, attrs):
    (x,) = types
    if not broadcasts_to(x.shape, attrs["shape"]):
        raise RuleError(diag.RankError, (0,), message=(
            f"expand cannot broadcast {format_shape(x.shape)} to {format_shape(attrs['shape'])}: "
            "each dim must equal the new one or be 1, and new dims go in front"))
    return TensorType(x.dtype, tuple(attrs["shape"]), x.weak and not attrs["shape"])


# expand(x, [d0, ...]): x broadcast to a shape, as a value (torch's expand; -1 keeps a dim).
# What a parameter's gradient is when it was broadcast (the autodiff driver adds it).
# Elementwise: templates read x at each element's index with its size-1 dims broadcast
define("expand", 1, Category.ELEMENTWISE, _expand, params=(X, BParam("shape", "shape")),
       fold=lambda a, shape: a, reference=lambda x, shape: x.expand(shape),
       units=0, vjp=lambda d, w: (d.g,))
define("return", -1, Category.RETURN, _return)
