"""The Triton backend: fused IR -> generated kernels -> a launch plan.

`build` emits one Triton module per kernel node (source text only; nothing is
written or imported until the first call on a device). `TritonProgram.run`
walks the plan: parameters and dims are bound, `transpose` nodes become
zero-copy views, and each kernel gets fresh contiguous outputs, its
arguments resolved from `ArgSpec`s, and a launch configured for the sizes of
this call. CUDA tensors launch compiled kernels; CPU tensors run the same
kernels in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiledsl.binding import BoundCall, eval_shape, torch_dtype
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op

from . import attention, matmul, pointwise, rows
from .base import EmittedKernel, Hints, LaunchConfig
from .cache import load
from .codegen import DimSize, Numel, Ptr, Scalar, Stride
from .interpret import interpreting

TEMPLATES = {
    "pointwise": pointwise.emit,
    "rows": rows.emit,
    "matmul": matmul.emit,
    "attention": attention.emit,
}


def emit_kernel(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    emit = TEMPLATES.get(kernel.template)
    if emit is None:
        raise InternalError(kernel.span, message=f"no Triton template named '{kernel.template}'")
    if kernel.template in ("matmul", "attention"):
        return emit(kernel, hints, allow_tf32)
    return emit(kernel, hints)


@dataclass(frozen=True)
class Launch:
    """One launch as Triton's compiler sees it: enough for `aot.compile_launch` to rebuild it."""

    kernel: EmittedKernel
    signature: tuple[tuple[str, str], ...]
    dims: tuple[tuple[str, int], ...]


@dataclass
class _Step:
    node: int
    kind: str  # "dim" | "view" | "kernel"
    inputs: list[tuple[int, int]]
    op: Op | KernelOp
    emitted: EmittedKernel | None = None
    fns: dict[str, Any] = field(default_factory=dict)


class TritonProgram:
    def __init__(self, graph: Graph, allow_tf32: bool = False) -> None:
        self.graph = graph
        self.steps: list[_Step] = []
        self.emitted: list[EmittedKernel] = []
        self.launches: set[Launch] = set()
        for node in graph.topo_order():
            op = graph.op(node)
            inputs = graph.operand_edges(node)
            if isinstance(op, KernelOp):
                emitted = emit_kernel(op, graph.hints, allow_tf32)
                self.emitted.append(emitted)
                self.steps.append(_Step(node, "kernel", inputs, op, emitted))
            elif op.kind == "dim":
                self.steps.append(_Step(node, "dim", inputs, op))
            elif op.kind == "transpose":
                self.steps.append(_Step(node, "view", inputs, op))
            elif op.kind not in ("param", "return"):
                raise InternalError(op.span, message=(
                    f"'{op.kind}' reached the Triton backend outside a kernel; "
                    "run 'lower-kernels' last"))

    def run(self, bound: BoundCall) -> list[Any]:
        import torch

        device = bound.device or torch.device("cpu")
        target = "cuda" if device.type == "cuda" else "interpreter"
        values: dict[tuple[int, int], Any] = {
            (node, 0): v for node, v in zip(self.graph.params, bound.values, strict=True)}
        if target == "cuda":
            with torch.cuda.device(device):
                self._run(values, bound.dims, device, target)
        else:
            with interpreting():
                self._run(values, bound.dims, device, target)
        # a weak (Python-scalar-like) float travels between kernels as f64; the program
        # returns what it declares
        return [v.to(torch_dtype(t.dtype)) if v.dtype != torch_dtype(t.dtype) else v
                for v, t in zip((values[e] for e in self.graph.outputs), self.graph.returns, strict=True)]

    def _run(self, values: dict, dims: Mapping[str, int], device, target: str) -> None:
        import torch

        for step in self.steps:
            if step.kind == "dim":
                values[(step.node, 0)] = dims[step.op.attr("symbol")]
                continue
            args = [values[e] for e in step.inputs]
            if step.kind == "view":
                values[(step.node, 0)] = args[0].transpose(*step.op.attr("dims"))
                continue
            outs = [torch.empty(eval_shape(t.shape, dims), dtype=storage_dtype(t), device=device)
                    for t in step.op.result_types]
            self._launch(step, args, outs, dims, target)
            for i, out in enumerate(outs):
                values[(step.node, i)] = out

    def _launch(self, step: _Step, inputs: list, outputs: list, dims: Mapping[str, int],
                target: str) -> None:
        emitted = step.emitted
        args = []
        for _, spec in emitted.params:
            if isinstance(spec, Ptr):
                args.append((inputs if spec.role == "in" else outputs)[spec.index])
            elif isinstance(spec, Stride):
                t = (inputs if spec.role == "in" else outputs)[spec.index]
                args.append(t.stride(spec.dim))
            elif isinstance(spec, DimSize):
                args.append(dims[spec.symbol])
            elif isinstance(spec, Numel):
                total = 1
                for d in eval_shape(spec.shape, dims):
                    total *= d
                args.append(total)
            elif isinstance(spec, Scalar):  # bools travel as 0/1 (see Emitter.scalar)
                value = inputs[spec.index]
                args.append(int(value) if isinstance(value, bool) else value)
        fn = step.fns.get(target)
        if fn is None:
            fn = step.fns[target] = load(emitted.source, emitted.fn_name, target, emitted.ir())

        def launch(cfg: LaunchConfig) -> None:
            options = {}
            if target == "cuda":
                options = {"num_warps": cfg.num_warps or 4, "num_stages": cfg.num_stages or 3}
            fn[cfg.grid](*args, **cfg.constexprs, **options)

        candidates = emitted.launch_candidates(dims, target)
        if candidates:
            from .autotune import choose

            cfg = choose(emitted, dims, candidates, launch)
        else:
            cfg = emitted.launch_config(dims, target)
        if len(self.launches) < 1024:
            self.launches.add(Launch(emitted, _signature(emitted, args), tuple(sorted(dims.items()))))
        launch(cfg)


def storage_dtype(t):
    """How a kernel result is stored: in its dtype, except weak floats, which are f64
    (the Python float they stand for)."""
    import torch

    return torch.float64 if t.weak and t.dtype.is_float else torch_dtype(t.dtype)


_POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32",
                  "bool": "*i1", "float64": "*fp64", "int64": "*i64"}


def _signature(emitted: EmittedKernel, args: list) -> tuple[tuple[str, str], ...]:
    sig = []
    for (name, _), value in zip(emitted.params, args, strict=True):
        if hasattr(value, "data_ptr"):
            sig.append((name, _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]))
        elif isinstance(value, bool):
            sig.append((name, "i1"))
        elif isinstance(value, int):
            sig.append((name, "i32" if -(2**31) <= value < 2**31 else "i64"))
        else:
            sig.append((name, "fp32"))
    return tuple(sig)
