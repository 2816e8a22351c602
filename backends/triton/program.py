"""The Triton backend: fused IR -> generated kernels -> launch plans.

`TritonBackend` emits one Triton module per kernel node (source text only;
nothing is compiled until the first call on a device). A call binds its
arguments, looks up the `LaunchPlan` for its (target, device, sizes) and
launches each kernel with fresh contiguous outputs (`launch.py`). CUDA
tensors launch compiled kernels; CPU tensors run the same kernels in
Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch as _torch

from tiledsl.backends.interface import Backend, Kernel
from tiledsl.binding import BoundCall, eval_shape, torch_dtype
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op

from . import attention, matmul, pointwise, rows
from .base import EmittedKernel, Hints
from .cache import load
from .interpret import interpreting
from .launch import (
    KernelLaunch,
    KernelStep,
    LaunchPlan,
    argument_function,
    launch_options,
    launcher,
    swap_axes,
)

MAX_PLANS = 4096  # launch plans kept per program (one per size class)
_CPU_DEVICE = _torch.device("cpu")
_empty = _torch.empty
_current_device = _torch.cuda.current_device

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


class TritonBackend(Backend):
    """Generated kernels, launched through one `LaunchPlan` per (target, device, sizes).

    At construction every kernel is emitted and the graph is flattened into
    `steps`: each value gets a slot, transposes become (slot, permutation)
    reads of their source (a view needs no tensor of its own: a kernel reads
    it through permuted strides), and dims are filled in per plan. The first
    call at new sizes builds the plan (loading the kernels, choosing launch
    configurations, autotuning on a GPU, fixing every size-derived argument);
    every later call binds its arguments, finds the plan by a tuple key and
    launches.
    """

    name = "triton"

    def __init__(self, graph: Graph, allow_tf32: bool = False) -> None:
        super().__init__(graph, allow_tf32)
        self.emitted: list[EmittedKernel] = []
        self._launches: dict[tuple, Launch] = {}
        self._plans: dict[tuple, LaunchPlan] = {}
        slots: dict[tuple[int, int], int] = {(p, 0): i for i, p in enumerate(graph.params)}
        views: dict[int, tuple[int, tuple[int, ...]]] = {}  # view slot -> (source slot, permutation)
        dims: list[tuple[int, str]] = []
        steps: list[KernelStep] = []
        n_slots = len(slots)
        for node in graph.topo_order():
            op = graph.op(node)
            if isinstance(op, Op) and op.kind in ("param", "return"):
                continue
            if not isinstance(op, KernelOp) and op.kind not in ("dim", "transpose"):
                raise InternalError(op.span, message=(
                    f"'{op.kind}' reached the Triton backend outside a kernel; "
                    "run 'lower-kernels' last"))
            inputs = [slots[e] for e in graph.operand_edges(node)]
            n_out = len(op.region.outputs) if isinstance(op, KernelOp) else 1
            for r in range(n_out):
                slots[(node, r)] = n_slots + r
            if isinstance(op, KernelOp):
                emitted = emit_kernel(op, graph.hints, allow_tf32)
                self.emitted.append(emitted)
                reads = tuple(views.get(s, (s, None)) for s in inputs)
                steps.append(KernelStep(emitted, reads, n_slots))
            elif op.kind == "dim":
                dims.append((n_slots, op.attr("symbol")))
            else:  # a transpose of a transpose composes
                source, perm = views.get(inputs[0], (inputs[0], None))
                axes = swap_axes(op.type.rank, op.attr("dims"))
                views[n_slots] = (source, axes if perm is None else tuple(perm[a] for a in axes))
            n_slots += n_out
        self.steps = tuple(steps)
        self.n_slots = n_slots
        self.dim_slots = tuple(dims)
        self.outputs = tuple(slots[e] for e in graph.outputs)
        # a weak (Python-scalar-like) float travels between kernels as f64; the program
        # returns what it declares
        self.output_dtypes = tuple(torch_dtype(t.dtype) for t in graph.returns)

    @property
    def kernels(self) -> list[Kernel]:
        return [Kernel(e.kernel.name, e.kernel.template, e.kernel.covered, e.source, e.fn_name)
                for e in self.emitted]

    @property
    def launches(self) -> list[Launch]:
        return list(self._launches.values())

    # --- the call path -------------------------------------------------------------------

    def target(self, device) -> str:
        """Where a call on `device` runs: compiled on CUDA, interpreted on the CPU."""
        return "cuda" if device.type == "cuda" else "interpreter"

    def run(self, bound: BoundCall) -> list[Any]:
        device = bound.device or _CPU_DEVICE
        target = self.target(device)
        key = (target, device, *bound.dims.values())
        plan = self._plans.get(key)
        values = [None] * self.n_slots
        values[:len(bound.values)] = bound.values
        if target == "interpreter":
            with interpreting():
                self._run(plan, key, bound, values, device, target)
        elif device.index is not None and device.index != _current_device():
            with _torch.cuda.device(device):  # Triton launches on the current device
                self._run(plan, key, bound, values, device, target)
        else:
            self._run(plan, key, bound, values, device, target)
        outs = [values[s] for s in self.outputs]
        return [v if v.dtype is dt else v.to(dt) for v, dt in zip(outs, self.output_dtypes, strict=True)]

    def _run(self, plan: LaunchPlan | None, key: tuple, bound: BoundCall, values: list, device,
             target: str) -> None:
        if plan is None:
            if len(self._plans) >= MAX_PLANS:  # sizes that never repeat: keep memory bounded
                self._plans.clear()
            self._plans[key] = self._plan(bound, values, device, target)
            return  # building the plan ran the call
        for slot, size in plan.dims:
            values[slot] = size
        for k in plan.kernels:
            outs = [_empty(shape, dtype=dtype, device=device) for shape, dtype in k.outputs]
            k.launch(*k.args(values, outs), **k.options)
            values[k.slot:k.slot + len(outs)] = outs

    def _plan(self, bound: BoundCall, values: list, device, target: str) -> LaunchPlan:
        """Build the plan for this call's sizes by running the call step by step."""
        dims = bound.dims
        dim_values = tuple((slot, dims[symbol]) for slot, symbol in self.dim_slots)
        for slot, size in dim_values:
            values[slot] = size
        kernels = []
        for step in self.steps:
            emitted = step.emitted
            outputs = tuple((eval_shape(t.shape, dims), storage_dtype(t))
                            for t in emitted.kernel.result_types)
            outs = [_empty(shape, dtype=dtype, device=device) for shape, dtype in outputs]
            arg_fn = argument_function(emitted, step.reads, [o[0] for o in outputs], dims)
            args = arg_fn(values, outs)
            launch = launcher(self.load(emitted, target), target)
            candidates = emitted.launch_candidates(dims, target)
            if candidates:
                from .autotune import choose

                def trial(c, launch=launch, args=args):
                    launch(*args, **launch_options(c, target))

                cfg = choose(emitted, dims, candidates, trial)
            else:
                cfg = emitted.launch_config(dims, target)
            options = launch_options(cfg, target)
            if len(self._launches) < 1024:
                record = Launch(emitted, _signature(emitted, args), tuple(sorted(dims.items())))
                self._launches.setdefault((emitted.fn_name, record.signature, record.dims), record)
            launch(*args, **options)
            values[step.slot:step.slot + len(outs)] = outs
            kernels.append(KernelLaunch(launch, arg_fn, options, outputs, step.slot))
        return LaunchPlan(dim_values, tuple(kernels))

    def load(self, emitted: EmittedKernel, target: str) -> Any:
        """The kernel's function for `target` (`cache.load`: compiled in memory once)."""
        return load(emitted.source, emitted.fn_name, target, emitted.ir())


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
