"""Launch plans: everything about a call that its sizes decide, computed once.

A `LaunchPlan` belongs to one (target, device, dim sizes) class of calls. For
each kernel it holds the loaded function, the grid and launch options
(autotuned on a GPU), the shapes and dtypes of the outputs to allocate, and
an argument function that turns the call's values into the kernel's
arguments: tensors and their strides (a transposed view is read as its
source tensor through permuted strides), by-value scalars, and constants for
everything the sizes fix (dims, element counts, the strides of the fresh
contiguous outputs). A call then costs a dict lookup, the output
allocations, one argument function and one Triton launch per kernel: no IR
printing, hashing or configuration on the call path.

Argument functions are generated Python (compiler-owned names and integers
only), because a flat tuple expression is several times cheaper than
interpreting a list of argument specs on every call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiledsl.diagnostics import ArgumentError
from tiledsl.dims import evaluate
from tiledsl.plans import ScatterPlan
from tiledsl.types import DType

from .base import EmittedKernel, LaunchConfig
from .codegen import DimSize, Numel, Ptr, RowsFlat, Scalar, Stride, TmaReady, Wide, Workspace

# a slot of the call's values read by a kernel: (slot, permutation of a transposed view)
Read = tuple[int, "tuple[int, ...] | None"]

POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32",
                 "int8": "*i8", "uint8": "*u8", "int16": "*i16",
                 "bool": "*u1", "float64": "*fp64", "int64": "*i64", "float8_e4m3fn": "*fp8e4nv",
                 "float8_e5m2": "*fp8e5"}


@dataclass(frozen=True, slots=True)
class Argument:
    """A kernel argument as Triton's launcher specializes it. `type` is its Triton type, or
    "constexpr" for an integer equal to 1, which the launcher compiles in as a constant;
    `aligned` marks a pointer to 16-byte-aligned data or an integer divisible by 16, which
    the launcher tells the compiler (`tt.divisibility = 16`). A constexpr parameter of the
    kernel passed positionally (a `TmaReady` flag) is "constexpr" with its value."""

    name: str
    type: str
    aligned: bool = False
    value: Any = None  # the constant a "constexpr" argument is compiled with


def specialize(name: str, value: Any) -> Argument:
    """How Triton's launcher (`JITFunction.run`) specializes `value` (tests/test_aot.py checks
    this against Triton's own specializer)."""
    if hasattr(value, "data_ptr"):
        return Argument(name, POINTER_TYPES[str(value.dtype).removeprefix("torch.")],
                        value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return Argument(name, "u1")
    if isinstance(value, int):
        if value == 1:
            return Argument(name, "constexpr", value=1)
        kind = "i32" if -(2**31) <= value < 2**31 else ("i64" if value < 2**63 else "u64")
        return Argument(name, kind, value % 16 == 0)
    return Argument(name, "fp32")


# int32 offsets are exact below 2^31; a dim must also leave room for the indices of its last
# block (up to 2^16 past it), which a kernel computes before masking them
OFFSET_LIMIT = 2**31
DIM_LIMIT = 2**31 - 2**20


def fits_int32(t: Any) -> bool:
    """Is every element offset of tensor `t`, from its data pointer, below 2^31, so that a
    kernel may compute them in int32? A storage of at most 2^31 elements proves it (the
    call path's case, about 0.2 us); a view into a larger one is measured: offsets are sums
    of index * stride, torch strides are never negative, so the largest is the last
    element's."""
    if t.untyped_storage().nbytes() <= OFFSET_LIMIT * t.itemsize:
        return True
    return t.numel() == 0 or sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) < OFFSET_LIMIT


def wide_at(outputs: Sequence[tuple], dims: Mapping[str, int]) -> bool:
    """Does a kernel need 64-bit offsets whatever its inputs: a fresh output (contiguous,
    offsets up to its element count) too large for int32, or a dim near 2^31?"""
    sizes = (math.prod(shape) for shape, *_ in outputs)
    return any(n > OFFSET_LIMIT for n in sizes) or any(d >= DIM_LIMIT for d in dims.values())


@dataclass(frozen=True, slots=True)
class KernelStep:
    """A kernel of the program: what it reads and the first slot its results fill."""

    emitted: EmittedKernel
    reads: tuple[Read, ...]
    slot: int


@dataclass(frozen=True, slots=True)
class ViewStep:
    """A `slice` or `reshape` view of the program, or a returned `transpose`: the op, its
    source read and its shape (a reshape's error names the source's dims), and the slot it
    fills."""

    source: Read
    op: Any  # the graph's view op
    source_shape: tuple
    slot: int

    def launch(self, dims: Mapping[str, int]) -> KernelLaunch:
        """The view as a plan step: a torch view of the source (no copy unless a reshape
        asked for one), made per call because the source is a new tensor each call; it
        allocates and launches nothing."""
        from tiledsl.ops.structure import python_index, reshape_view

        slot, perm = self.source
        target, op = self.slot, self.op

        def read(values: list) -> Any:
            return values[slot] if perm is None else values[slot].permute(perm)

        if op.kind == "transpose":  # a returned transpose: the result a kernel stored transposed

            def view(values: list) -> None:
                values[target] = read(values)
        elif op.kind == "slice" and _only_new_axes(op.attr("items"), self.source_shape, dims):
            shape = tuple(evaluate(d, dims) for d in op.type.shape)

            def view(values: list) -> None:  # x[:, None]: a view adding size-1 dims, faster
                values[target] = read(values).view(shape)
        elif op.kind == "slice":
            index = python_index(op.attr("items"), dims)

            def view(values: list) -> None:
                values[target] = read(values)[index]
        elif op.attr("copy"):
            shape = tuple(evaluate(d, dims) for d in op.attr("shape"))

            def view(values: list) -> None:
                values[target] = read(values).reshape(shape)
        else:
            shape = tuple(evaluate(d, dims) for d in op.attr("shape"))
            source = self.source_shape

            def fail(message: str) -> ArgumentError:
                return ArgumentError(op.span, message=message)

            def view(values: list) -> None:
                values[target] = reshape_view(read(values), shape, source, fail)
        return KernelLaunch(view, _values, {}, (), target)


def _only_new_axes(items: tuple, source: tuple, dims: Mapping[str, int]) -> bool:
    """Does a slice only add axes (every other item the whole axis, in order)?"""
    axis = 0
    for item in items:
        if item[0] == "at":
            return False
        if item[0] == "range":
            _, start, _, step, length = item
            if step != 1 or evaluate(start, dims) != 0 or \
                    evaluate(length, dims) != evaluate(source[axis], dims):
                return False
            axis += 1
    return True


def _values(values: list, outs: list) -> tuple:
    return (values,)


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One kernel's launch at a plan's sizes."""

    launch: Callable[..., Any]
    args: Callable[[list, list], tuple]
    options: Mapping[str, Any]  # grid, constexprs, warps and stages
    # (memory shape, torch dtype, view permutation or None, torch.empty or torch.zeros)
    outputs: tuple[tuple, ...]  # the results', then any workspace's
    slot: int
    results: int = 0  # how many of the outputs are results (taking slots from `slot` on)
    # the launches of the same kernel that follow, on the same outputs: (launch, args, options)
    then: tuple[tuple[Callable[..., Any], Callable[[list, list], tuple], Mapping[str, Any]], ...] = ()


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    dims: tuple[tuple[int, int], ...]  # (slot, size) of every dim value the graph reads
    kernels: tuple[KernelLaunch, ...]


def argument_function(emitted: EmittedKernel, reads: Sequence[Read], outputs: Sequence[tuple],
                      dims: Mapping[str, int]) -> Callable[[list, list], tuple]:
    """`args(values, outputs)`: the kernel's arguments, in its parameter order. `outputs`:
    each output's allocation (memory shape, dtype, the permutation the kernel sees it
    through or None, the allocator; `program.output_allocation`)."""
    region = emitted.kernel.region
    strides: dict[int, None] = {}
    exprs = []
    for _, spec in emitted.params:
        if isinstance(spec, Ptr):
            exprs.append(f"v[{reads[spec.index][0]}]" if spec.role == "in" else f"o[{spec.index}]")
        elif isinstance(spec, Stride) and spec.role == "in":
            slot, perm = reads[spec.index]
            strides[slot] = None
            exprs.append(f"s{slot}[{spec.dim if perm is None else perm[spec.dim]}]")
        elif isinstance(spec, Stride):  # outputs are fresh: contiguous, or stored transposed
            shape, _, view, _ = outputs[spec.index]
            exprs.append(str(contiguous_strides(shape)[spec.dim if view is None else view[spec.dim]]))
        elif isinstance(spec, DimSize):
            exprs.append(str(evaluate(spec.symbol, dims)))
        elif isinstance(spec, Numel):
            total = 1
            for d in spec.shape:
                total *= evaluate(d, dims)
            exprs.append(str(total))
        elif isinstance(spec, TmaReady) and spec.role == "out":  # fresh and contiguous
            t = emitted.kernel.result_types[spec.index]
            shape, _, view, _ = outputs[spec.index]
            pitches = contiguous_strides(shape)[:-1]
            fits = view is None and all(p * t.dtype.itemsize % 16 == 0 for p in pitches)
            exprs.append(f"(o[{spec.index}].data_ptr() % 16 == 0)" if fits else "False")
        elif isinstance(spec, TmaReady):
            slot, perm = reads[spec.index]
            strides[slot] = None
            t = region.inputs[spec.index].type
            axes = list(range(t.rank)) if perm is None else list(perm)
            if spec.swapped:
                axes[-2:] = axes[-1], axes[-2]
            pitches = "".join(f" and s{slot}[{a}] * {t.dtype.itemsize} % 16 == 0" for a in axes[:-1])
            exprs.append(f"(v[{slot}].data_ptr() % 16 == 0 and s{slot}[{axes[-1]}] == 1{pitches})")
        elif isinstance(spec, RowsFlat) and spec.role == "out":  # fresh: contiguous, or transposed
            shape, _, view, _ = outputs[spec.index]
            st = contiguous_strides(shape)
            axes = spec.axes if view is None else [view[a] for a in spec.axes]
            exprs.append(str(all(st[a] == st[b] * shape[b] for a, b in zip(axes, axes[1:], strict=False))))
        elif isinstance(spec, RowsFlat):
            slot, perm = reads[spec.index]
            strides[slot] = None
            axes = spec.axes if perm is None else [perm[a] for a in spec.axes]
            chain = " and ".join(f"s{slot}[{a}] == s{slot}[{b}] * v[{slot}].shape[{b}]"
                                 for a, b in zip(axes, axes[1:], strict=False))
            exprs.append(f"({chain or 'True'})")
        elif isinstance(spec, Wide):  # per call, from the tensors the kernel reads
            tensors = sorted({reads[p.index][0] for _, p in emitted.params
                              if isinstance(p, Ptr) and p.role == "in"})
            exprs.append("True" if wide_at(outputs, dims) else
                         f"not ({' and '.join(f'fits(v[{t}])' for t in tensors)})" if tensors else "False")
        elif isinstance(spec, Workspace):  # allocated after the results (`workspace_allocation`)
            exprs.append(f"o[{len(emitted.kernel.result_types) + spec.index}]")
        elif isinstance(spec, Scalar):  # bools travel as 0/1 (see Emitter.scalar)
            value = f"v[{reads[spec.index][0]}]"
            exprs.append(f"int({value})" if region.inputs[spec.index].type.dtype is DType.BOOL
                         else value)
    lines = ["def args(v, o):"]
    k_major_slots = {reads[i][0]: reads[i][1] for i in emitted.k_major}
    if k_major_slots:
        lines.append("    v = list(v)")
        for slot, perm in k_major_slots.items():
            axis = -2 if perm is None else perm[-2]
            lines.append(f"    v[{slot}] = k_major(v[{slot}], {axis})")
    lines += [f"    s{slot} = v[{slot}].stride()" for slot in strides]
    plan = emitted.kernel.plan
    for r, i in starts_as(emitted.kernel):  # a result that starts as an input: copied first
        slot, perm = reads[i]
        if perm is None and plan.in_place and plan.in_place[r]:  # or handed over, where contiguous
            lines.append(f"    o[{r}] = v[{slot}] if v[{slot}].is_contiguous() else o[{r}].copy_(v[{slot}])")
        else:
            lines.append(f"    o[{r}].copy_(v[{slot}]{'' if perm is None else f'.permute({perm})'})")
    lines.append(f"    return ({''.join(e + ', ' for e in exprs)})")
    namespace: dict[str, Any] = {"fits": fits_int32, "k_major": k_major}
    exec(compile("\n".join(lines) + "\n", f"<arguments of {emitted.fn_name}>", "exec"), namespace)
    return namespace["args"]


def starts_as(kernel) -> list[tuple[int, int]]:
    """(result, region input) of each result that starts as a copy of an input (a
    `put_into`'s x: `plans.ScatterPlan.starts`), which the argument function makes before
    the launch."""
    if not isinstance(kernel.plan, ScatterPlan):
        return []
    return [(r, i) for r, i in enumerate(kernel.plan.starts) if i is not None]


# devices whose kernels read a B operand through a K-major descriptor (the interpreter gains
# nothing from a copy)
K_MAJOR_DEVICES = ("cuda",)


def k_major(t: Any, axis: int) -> Any:
    """`t` with `axis` (the K dim of a B operand) contiguous: `t` itself where it already is
    (or on the CPU), else a copy laid out so, with the same shape and values, made on every
    call. No copy is kept between calls: a weight changed through `w.data.copy_(new)` or
    `w.data = new` keeps its id and version, so nothing could tell a kept copy stale. A
    caller passes B K-major (`w.t().contiguous().t()`, as torch._scaled_mm asks of its
    second operand) to skip the copy."""
    axis %= t.dim()
    if t.device.type not in (*K_MAJOR_DEVICES, "meta") or t.stride(axis) == 1 or t.shape[axis] == 1:
        return t
    return t.movedim(axis, -1).contiguous().movedim(-1, axis)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def swap_axes(rank: int, axes: tuple[int, int]) -> tuple[int, ...]:
    """The permutation a transpose of two axes applies (view axis i reads source axis p[i])."""
    perm = list(range(rank))
    a, b = axes
    perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


def launcher(fn: Any, target: str) -> Callable[..., Any]:
    """`launch(*args, grid=..., **options)` for a loaded kernel function."""
    if target == "cuda":
        return functools.partial(fn.run, warmup=False)

    def launch_interpreted(*args: Any, grid: tuple, **options: Any) -> Any:
        return fn[grid](*args, **options)

    return launch_interpreted


# compile options fixed whatever Triton's defaults: fused multiply-adds (FFMA), which Triton
# 3.10 turns off by default, are part of the numbers our kernels were measured with
PINNED_OPTIONS = {"enable_fp_fusion": True}


def launch_options(cfg: LaunchConfig, target: str) -> dict[str, Any]:
    options = {"grid": cfg.grid, **cfg.constexprs}
    if target == "cuda":
        options.update(num_warps=cfg.num_warps or 4, num_stages=cfg.num_stages or 3, **PINNED_OPTIONS)
    return options
