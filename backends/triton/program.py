"""The Triton backend: fused IR -> generated kernels -> launch plans.

`TritonBackend` emits one Triton module per kernel node (source text only;
nothing is compiled until the first call on a device). A call binds its
arguments, looks up the `LaunchPlan` for its (target, device, sizes) and
launches each kernel with fresh contiguous outputs (`launch.py`). CUDA
tensors launch compiled kernels; CPU tensors run the same kernels in
Triton's interpreter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch as _torch

from tiledsl import logs
from tiledsl.backends.interface import Backend, Kernel
from tiledsl.binding import BoundCall, eval_shape, torch_dtype
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.plans import (
    TEMPLATES,
    AttentionBackwardPlan,
    AttentionPlan,
    GemmPlan,
    MergedPlan,
    Plan,
    PointwisePlan,
    RowPlan,
    ScatterPlan,
)

from . import attention, attention_backward, matmul, merged, pointwise, rows, scatter
from .base import EmittedKernel, Hints, LaunchConfig
from .cache import load
from .codegen import FLAGS
from .interpret import interpreting
from .launch import (
    Argument,
    KernelLaunch,
    KernelStep,
    LaunchPlan,
    ViewStep,
    argument_function,
    launch_options,
    launcher,
    specialize,
    swap_axes,
)

MAX_PLANS = 4096  # launch plans kept per program (one per size class)
_CPU_DEVICE = _torch.device("cpu")
_empty = _torch.empty
_zeros = _torch.zeros
_current_device = _torch.cuda.current_device

# each template's emitter, by its plan class (`plans.TEMPLATES`)
EMITTERS: dict[type[Plan], Callable[[KernelOp, Hints, bool], EmittedKernel]] = {
    PointwisePlan: pointwise.emit,
    RowPlan: rows.emit,
    GemmPlan: matmul.emit,
    AttentionPlan: attention.emit,
    AttentionBackwardPlan: attention_backward.emit,
    MergedPlan: merged.emit,
    ScatterPlan: scatter.emit,
}


def emit_kernel(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    emit = EMITTERS.get(TEMPLATES.get(kernel.template))
    if emit is None:
        raise InternalError(kernel.span, message=f"no Triton template named '{kernel.template}'")
    return emit(kernel, hints, allow_tf32)


@dataclass(frozen=True)
class Launch:
    """One launch as Triton's launcher compiles it (each argument's type and specialization)
    and the sizes it ran at: enough for `aot.compile_launch` to rebuild the same kernel."""

    kernel: EmittedKernel
    arguments: tuple[Argument, ...]
    dims: tuple[tuple[str, int], ...]

    @property
    def signature(self) -> tuple[tuple[str, str], ...]:
        return tuple((a.name, a.type) for a in self.arguments)


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
            if not isinstance(op, KernelOp) and op.kind not in ("dim", "transpose", "slice", "reshape"):
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
            elif op.kind in ("slice", "reshape"):
                source = graph.result_type(*graph.operand_edges(node)[0]).shape
                steps.append(ViewStep(views.get(inputs[0], (inputs[0], None)), op, source, n_slots))
            else:  # a transpose of a transpose composes
                source, perm = views.get(inputs[0], (inputs[0], None))
                axes = swap_axes(op.type.rank, op.attr("dims"))
                views[n_slots] = (source, axes if perm is None else tuple(perm[a] for a in axes))
                if (node, 0) in graph.outputs:  # returned: a torch view of a result stored transposed
                    steps.append(ViewStep(views[n_slots], op, (), n_slots))
            n_slots += n_out
        self.steps = tuple(steps)
        # kernels that may build TMA descriptors on the device need Triton's allocator
        self.needs_allocator = any("make_tensor_descriptor" in e.source for e in self.emitted)
        self.n_slots = n_slots
        self.dim_slots = tuple(dims)
        self.outputs = tuple(slots[e] for e in graph.outputs)
        # a weak (Python-scalar-like) float travels between kernels as f64; the program
        # returns what it declares
        self.output_dtypes = tuple(torch_dtype(t.dtype) for t in graph.returns)

    @property
    def kernels(self) -> list[Kernel]:
        # a kernel of several launches (a split row program's combine) shows every module
        return [Kernel(e.kernel.name, e.kernel.template, e.kernel.covered,
                       "\n".join([e.source, *(t.source for t in e.then)]), e.fn_name)
                for e in self.emitted]

    @property
    def launches(self) -> list[Launch]:
        return list(self._launches.values())

    def split_launches(self, dims: Mapping[str, int]) -> dict[str, str]:
        """Per kernel of several launches: its programs at these sizes on a GPU, with the
        split it chose (SPLITS ranges of K or of keys, rows in CHUNKs), then its combine's, or
        that it runs unsplit."""
        out = {}
        for e in self.emitted:
            if not e.then:
                continue
            cfg = e.launch_config(dims, "cuda")
            chosen = ", ".join(f"{k}={cfg.constexprs[k]}" for k in ("SPLITS", "CHUNK") if k in cfg.constexprs)
            parts = [f"{cfg.grid[0]} programs" + (f" ({chosen})" if chosen else "")]
            parts += [f"its combine's {c.grid[0]}" for c in (t.launch_config(dims, "cuda") for t in e.then)
                      if runs(c)]
            n = len(parts)
            out[e.kernel.name] = f"{n} launch{'es' if n > 1 else ''} on a GPU: {', then '.join(parts)}"
        return out

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
        else:
            if self.needs_allocator:
                ensure_allocator()
            if device.index is not None and device.index != _current_device():
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
        for k in plan.kernels:  # `allocate`, inlined: this is the call path
            outs = [alloc(shape, dtype=dtype, device=device) if order is None
                    else alloc(shape, dtype=dtype, device=device).permute(order)
                    for shape, dtype, order, alloc in k.outputs]
            k.launch(*k.args(values, outs), **k.options)
            for launch, args, options in k.then:
                launch(*args(values, outs), **options)
            values[k.slot:k.slot + k.results] = outs[:k.results]

    def _walk(self, bound: BoundCall, values: list, device):
        """The call step by step: for each kernel, its step, the outputs to allocate (shape,
        dtype), its argument function and its arguments, and the (emitted, argument
        function, arguments) of each launch that follows it. The outputs (allocated, not
        computed) take their slots once the caller has seen the step."""
        dims = bound.dims
        for slot, symbol in self.dim_slots:
            values[slot] = dims[symbol]
        for step in self.steps:
            if isinstance(step, ViewStep):
                view = step.launch(dims)
                view.launch(values)
                yield step, (), view, None, (), ()
                continue
            kernel = step.emitted.kernel
            outputs = tuple(output_allocation(eval_shape(t.shape, dims), storage_dtype(t),
                                              kernel.out_order(r), kernel.zero_filled(r))
                            for r, t in enumerate(kernel.result_types))
            outputs += workspace_allocation(step.emitted, dims, self.target(device))
            outs = [allocate(o, device) for o in outputs]
            arg_fn = argument_function(step.emitted, step.reads, outputs, dims)
            then = []
            for stage in step.emitted.then:
                stage_fn = argument_function(stage, step.reads, outputs, dims)
                then.append((stage, stage_fn, stage_fn(values, outs)))
            yield step, outputs, arg_fn, arg_fn(values, outs), outs, tuple(then)
            n = len(kernel.result_types)
            values[step.slot:step.slot + n] = outs[:n]

    def launches_at(self, bound: BoundCall) -> list[Launch]:
        """The launches a call with these arguments makes on a GPU, without running anything:
        every argument as Triton's launcher would specialize it (`aot.compile_launch`
        compiles them for sm_90 on any machine). Outputs are allocated, never written."""
        values = list(bound.values) + [None] * (self.n_slots - len(bound.values))
        dims = tuple(sorted(bound.dims.items()))
        out = []
        for step, _, _, args, _, then in self._walk(bound, values, bound.device or _CPU_DEVICE):
            if not isinstance(step, ViewStep):
                out.append(Launch(step.emitted, _arguments(step.emitted, args), dims))
                out += [Launch(stage, _arguments(stage, stage_args), dims) for stage, _, stage_args in then
                        if runs(stage.launch_config(bound.dims, "cuda"))]
        return out

    def _plan(self, bound: BoundCall, values: list, device, target: str) -> LaunchPlan:
        """Build the plan for this call's sizes by running the call step by step."""
        dims = bound.dims
        kernels = []
        for step, outputs, arg_fn, args, outs, then in self._walk(bound, values, device):
            if isinstance(step, ViewStep):
                kernels.append(arg_fn)  # the view's plan step
                continue
            emitted = step.emitted
            launch = launcher(self.load(emitted, target), target)
            candidates = emitted.launch_candidates(dims, target)
            if candidates:
                from .autotune import choose

                def trial(c, launch=launch, args=args):
                    launch(*args, **launch_options(c, target))

                cfg = choose(emitted, dims, candidates, trial)
                for out, (*_, alloc) in zip(outs, outputs, strict=True):
                    if alloc is _zeros:  # the trials added into it
                        out.zero_()
            else:
                cfg = emitted.launch_config(dims, target)
            options = launch_options(cfg, target)
            self._launch_once(emitted, launch, args, options, dims, target, bool(candidates))
            stages = []
            for stage, stage_fn, stage_args in then:  # the launches that follow, configured alone
                stage_cfg = stage.launch_config(dims, target)
                if not runs(stage_cfg):  # not needed at these sizes (an unsplit kernel's combine)
                    continue
                stage_launch = launcher(self.load(stage, target), target)
                stage_options = launch_options(stage_cfg, target)
                self._launch_once(stage, stage_launch, stage_args, stage_options, dims, target, False)
                stages.append((stage_launch, stage_fn, stage_options))
            kernels.append(KernelLaunch(launch, arg_fn, options, outputs, step.slot,
                                        len(emitted.kernel.result_types), tuple(stages)))
        return LaunchPlan(tuple((slot, dims[symbol]) for slot, symbol in self.dim_slots),
                          tuple(kernels))

    def _launch_once(self, emitted: EmittedKernel, launch, args: list, options: dict,
                     dims: Mapping[str, int], target: str, autotuned: bool) -> None:
        """A plan's first launch of a kernel function: logged (`TILEDSL_LOGS=launch`),
        recorded for `launches`, and run (it compiles)."""
        from triton.runtime.errors import OutOfResources

        log = logs.logger("launch")
        if log.isEnabledFor(logging.INFO):
            log.info("%s (%s) at %s on %s: %s%s", emitted.fn_name, emitted.kernel.template,
                     ", ".join(f"{k}={v}" for k, v in dims.items()), target,
                     ", ".join(f"{k}={v}" for k, v in options.items()),
                     " (autotuned)" if autotuned else "")
        if len(self._launches) < 1024:
            record = Launch(emitted, _arguments(emitted, args), tuple(sorted(dims.items())))
            self._launches.setdefault((emitted.fn_name, record.arguments, record.dims), record)
        try:
            launch(*args, **options)
        except OutOfResources as err:  # the first launch compiles: a tile the GPU cannot hold
            raise emitted.resource_error(err) from None

    def load(self, emitted: EmittedKernel, target: str) -> Any:
        """The kernel's function for `target` (`cache.load`: compiled in memory once)."""
        return load(emitted.source, emitted.fn_name, target, emitted.ir())


def _scratch(size: int, alignment: int, stream: Any) -> Any:
    """Global scratch memory for a kernel launch (TMA descriptors built on the device)."""
    return _torch.empty(size, dtype=_torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for device-side scratch memory, unless the caller set one
    (Triton keeps it per thread and context). On the call path: the lookup is done once."""
    if not _ALLOCATOR:
        try:
            from triton.runtime._allocation import NullAllocator, _allocator

            _ALLOCATOR.append((_allocator, NullAllocator))
        except ImportError:  # a Triton without that module: always set ours
            _ALLOCATOR.append(None)
    found = _ALLOCATOR[0]
    if found is None or isinstance(found[0].get(), found[1]):
        import triton

        triton.set_allocator(_scratch)


_ALLOCATOR: list[Any] = []  # (Triton's allocator context variable, its null allocator class)


def output_allocation(shape: tuple[int, ...], dtype, order: tuple[int, ...] | None,
                      zeroed: bool = False) -> tuple:
    """(memory shape, dtype, the permutation viewing it in the result's order or None, the
    allocating function) of a kernel output: contiguous, or stored in the axis `order` its
    kernel records; filled with zeros where the kernel adds into it."""
    alloc = _zeros if zeroed else _empty
    if order is None:
        return shape, dtype, None, alloc
    inverse = tuple(order.index(a) for a in range(len(order)))
    return tuple(shape[a] for a in order), dtype, inverse, alloc


def runs(cfg: LaunchConfig) -> bool:
    """Whether a launch configuration has programs: a launch that follows another (a
    combine) is skipped at sizes where its kernel did not split, its grid empty."""
    return all(n > 0 for n in cfg.grid)


def workspace_allocation(emitted: EmittedKernel, dims: Mapping[str, int], target: str) -> tuple[tuple, ...]:
    """The scratch memory a kernel asks for at these sizes, allocated after its results (one
    element where it needs none: a pointer must point somewhere)."""
    if emitted.workspace is None:
        return ()
    return tuple(((max(1, n),), getattr(_torch, dtype), None, _empty)
                 for n, dtype in emitted.workspace(dims, target))


def allocate(output: tuple, device):
    shape, dtype, view, alloc = output
    out = alloc(shape, dtype=dtype, device=device)
    return out if view is None else out.permute(view)


def storage_dtype(t):
    """How a kernel result is stored: in its dtype, except weak floats, which are f64
    (the Python float they stand for)."""
    import torch

    return torch.float64 if t.weak and t.dtype.is_float else torch_dtype(t.dtype)


def _arguments(emitted: EmittedKernel, args: list) -> tuple[Argument, ...]:
    return tuple(Argument(name, "constexpr", value=value) if isinstance(spec, FLAGS)
                 else specialize(name, value)
                 for (name, spec), value in zip(emitted.params, args, strict=True))
