"""Call-time argument binding and validation, shared by every backend.

Arguments bind to parameters like a Python call (positionally, then by name).
Tensors are checked for type, rank, dtype, device and sizes; every dim symbol
must bind to one size across all parameters. Each error is an
`ArgumentError` located at the parameter's declaration and naming both sizes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiledsl.diagnostics import ArgumentError, Note, did_you_mean
from tiledsl.dims import evaluate
from tiledsl.ir import Graph
from tiledsl.types import DType, TensorType, format_shape


def torch_dtype(dtype: DType):
    import torch

    return {DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.F32: torch.float32,
            DType.I8: torch.int8, DType.U8: torch.uint8, DType.I16: torch.int16,
            DType.I32: torch.int32, DType.I64: torch.int64, DType.BOOL: torch.bool,
            DType.F8E4M3: torch.float8_e4m3fn, DType.F8E5M2: torch.float8_e5m2}[dtype]


class DimRules:
    """What a call's sizes must satisfy beyond binding: each dim expression of the program
    and each of `Graph.requires` at least 0 (sizes, and slice bounds inside their axis)."""

    def __init__(self, graph: Graph) -> None:
        from tiledsl.ir import KernelOp

        spans: dict[str, Any] = {}
        for node in graph.nodes():
            op = graph.op(node)
            found = ([(r.op.shape, r.op.span) for r in op.region.ops] if isinstance(op, KernelOp)
                     else [(op.shape, op.span)])
            for shape, span in found:
                for d in shape:
                    if isinstance(d, str) and not d.isidentifier():
                        spans.setdefault(d, span)
        self.checks = tuple((d, span, f"the dim {d} of this value must be at least 0", 0)
                            for d, span in sorted(spans.items(), key=lambda x: x[0]))
        seen: set[tuple[str, str]] = set()
        for d, span, message in graph.requires:
            if (d, message) not in seen:  # a view read twice states its rules twice
                seen.add((d, message))
                self.checks += ((d, span, message, 0),)
        self.passed: set[tuple] = set()  # sizes already checked (they depend on nothing else)

    def __call__(self, dims: Mapping[str, int]) -> None:
        key = tuple(dims.items())
        if key in self.passed:
            return
        for d, span, message, least in self.checks:
            if evaluate(d, dims) < least:
                sizes = ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))
                raise ArgumentError(span, message=f"{message}; at these sizes ({sizes}) it is not "
                                    f"({d} = {evaluate(d, dims)})")
        if len(self.passed) >= 1024:  # sizes that never repeat: keep memory bounded
            self.passed.clear()
        self.passed.add(key)


def dim_rules(graph: Graph) -> DimRules | None:
    """The graph's `DimRules` (None when it has none), found once per graph."""
    memo = graph.memo("dim-rules")
    if None not in memo:
        rules = DimRules(graph)
        memo[None] = rules if rules.checks else None
    return memo[None]


@dataclass
class BoundCall:
    values: list[Any]  # per parameter: a tensor or a Python scalar
    dims: dict[str, int]
    device: Any  # torch.device; None when no tensor was passed


def bind(graph: Graph, args: Sequence[Any], kwargs: Mapping[str, Any]) -> BoundCall:
    import torch

    params = [graph.op(p) for p in graph.params]
    names = [p.attr("name") for p in params]
    if len(args) > len(params):
        raise ArgumentError(graph.span, message=(
            f"'{graph.name}' takes {len(params)} argument(s) ({', '.join(names)}), got {len(args)}"))
    given: dict[str, Any] = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in names:
            raise ArgumentError(graph.span, message=(
                f"'{graph.name}' has no parameter '{key}'{did_you_mean(key, names)} "
                f"(parameters: {', '.join(names)})"))
        if key in given:
            raise ArgumentError(params[names.index(key)].span,
                                message=f"got two values for argument '{key}'")
        given[key] = value

    dims: dict[str, tuple[int, str]] = {}
    device = None
    device_owner = ""
    values = []
    for op, name in zip(params, names, strict=True):
        if name not in given:
            raise ArgumentError(op.span, message=f"missing argument '{name}' ({op.attr('type')})")
        value = given[name]
        t: TensorType = op.attr("type")
        if op.attr("scalar"):
            values.append(_scalar(value, name, t, op.span, torch))
            _check_bounds(op, name, values[-1])
            continue
        if not isinstance(value, torch.Tensor):
            raise ArgumentError(op.span, message=(
                f"argument '{name}' must be a torch.Tensor of {t}, got {type(value).__name__}"))
        value = _dense(value, name, op.span, torch, scalar=False)
        if value.dim() != t.rank:
            raise ArgumentError(op.span, message=(
                f"argument '{name}' has {value.dim()} dimension(s) {list(value.shape)}, but "
                f"parameter '{name}' is declared {t} ({t.rank} dimension(s))"))
        if value.dtype != torch_dtype(t.dtype):
            raise ArgumentError(op.span, message=(
                f"argument '{name}' has dtype {value.dtype}, but parameter '{name}' is declared "
                f"{t.dtype} ({torch_dtype(t.dtype)})"))
        if value.device.type not in ("cpu", "cuda"):
            raise ArgumentError(op.span, message=(
                f"argument '{name}' is on {value.device}; tiledsl runs on CPU (through "
                "Triton's interpreter) and on CUDA devices"))
        if device is None:
            device, device_owner = value.device, name
        elif value.device != device:
            raise ArgumentError(op.span, message=(
                f"argument '{name}' is on {value.device}, but '{device_owner}' is on {device}; "
                "all tensors must be on one device"))
        for axis, (declared, size) in enumerate(zip(t.shape, value.shape, strict=True)):
            if isinstance(declared, int):
                if size != declared:
                    raise ArgumentError(op.span, message=(
                        f"argument '{name}' has size {size} in dim {axis}, but parameter '{name}' "
                        f"declares {declared} ({format_shape(t.shape)})"))
            elif declared in dims and dims[declared][0] != size:
                bound, owner = dims[declared]
                raise ArgumentError(op.span, message=(
                    f"argument '{name}' has size {size} in dim {axis} ({declared}), but "
                    f"{declared} is {bound} from argument '{owner}'"))
            else:
                dims.setdefault(declared, (size, name))
        values.append(value)
    sizes = {k: v for k, (v, _) in dims.items()}
    rules = dim_rules(graph)
    if rules is not None:
        rules(sizes)
    return BoundCall(values, sizes, device)


class Binder:
    """`bind` for one graph, fast on the call path: checks that prove a call valid, in a
    few attribute reads per argument. Anything unusual (a wrong argument, a tensor
    subclass, a lazily negated view, a 0-d tensor for a scalar) goes to `bind`, which
    either binds it or raises the one error it would always raise."""

    def __init__(self, graph: Graph) -> None:
        import torch

        self.graph = graph
        params = [graph.op(p) for p in graph.params]
        self.names = tuple(p.attr("name") for p in params)
        self.index = {name: i for i, name in enumerate(self.names)}
        # per parameter: None for a scalar's type check, else (torch dtype, shape)
        self.params: list[tuple[Any, Any]] = []
        for p in params:
            t: TensorType = p.attr("type")
            if p.attr("scalar"):
                self.params.append((t.dtype, None))
            else:
                self.params.append((torch_dtype(t.dtype), tuple(t.shape)))
        self.symbols = tuple(sorted({d for _, shape in self.params if shape for d in shape
                                     if isinstance(d, str)}))
        self._tensor, self._strided = torch.Tensor, torch.strided
        self._grad = torch.is_grad_enabled
        self.rules = dim_rules(graph)
        # scalar parameters with bounds (sema's `bounds`: dropout's p), checked every call
        self.bounded = tuple((i, p.attr("bounds")) for i, p in enumerate(params) if p.attr("bounds"))

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> BoundCall:
        given = list(args)
        if kwargs or len(given) != len(self.names):
            if len(given) > len(self.names):
                return bind(self.graph, args, kwargs)
            given += [_MISSING] * (len(self.names) - len(given))
            for key, value in kwargs.items():
                i = self.index.get(key)
                if i is None or given[i] is not _MISSING:
                    return bind(self.graph, args, kwargs)
                given[i] = value
        dims: dict[str, int] = {}
        device = None
        grad = None
        for value, (dtype, shape) in zip(given, self.params, strict=True):
            if shape is None:
                kind = type(value)
                if not (kind is float and dtype.is_float
                        or kind is int and dtype is not DType.BOOL
                        and (_in_range(value, dtype.int_range) if dtype.is_int else -_BIG < value < _BIG)
                        or kind is bool and dtype is DType.BOOL):
                    return bind(self.graph, args, kwargs)
                continue
            if type(value) is not self._tensor or value.dtype is not dtype or value.is_nested \
                    or value.layout is not self._strided or value.is_neg() or value.is_conj():
                return bind(self.graph, args, kwargs)
            if value.requires_grad:
                grad = self._grad() if grad is None else grad
                if grad:
                    return bind(self.graph, args, kwargs)
            sizes = value.shape
            if len(sizes) != len(shape):
                return bind(self.graph, args, kwargs)
            for declared, size in zip(shape, sizes):  # noqa: B905 - lengths checked above
                if (declared != size if declared.__class__ is int
                                else dims.setdefault(declared, size) != size):
                    return bind(self.graph, args, kwargs)
            if device is None:
                device = value.device
                if device.type != "cuda" and device.type != "cpu":
                    return bind(self.graph, args, kwargs)
            elif value.device != device:
                return bind(self.graph, args, kwargs)
        values = [float(v) if shape is None and type(v) is int and dtype.is_float else v
                  for v, (dtype, shape) in zip(given, self.params, strict=True)]
        for i, bounds in self.bounded:
            if not all(lo <= values[i] <= hi for lo, hi, _, _ in bounds):
                return bind(self.graph, args, kwargs)  # which raises, naming the parameter
        if self.rules is not None:
            self.rules(dims)
        return BoundCall(values, dims, device)


def _check_bounds(op, name: str, value: Any) -> None:
    """A scalar argument outside a range its program declares (sema's `bounds`: dropout's
    p in [0, 1]), refused as torch refuses it, naming the parameter."""
    for lo, hi, what, span in op.attr("bounds", ()):
        if not lo <= value <= hi:
            raise ArgumentError(op.span, [Note(f"used as the {what} here", span)], message=(
                f"argument '{name}': {what} has to be between {lo:g} and {hi:g}, but got {value}"))


def _in_range(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]


_MISSING = object()
_BIG = 2**64  # an int beyond this goes to `bind`, which says if it overflows a float


def _dense(value: Any, name: str, span, torch, scalar: bool) -> Any:
    """The tensor as kernels read it: strided, its lazy negation/conjugation applied; and
    never one whose gradient would be silently dropped (a tensor parameter that needs a
    gradient reaches the binder only below autograd, through `fn.op`)."""
    _refuse_nested(value, name, span)
    if value.layout != torch.strided:
        raise ArgumentError(span, message=(
            f"argument '{name}' is a {str(value.layout).removeprefix('torch.')} tensor; tiledsl "
            f"kernels read dense (strided) tensors: pass {name}.to_dense()"))
    if scalar and value.requires_grad and torch.is_grad_enabled():
        raise ArgumentError(span, message=(
            f"argument '{name}' requires grad, but '{name}' is a scalar parameter, which has no "
            f"gradient: declare it a tensor (like f32[1]) to differentiate it, or pass "
            f"{name}.detach()"))
    # x.conj().imag and friends are views with the negative (or conjugate) bit set: the
    # sign lives in the bit, not the memory the kernel reads
    return value.resolve_conj().resolve_neg()


def _refuse_nested(value: Any, name: str, span) -> None:
    """A nested tensor has no one shape (its `dim()` works, its `shape` raises)."""
    if value.is_nested:
        raise ArgumentError(span, message=(
            f"argument '{name}' is a nested tensor ({str(value.layout).removeprefix('torch.')} "
            "layout); tiledsl kernels read dense tensors of one shape: pad it "
            f"(torch.nested.to_padded_tensor({name}, 0.0)) or call the program once per component"))


def _scalar(value: Any, name: str, t: TensorType, span, torch) -> Any:
    if isinstance(value, torch.Tensor):
        _refuse_nested(value, name, span)
        if value.dim() != 0:
            raise ArgumentError(span, message=(
                f"argument '{name}' must be a scalar ({t.dtype}), got a tensor of shape "
                f"{list(value.shape)}"))
        value = _dense(value, name, span, torch, scalar=True).item()
    import numpy as np

    if isinstance(value, np.bool_):
        value = bool(value)
    if t.dtype is DType.BOOL:
        if not isinstance(value, bool):
            raise ArgumentError(span, message=f"argument '{name}' must be a bool, got "
                                f"{type(value).__name__}")
        return value
    if t.dtype.is_int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ArgumentError(span, message=f"argument '{name}' must be an int ({t.dtype}), got "
                                f"{type(value).__name__}")
        if not _in_range(int(value), t.dtype.int_range):
            raise ArgumentError(span, message=f"argument '{name}' = {value} does not fit in {t.dtype}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(span, message=f"argument '{name}' must be a number ({t.dtype}), got "
                            f"{type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ArgumentError(span, message=(
            f"argument '{name}' is an int of {int(value).bit_length()} bits, too large for "
            f"{t.dtype}")) from None


def eval_shape(shape, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else evaluate(d, dims) for d in shape)
