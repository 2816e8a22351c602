"""The reference backend: torch eager, op by op.

It defines what a program means. Two modes:
- eager (default): every op in its IR dtype, the way a user would write it in
  torch, so its error against the golden result is the yardstick of the test
  oracle (design section 5);
- float64 (`float64=True`): every floating-point value in float64, the golden
  result.

It runs the graph IR and the fused IR alike: a kernel node is evaluated by
evaluating its region with the same op semantics, so fused regions can be
checked without Triton. Weak values (literals, dims, arithmetic on them) are
Python scalars, exactly as they would be in torch code. Softmax of a row that
is entirely -inf is 0, and its logsumexp is -inf (the numerics contract).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tiledsl.backends.interface import Backend, Kernel
from tiledsl.binding import BoundCall, torch_dtype
from tiledsl.ir import Graph, KernelOp, Op, Region
from tiledsl.types import DType


class ReferenceBackend(Backend):
    """The fused graph run op by op (its kernels are regions evaluated in torch)."""

    name = "reference"

    @property
    def kernels(self) -> list[Kernel]:
        return [Kernel(k.name, k.template, k.covered, None)
                for k in (self.graph.op(n) for n in self.graph.kernels())]

    def run(self, bound: BoundCall) -> list[Any]:
        return run(self.graph, bound)


def run(graph: Graph, bound: BoundCall, float64: bool = False) -> list[torch.Tensor]:
    """Evaluate a (graph or fused) IR on bound arguments; returns the outputs."""
    values: dict[tuple[int, int], Any] = {}
    for node, value in zip(graph.params, bound.values, strict=True):
        values[(node, 0)] = _to_mode(value, graph.op(node), float64)
    for node in graph.topo_order():
        op = graph.op(node)
        if isinstance(op, Op) and op.kind in ("param", "return"):
            continue
        args = [values[e] for e in graph.operand_edges(node)]
        if isinstance(op, KernelOp):
            for i, out in enumerate(run_region(op.region, args, bound.dims, float64)):
                values[(node, i)] = out
        else:
            values[(node, 0)] = eval_op(op, args, bound.dims, float64)
    return [_materialize(values[edge], t.dtype, float64, bound.device)
            for edge, t in zip(graph.outputs, graph.returns, strict=True)]


def run_region(region: Region, inputs: Sequence[Any], dims: Mapping[str, int],
               float64: bool) -> list[Any]:
    values = list(inputs)
    for rop in region.ops:
        values.append(eval_op(rop.op, [values[v] for v in rop.operands], dims, float64))
    return [values[v] for v in region.outputs]


def compute_dtype(dtype: DType, float64: bool) -> torch.dtype:
    return torch.float64 if float64 and dtype.is_float else torch_dtype(dtype)


def _to_mode(value: Any, param: Op, float64: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(compute_dtype(param.dtype, float64))
    # a scalar parameter is a 0-dim tensor (it is not weak)
    return torch.tensor(value, dtype=compute_dtype(param.dtype, float64))


def _materialize(v: Any, dtype: DType, float64: bool, device) -> torch.Tensor:
    t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    t = t.to(device=device or "cpu", dtype=compute_dtype(dtype, float64))
    return t.contiguous().clone()


def _tensor(v: Any, dtype: torch.dtype) -> torch.Tensor:
    return v.to(dtype) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype)


_UNARY = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu, "erf": torch.erf,
    "neg": torch.neg,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
    "ne": torch.ne, "and": torch.bitwise_and, "or": torch.bitwise_or,
}
_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin, "mean": torch.mean,
           "logsumexp": torch.logsumexp}


def eval_op(op: Op, args: list[Any], dims: Mapping[str, int], float64: bool) -> Any:
    """One op with torch semantics; weak results stay Python scalars, computed in double
    precision like the Python arithmetic they stand for."""
    weak_double = op.weak and op.dtype.is_float and op.kind != "cast"  # a cast still rounds
    out_dtype = torch.float64 if weak_double else compute_dtype(op.dtype, float64)
    kind = op.kind
    if kind == "const":
        return op.attr("value")
    if kind == "dim":
        return dims[op.attr("symbol")]
    if kind == "index":
        shape = tuple(d if isinstance(d, int) else dims[d] for d in op.shape)
        axis = op.attr("axis")
        view = [1] * len(shape)
        view[axis] = shape[axis]
        return torch.arange(shape[axis], dtype=torch.int32).view(view).expand(shape).contiguous()
    if kind == "transpose":
        return args[0].transpose(*op.attr("dims"))
    if kind == "cast":
        # the float64 golden does not round at casts: a rounding step would make it
        # discontinuous, and a compiled kernel within 1e-7 of it before the cast could land
        # one ulp away after it (seen with the program fuzzer)
        result = _tensor(args[0], out_dtype)
    elif kind in _UNARY or kind == "gelu":
        x = _tensor(args[0], out_dtype)
        if kind == "gelu":
            result = F.gelu(x, approximate=op.attr("approximate"))
        else:
            result = _UNARY[kind](x)
    elif kind in _BINARY:
        result = _binary(op, args, out_dtype, float64)
    elif kind == "where":
        cond = _tensor(args[0], torch.bool)
        a, b = (_tensor(v, out_dtype) for v in args[1:])
        result = torch.where(cond, a, b)
    elif kind in _REDUCE:
        x = args[0]
        if kind == "logsumexp" or kind == "mean":
            x = x.to(out_dtype)
        if kind == "sum" and not op.dtype.is_float:
            x = x.to(torch.int64)
        fn = _REDUCE[kind]
        result = fn(x, dim=op.attr("axis"), keepdim=op.attr("keepdims"))
    elif kind == "softmax":
        result = _softmax(args[0].to(out_dtype), op.attr("axis"))
    elif kind == "matmul":
        result = torch.matmul(args[0].to(out_dtype), args[1].to(out_dtype))
    else:  # pragma: no cover - the verifier rejects unknown kinds
        raise NotImplementedError(kind)
    if op.weak:
        return result.item()
    return result.to(out_dtype)


def _binary(op: Op, args: list[Any], out_dtype: torch.dtype, float64: bool) -> Any:
    """Python scalars go to torch as Python scalars, so promotion is torch's own."""
    a, b = args
    scalars = [not isinstance(v, torch.Tensor) for v in args]
    if op.kind in ("maximum", "minimum") or all(scalars):
        # torch.maximum takes no Python scalars; weak-only ops compute on 0-dim tensors
        operand = out_dtype if op.kind not in _COMPARE else torch.float64
        a, b = (_tensor(v, operand) for v in (a, b))
    elif float64:
        # golden: compute every floating-point op in float64
        wide = op.dtype.is_float or any(isinstance(v, torch.Tensor) and v.is_floating_point()
                                        for v in args)
        if wide:
            a, b = (v.to(torch.float64) if isinstance(v, torch.Tensor) else v for v in (a, b))
    if op.kind in _COMPARE and not isinstance(a, torch.Tensor):  # torch.lt(2, t) is refused
        return _BINARY[_COMPARE[op.kind]](b, a)
    return _BINARY[op.kind](a, b)


_COMPARE = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}  # -> mirrored


def _softmax(x: torch.Tensor, axis: int) -> torch.Tensor:
    out = torch.softmax(x, dim=axis)
    empty = torch.isneginf(x).all(dim=axis, keepdim=True)
    return torch.where(empty, torch.zeros((), dtype=out.dtype), out)
