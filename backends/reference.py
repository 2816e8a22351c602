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
Python scalars, exactly as they would be in torch code. What each op computes
is its `reference` in the op registry (`tiledsl/ops`); this module decides how
operands are read (`Reads`) and in which precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tiledsl import ops
from tiledsl.backends.interface import Backend, Kernel
from tiledsl.binding import BoundCall, torch_dtype
from tiledsl.diagnostics import EmptyReductionError
from tiledsl.dims import evaluate
from tiledsl.ir import Graph, KernelOp, Op, Region
from tiledsl.ops import Reads
from tiledsl.ops.core import read_types, reference_attrs
from tiledsl.types import DType, TensorType


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
        edges = graph.operand_edges(node)
        args = [values[e] for e in edges]
        if isinstance(op, KernelOp):
            for i, out in enumerate(run_region(op.region, args, bound.dims, float64)):
                values[(node, i)] = out
        else:
            types = tuple(graph.result_type(*e) for e in edges)
            values[(node, 0)] = eval_op(op, args, types, bound.dims, float64)
    return [_materialize(values[edge], t.dtype, float64, bound.device)
            for edge, t in zip(graph.outputs, graph.returns, strict=True)]


def run_region(region: Region, inputs: Sequence[Any], dims: Mapping[str, int],
               float64: bool) -> list[Any]:
    values = list(inputs)
    for rop in region.ops:
        types = tuple(region.value_type(v) for v in rop.operands)
        values.append(eval_op(rop.op, [values[v] for v in rop.operands], types, dims, float64))
    return [values[v] for v in region.outputs]


def compute_dtype(dtype: DType, float64: bool) -> torch.dtype:
    return torch.float64 if float64 and dtype.is_float else torch_dtype(dtype)


def _to_mode(value: Any, param: Op, float64: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(compute_dtype(param.dtype, float64))
    # a scalar parameter is a 0-dim tensor (it is not weak); a float one is held at f32
    # whatever its declared float dtype, not rounded to f16 or bf16: torch computes with a
    # Python scalar so beside a half-precision tensor (in f32, rounding the result once),
    # and so do the kernels, which take it as an f32 argument
    dtype = torch.float32 if param.dtype.is_float and not float64 else compute_dtype(param.dtype, float64)
    return torch.tensor(value, dtype=dtype)


def _materialize(v: Any, dtype: DType, float64: bool, device) -> torch.Tensor:
    t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    t = t.to(device=device or "cpu", dtype=compute_dtype(dtype, float64))
    return t.contiguous().clone()


def _tensor(v: Any, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(dtype)
    if isinstance(v, int) and not isinstance(v, bool) and not dtype.is_floating_point \
            and dtype is not torch.bool:  # a Python int wraps into an integer type, as a cast does
        return torch.tensor(v, dtype=torch.int64).to(dtype)
    return torch.tensor(v, dtype=dtype)


def eval_op(op: Op, args: list[Any], types: tuple[TensorType, ...], dims: Mapping[str, int],
            float64: bool) -> Any:
    """One op, of operands of `types`, with torch semantics; weak results stay Python
    scalars, computed like the Python arithmetic they stand for: floats in double
    precision, integers in i64 (a product of sizes past 2^31 does not wrap)."""
    rounds = op.kind == "cast"  # a cast still rounds (or wraps)
    out_dtype = _held(op.type, rounds, float64)
    if op.kind == "const":
        return op.attr("value")
    if op.kind == "dim":
        return dims[op.attr("symbol")]
    opdef = ops.OPS[op.kind]
    attrs = reference_attrs(op)
    if "shape" in attrs:  # index: its shape with the dims bound
        attrs["shape"] = tuple(evaluate(d, dims) for d in attrs["shape"])
    if "k" in attrs:  # topk: how many, bound
        attrs["k"] = evaluate(attrs["k"], dims)
    if op.kind == "slice":
        attrs["dims"] = dims
    if opdef.reads in (Reads.PROMOTED, Reads.COMPARE):
        # read in the promoted type, which torch works out itself from the values
        args = _promoted(op, opdef.reads, args, out_dtype, float64)
    else:
        # the float64 golden does not round at casts (a cast reads its operand in f64): a
        # rounding step would make it discontinuous, and a compiled kernel within 1e-7 of it
        # before the cast could land one ulp away after it (seen with the program fuzzer)
        args = [(v if isinstance(v, torch.Tensor) else torch.tensor(v)) if r is None
                else _tensor(v, _held(r, rounds, float64))
                for v, r in zip(args, read_types(op.kind, types, op.type), strict=True)]
    if opdef.reduction is not None and not opdef.reduction.empty:
        _check_not_empty(op, args[0])
    result = opdef.reference(*args, **attrs)
    if op.weak:
        return result.item()
    return result.to(out_dtype)


def _held(t: TensorType, rounds: bool, float64: bool) -> torch.dtype:
    """The torch dtype a value of type `t` is computed in: a weak one like the Python
    arithmetic it stands for (f64, i64), unless the op `rounds` it to its dtype (a cast)."""
    if t.weak and not rounds and t.dtype.is_float:
        return torch.float64
    if t.weak and not rounds and t.dtype.is_int:
        return torch.int64
    return compute_dtype(t.dtype, float64)


def _check_not_empty(op: Op, x: torch.Tensor) -> None:
    """A reduction with no value over an empty axis (max, min): located, as the Triton
    backend refuses it, not torch's IndexError."""
    axis = op.attr("axis")
    axes = range(x.dim()) if axis is None else (axis,) if isinstance(axis, int) else axis
    for a in axes:
        if x.shape[a] == 0:
            raise EmptyReductionError(op.span, kind=op.kind, axis=f"axis {a % x.dim()} has size 0")


def _promoted(op: Op, reads: Reads, args: list[Any], out_dtype: torch.dtype,
              float64: bool) -> list[Any]:
    """Python scalars go to torch as Python scalars, so promotion is torch's own."""
    if not any(isinstance(v, torch.Tensor) for v in args):
        # weak-only ops compute on 0-d tensors; comparisons in double, like Python's
        operand = torch.float64 if reads is Reads.COMPARE else out_dtype
        return [_tensor(v, operand) for v in args]
    if float64:
        # golden: compute every floating-point op in float64
        wide = op.dtype.is_float or any(isinstance(v, torch.Tensor) and v.is_floating_point()
                                        for v in args)
        if wide:
            return [v.to(torch.float64) if isinstance(v, torch.Tensor) else v for v in args]
    return args
