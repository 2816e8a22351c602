"""`tiledsl.compile()` and the compiled program it returns.

    fn = tiledsl.compile(source_or_path, kernel=None, backend="triton")
    out = fn(q, k, v, scale=0.125)
    fn.kernels, fn.graph, fn.ir(stage), fn.explain(), fn.to_dot()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch.autograd import forward_ad

from tiledsl import ast, autodiff, generic, logs, torch_op
from tiledsl import diagnostics as diag
from tiledsl.backends.interface import BACKENDS, Backend, Kernel, make_backend
from tiledsl.binding import BoundCall, bind
from tiledsl.files import load_source, read_program  # noqa: F401 - api.read_program stays
from tiledsl.ir import Graph, KernelOp
from tiledsl.parser import parse
from tiledsl.passes.lower_kernels import LowerKernels
from tiledsl.passes.manager import PassManager, PipelineResult
from tiledsl.passes.pipeline import DEFAULT_PIPELINE, NORMALIZING
from tiledsl.passes.registry import PassContext
from tiledsl.printer import print_graph
from tiledsl.sema import analyze, select_kernel
from tiledsl.source import Span


def check_option(where: str, name: str, value: Any, expected: str, *types: type) -> None:
    """An `OptionError` unless `value` is one of `types` (bool is not an int here)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise diag.OptionError(message=(
            f"{where}: '{name}' must be {expected}, got {type(value).__name__}"))


def compile(  # noqa: A001 - the public name is part of the design
    source: str | os.PathLike,
    kernel: str | None = None,
    backend: str = "triton",
    *,
    pipeline: str | None = None,
    allow_tf32: bool = False,
    verify: bool | None = None,
    check_bounds: bool = False,
) -> Program:
    """Compile one kernel of a tiledsl program.

    `pipeline` replaces the default pass pipeline (`DEFAULT_PIPELINE`: clean-up,
    online softmax, the fusion passes, lower-kernels); `lower-kernels` is
    appended when missing, since backends run kernels. `allow_tf32` lets fp32
    matmuls use tf32 on GPUs. `verify` checks the IR after every pass (default:
    the TILEDSL_VERIFY env var). `check_bounds` makes every call check the indices the
    program gives (`x[i]`, `gather`) and raise a located error naming the indexed tensor
    when one is out of range (without it such a read gives 0); the check costs extra
    kernels and a device sync per call.
    """
    text, name = load_source(source)
    return compile_text(text, name, kernel, backend, pipeline=pipeline, allow_tf32=allow_tf32,
                        verify=verify, check_bounds=check_bounds)


def compile_text(text: str, name: str, kernel: str | None = None, backend: str = "triton", *,
                 pipeline: str | None = None, allow_tf32: bool = False,
                 verify: bool | None = None, check_bounds: bool = False) -> Program:
    """`compile` of program text, reporting diagnostics under `name`."""
    check_option("compile()", "kernel", kernel, "a kernel name (str) or None", str, type(None))
    check_option("compile()", "backend", backend, "a str", str)
    check_option("compile()", "pipeline", pipeline, "a comma-separated str of pass names or None",
                 str, type(None))
    check_option("compile()", "allow_tf32", allow_tf32, "a bool", bool)
    check_option("compile()", "verify", verify, "a bool or None", bool, type(None))
    check_option("compile()", "check_bounds", check_bounds, "a bool", bool)
    if backend not in BACKENDS:
        raise diag.OptionError(message=(
            f"unknown backend '{backend}'{diag.did_you_mean(backend, BACKENDS)} "
            f"(backends: {', '.join(BACKENDS)})"))
    program = parse(text, name)
    selected = select_kernel(program, kernel)
    origin = Origin(text, name, selected.name, (
        ("backend", backend), ("pipeline", pipeline), ("allow_tf32", allow_tf32), ("verify", verify),
        ("check_bounds", check_bounds)))
    if generic.is_generic(selected):
        generic.check(selected)
        return Generic(selected, origin)
    return _compile_kernel(selected, origin)


def _compile_kernel(kernel: ast.Kernel, origin: Origin) -> Program:
    """The program of one (concrete) kernel, compiled with `origin`'s options."""
    options = dict(origin.options)
    graph = analyze(kernel, options["check_bounds"])
    compiled = compile_graph(graph, options["backend"], pipeline=options["pipeline"],
                             allow_tf32=options["allow_tf32"], verify=options["verify"],
                             what=f"kernel '{kernel.name}'", span=kernel.name_span)
    compiled._origin = origin
    return compiled


def compile_graph(graph: Graph, backend: str = "triton", *, pipeline: str | None = None,
                  allow_tf32: bool = False, verify: bool | None = None, what: str = "",
                  span: Span | None = None) -> Program:
    """Run the pass pipeline on a graph IR (from sema, or derived by `tiledsl.autodiff`) and
    wrap the result as a `Program`."""
    manager = PassManager(pipeline or DEFAULT_PIPELINE, verify=verify)
    if not manager.passes or manager.passes[-1].name != LowerKernels.name:
        manager = PassManager(manager.pipeline + f",{LowerKernels.name}" if manager.passes
                              else LowerKernels.name, verify=verify)
    try:
        result = manager.run(graph, PassContext())
        program = Program(result, backend, manager.pipeline, allow_tf32)
        log = logs.logger("fusion")
        if log.isEnabledFor(logging.INFO):
            log.info("%s", program.explain())
        return program
    except diag.TileDSLError:
        raise
    except Exception as err:  # a compiler bug: report it at the kernel, keep the cause
        raise diag.InternalError(span or graph.span, message=(
            f"{type(err).__name__}: {err} (while compiling {what or graph.name}; "
            "this is a tiledsl bug, please report it)")) from err


def normalized(graph: Graph) -> Graph:
    """`graph` after the `NORMALIZING` passes (`passes.pipeline`; a copy): what autodiff
    derives a backward from (`Program.normalized_graph`, `tiledsl opt --backward`)."""
    from tiledsl.passes.manager import PassManager
    from tiledsl.passes.registry import parse_pipeline

    return PassManager(parse_pipeline(",".join(NORMALIZING)), snapshots=False).run(graph.copy()).graph


# the Python types the op's schema takes for a scalar parameter as they are
_SCHEMA_SCALARS = {"float": (float, int), "int": (int,), "bool": (bool,)}
_training_lock = threading.RLock()  # held while a first backward is derived and compiled


def _reset_after_fork() -> None:
    """A forked child has only the forking thread: a lock another thread held is held forever."""
    global _training_lock
    _training_lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_after_fork)


@dataclass(frozen=True)
class Origin:
    """What compiled a program, which is what it pickles as: program text, its display name,
    the kernel and the options of `compile_text`; or, for a derived program, the program it
    was derived from, the parameters differentiated and its role ("forward", "backward")."""

    text: str = ""
    name: str = ""
    kernel: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    derived: tuple[Program, tuple[int, ...], str] | None = None
    binding: generic.Binding | None = None  # a generic kernel's specialization


def _recompile(origin: Origin) -> Program | Generic:
    """The program `origin` describes, compiled again (how a pickled program loads)."""
    if origin.derived is None:
        compiled = compile_text(origin.text, origin.name, origin.kernel, **dict(origin.options))
        return compiled.bound(origin.binding) if origin.binding is not None else compiled
    parent, wrt, role = origin.derived
    return getattr(parent.training(wrt), role)


class Program:
    """A compiled kernel: call it with torch tensors, or inspect every stage. It pickles as
    its source text, kernel name and options (`Origin`) and compiles again when loaded
    (its kernels from the cache)."""

    def __init__(self, result: PipelineResult, backend: str, pipeline: str,
                 allow_tf32: bool = False) -> None:
        self._result = result
        self._graph: Graph = result.graph
        self.name = self._graph.name
        self.backend = backend
        self.pipeline = pipeline
        self.allow_tf32 = allow_tf32
        self.runtime: Backend = make_backend(backend, self._graph, allow_tf32)
        self.kernels: list[Kernel] = self.runtime.kernels
        self._trainings: dict[tuple[int, ...], Training] = {}
        params = [self.source_graph.op(p) for p in self.source_graph.params]
        self._differentiable = tuple(autodiff.differentiable(p) for p in params)
        self._names = tuple(p.attr("name") for p in params)
        self._scalars = tuple(i for i, p in enumerate(params) if p.attr("scalar"))
        # registered now, not on first use: torch.compile traces calls of fn and cannot
        # trace a registration (about 1 ms per program)
        self._origin: Origin | None = None  # what compiled it, for pickling
        self.op = torch_op.register(self)
        """This program as a PyTorch operator (`torch.ops.tiledsl.<kernel>_<hash>.default`):
        traceable by torch.compile and torch.export, differentiable (see `backward`). Past 64
        parameters it takes them packed in lists by kind (`torch_op.Convention`)."""
        self._convention = torch_op.Convention.of(self.source_graph)

    def __reduce__(self) -> tuple:
        if self._origin is None:
            raise diag.OptionError(message=(
                f"'{self.name}' was compiled from a graph IR, not program text, and cannot be "
                "pickled: pickle its source text and compile it again"))
        return _recompile, (self._origin,)

    # --- running --------------------------------------------------------------------------

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Run the program. A call that autograd or a tracer must see (an input requires a
        gradient, or torch.compile / torch.export is tracing) goes through `fn.op`; any
        other call runs the op's kernel directly, without the dispatcher's overhead."""
        if _through_op(args, kwargs):
            return self.call_op(self._positional(args, kwargs))
        if forward_ad._current_level >= 0:  # a dual tensor's tangent would be dropped
            torch_op.refuse_forward_mode(self, (*args, *kwargs.values()))
        runtime = self.runtime
        bound = runtime.binder(args, kwargs)
        outs = self._returned(runtime.run(bound), bound.dims)
        return _unshared(outs, set()) if isinstance(outs, tuple) else outs

    def call_op(self, args: Sequence[Any]) -> Any:
        """`self.op` called with the program's arguments in parameter order (packed as its
        schema takes them). Under torch.func's transforms a call that needs a gradient runs
        the op's autograd function from here: functorch takes an autograd.Function, but
        not one applied inside a custom op's Autograd kernel."""
        if torch._C._are_functorch_transforms_active():
            torch_op.refuse_forward_mode(self, args)
            wrt = self.wants_grad(args)
            if wrt:
                return torch_op.differentiated(self, wrt, args)
        torch_op.shard_for(args)
        return self.op(*self._convention.pack(args))

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments in parameter order, for the op's schema; an argument the schema
        cannot take (a missing one, a tensor for a scalar, a nested tensor) gets the
        binder's error."""
        if len(args) + len(kwargs) != len(self._names) or (kwargs and (
                set(kwargs) - set(self._names) or any(n in kwargs for n in self._names[:len(args)]))) \
                or any(isinstance(a, torch.Tensor) and a.is_nested for a in (*args, *kwargs.values())):
            self.runtime.binder(args, kwargs)  # raises the error naming the parameter
        args = args + tuple(kwargs[n] for n in self._names[len(args):])
        kinds = self._convention.kinds
        if any(type(args[i]) not in _SCHEMA_SCALARS[kinds[i]] for i in self._scalars):
            # a tensor, a NumPy number, a wrong type: the binder's error, or the Python value
            values = self.runtime.binder(args, {}).values
            args = tuple(values[i] if i in self._scalars else a for i, a in enumerate(args))
        return args

    def resolve(self, args: Sequence[Any]) -> Program:
        """The program these arguments run: this one (a `Generic` picks a specialization)."""
        return self

    def _run_op(self, args: tuple) -> Any:
        """The op's CPU/CUDA kernel: the program's outputs as fresh contiguous tensors that
        share no memory with the inputs (what a torch custom op must return)."""
        bound = self.runtime.binder(args, {})
        outs = self._returned(self.runtime.run(bound), bound.dims)
        taken = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        fresh = _unshared(outs if isinstance(outs, tuple) else (outs,), taken, contiguous=True)
        return fresh if isinstance(outs, tuple) else fresh[0]

    # --- PyTorch: the op, autograd ------------------------------------------------------------

    @property
    def source_graph(self) -> Graph:
        """The graph IR the pipeline started from."""
        return self._result.stages["graph"]

    @property
    def normalized_graph(self) -> Graph:
        """The program after the pipeline's leading rewrites into canonical algebra
        (`NORMALIZING`: a written-out softmax is `softmax`, a matmul of a difference two
        matmuls, a row factor moved past its matmul), before any fusion: the program
        autodiff derives the backward of, so attention written any of those ways takes
        the flash form. The source graph when the pipeline starts otherwise."""
        graph = self.source_graph
        for name, stage in self._result.stages.items():
            if name == "graph":
                continue
            if name.split(".")[0] not in NORMALIZING:
                break
            graph = stage
        return graph

    @property
    def differentiable(self) -> tuple[int, ...]:
        """Indices of the parameters that can have a gradient (floating-point tensors)."""
        return tuple(i for i, ok in enumerate(self._differentiable) if ok)

    def wants_grad(self, args: Sequence[Any]) -> tuple[int, ...]:
        """The parameters whose arguments need a gradient in this call (grad mode on, a
        floating-point tensor that requires grad)."""
        if not torch.is_grad_enabled():
            return ()
        return tuple(i for i, (ok, a) in enumerate(zip(self._differentiable, args, strict=False))
                     if ok and isinstance(a, torch.Tensor) and a.requires_grad)

    def training(self, wrt: tuple[int, ...]) -> Training:
        """The training forward and backward programs for gradients of parameters `wrt`,
        derived once (threads taking a first backward at once wait for one derivation)."""
        training = self._trainings.get(wrt)
        if training is not None:
            return training
        with _training_lock:
            if wrt not in self._trainings:
                self._trainings[wrt] = self._derive(wrt)
        return self._trainings[wrt]

    def _derive(self, wrt: tuple[int, ...]) -> Training:
        d = autodiff.derive(self.normalized_graph, wrt)
        options = {"backend": self.backend, "pipeline": self.pipeline, "allow_tf32": self.allow_tf32}
        forward = self if not d.saved else compile_graph(d.forward, **options)
        backward = compile_graph(d.backward, **options)
        for role, program in (("forward", forward), ("backward", backward)):
            if program is not self:
                program._origin = Origin(derived=(self, wrt, role))
        return Training(d, forward, backward)

    @property
    def backward(self) -> Program:
        """The backward program for the gradients of every floating-point tensor
        parameter: parameters (the forward's, what it saved, one gradient per output),
        returns (one gradient per differentiable parameter). Inspect it like any program."""
        wrt = self.differentiable
        if not wrt:
            raise diag.GradientError(self.source_graph.span, message=(
                f"'{self.name}' has no floating-point tensor parameter to differentiate"))
        return self.training(wrt).backward

    def _returned(self, outs: list[Any], dims: Mapping[str, int]) -> Any:
        """The program's results; with check_bounds, the index checks' counts are read (a
        device sync) and one above 0 raises at the indexing it counts."""
        checks = self._graph.checks
        if checks:
            from tiledsl.dims import evaluate

            outs, counts = outs[:-len(checks)], outs[-len(checks):]
            for count, (span, name, axis, size) in zip(counts, checks, strict=True):
                bad = int(count)
                if bad:
                    n = evaluate(size, dims)
                    raise diag.IndexingError(span, message=(
                        f"index out of range: {bad} index value{'s' if bad > 1 else ''} for axis "
                        f"{axis} of {name} (size {size}{'' if size == n else f' = {n}'} at this "
                        f"call) {'are' if bad > 1 else 'is'} outside [-{n}, {n})"))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def cuda_graph(self, /, *args: Any, **kwargs: Any) -> CapturedCall:
        """Capture one call on CUDA tensors in a CUDA graph; replaying it launches every
        kernel with no Python and no launch gaps (static shapes). See `CapturedCall`."""
        runtime = self.runtime
        bound = runtime.binder(args, kwargs)
        if self._graph.checks:
            raise diag.OptionError(message=(
                "cuda_graph() cannot capture a program compiled with check_bounds=True: its "
                "checks read their results on the host after every call"))
        if bound.device is None or bound.device.type != "cuda":
            raise diag.OptionError(message=(
                "cuda_graph() captures a call on CUDA tensors; these arguments are on "
                f"{bound.device or 'no device (scalars only)'}"))
        return CapturedCall(runtime, bound)

    @property
    def launches(self) -> list[Any]:
        """The launches made so far, one per kernel and size class (argument types and
        sizes): what `backends.triton.aot.compile_launch` compiles ahead of time."""
        return self.runtime.launches

    def reference(self, /, *args: Any, float64: bool = False, **kwargs: Any) -> Any:
        """The same program run op by op in torch (float64=True: the golden result)."""
        from tiledsl.backends import reference

        check_option("reference()", "float64", float64, "a bool", bool)
        bound = bind(self._graph, args, kwargs)
        outs = reference.run(self._result.stages["graph"], bound, float64=float64)
        return self._returned(outs, bound.dims)

    # --- inspection -----------------------------------------------------------------------

    @property
    def graph(self) -> nx.DiGraph:
        """The fused graph (a networkx MultiDiGraph; node attribute "op")."""
        return self._graph.nx

    @property
    def stages(self) -> list[str]:
        return list(self._result.stages) + ["fused"]

    def ir(self, stage: str = "fused", locations: bool = False) -> str:
        """The IR text after a stage: "graph", a pass name, or "fused"."""
        check_option("ir()", "stage", stage, "a stage name (str)", str)
        check_option("ir()", "locations", locations, "a bool", bool)
        stages = self._result.stages
        if stage == "fused":
            return print_graph(self._graph, locations)
        if stage not in stages:
            raise diag.OptionError(message=(
                f"no IR stage '{stage}'{diag.did_you_mean(stage, self.stages)} "
                f"(stages: {', '.join(self.stages)})"))
        return print_graph(stages[stage], locations)

    @property
    def pass_timings(self) -> list[tuple[str, float]]:
        return list(self._result.timings)

    @property
    def remarks(self) -> list[Any]:
        return list(self._result.context.remarks)

    def explain(self, dims: Mapping[str, int] | None = None) -> str:
        """The fusion report; with `dims`, traffic in bytes at those sizes."""
        from tiledsl.explain import explain

        return explain(self, None if dims is None else self._explain_dims(dims))

    def _explain_dims(self, dims: Any) -> dict[str, int]:
        check_option("explain()", "dims", dims, "a mapping of dim names to sizes", Mapping)
        symbols = sorted({d for p in self._graph.params for d in self._graph.op(p).type.shape
                          if isinstance(d, str)})
        out = {}
        for name, size in dims.items():
            if name not in symbols:
                raise diag.OptionError(message=(
                    f"explain(): '{name}' is not a dim of '{self.name}'"
                    f"{diag.did_you_mean(str(name), symbols)} (dims: {', '.join(symbols) or 'none'})"))
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise diag.OptionError(message=(
                    f"explain(): dim {name} must be a positive int, got {repr(size)[:40]}"))
            out[name] = size
        missing = [d for d in symbols if d not in out]
        if missing:
            raise diag.OptionError(message=(
                f"explain(): dims= needs a size for every dim of '{self.name}'; missing "
                f"{', '.join(missing)}"))
        return out

    def to_dot(self) -> str:
        from tiledsl.dot import to_dot

        return to_dot(self._graph)

    def _repr_svg_(self) -> str | None:
        """A notebook shows the fusion graph: an SVG where Graphviz is installed, else (None)
        the text of `_repr_pretty_`."""
        import shutil

        exe = shutil.which("dot")
        result = self._graphviz(exe, ["-Tsvg"]) if exe else None
        return result.stdout if result is not None and result.returncode == 0 else None

    def _graphviz(self, exe: str, options: list[str]) -> Any:
        """Graphviz's `exe` run on the fusion graph's DOT text (a CompletedProcess)."""
        import subprocess

        return subprocess.run([exe, *options], input=self.to_dot(), text=True, capture_output=True)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if cycle else self.explain())

    def __repr__(self) -> str:
        return f"<tiledsl program '{self.name}': {len(self.kernels)} kernel(s)>"

    def draw(self, path: str | os.PathLike, dot_binary: str = "dot") -> Path:
        """Render the fusion graph with Graphviz; the format follows the suffix (.svg, .png, .pdf)."""
        import shutil

        check_option("draw()", "path", path, "a path", str, os.PathLike)
        out = Path(path)
        exe = shutil.which(dot_binary)
        if exe is None:
            raise diag.OptionError(message=(
                f"drawing needs Graphviz's '{dot_binary}' program, which is not installed "
                "(Debian/Ubuntu: apt install graphviz; macOS: brew install graphviz; conda: conda "
                "install graphviz); fn.to_dot() gives the DOT text without it"))
        fmt = out.suffix.lstrip(".") or "svg"
        result = self._graphviz(exe, [f"-T{fmt}", "-o", str(out)])
        if result.returncode != 0:
            raise diag.OptionError(message=f"Graphviz could not draw {out}: {result.stderr.strip()}")
        return out

    def fused_graph(self) -> Graph:
        return self._graph

    def kernel_ops(self) -> Sequence[KernelOp]:
        return [self._graph.op(n) for n in self._graph.kernels()]


class Generic:
    """A generic kernel (`tiledsl.generic`: dtype variables, `...` batch dims), called like a
    `Program`. Each binding of its variables, which a call's arguments give, is compiled on
    first use and cached, as sizes are; the specialization is a whole `Program` (explain, IR,
    autograd, its torch op), reached with `for_args` or `specialize`. It pickles as its
    source, as a program does."""

    def __init__(self, kernel: ast.Kernel, origin: Origin) -> None:
        self.kernel = kernel
        self.name = kernel.name
        self._origin = origin
        self._programs: dict[generic.Binding, Program] = {}
        self._lock = threading.Lock()
        self._names = tuple(p.name for p in kernel.params)
        self._fixed = generic.fixed_dims(kernel)  # the parameters with `...`, for broadcasting
        self._convention = torch_op.Convention.of_kernel(kernel)
        self.op = torch_op.register(self)
        """This kernel as one PyTorch operator for all its bindings (dtype and rank generic
        in its schema): each call runs the specialization its arguments bind."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Run the specialization the arguments bind; a call that autograd or a tracer must
        see goes through `fn.op` (torch.compile then compiles a binding in the op's fake
        kernel, never in the traced code). Leading dims of size 1 broadcast (`generic.broadcast`)."""
        if len(self._fixed) > 1:
            args, kwargs = generic.broadcast(self._names, self._fixed, args, kwargs)
        if _through_op(args, kwargs) and not torch._C._are_functorch_transforms_active():
            positional = self._positional(args, kwargs)
            torch_op.shard_for(positional)
            return self.op(*self._convention.pack(positional))
        return self.for_args(*args, **kwargs)(*args, **kwargs)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments in parameter order, for the op's schema; an argument list the
        schema cannot take gets the specialization's error (or its conversion)."""
        names, kinds = self._names, self._convention.kinds
        if len(args) + len(kwargs) == len(names) and set(kwargs) == set(names[len(args):]):
            args = args + tuple(kwargs[n] for n in names[len(args):])
            if all(type(a) in _SCHEMA_SCALARS[k] for a, k in zip(args, kinds, strict=True) if k != "Tensor"):
                return args
            kwargs = {}
        return self.for_args(*args, **kwargs)._positional(args, kwargs)

    def resolve(self, args: Sequence[Any]) -> Program:
        """The specialization these arguments (in parameter order) run."""
        return self.for_args(*args)

    def for_args(self, /, *args: Any, **kwargs: Any) -> Program:
        """The specialization these arguments call."""
        return self.bound(generic.bind(self.kernel, args, kwargs))

    def specialize(self, batch: int = 0, **dtypes: str) -> Program:
        """The specialization of a binding given by hand: each dtype variable's dtype, and
        the leading dims `...` stands for in every parameter (`fn.specialize(T="bf16",
        batch=2)`)."""
        check_option("specialize()", "batch", batch, "an int", int)
        return self.bound(generic.given(self.kernel, batch, dtypes, "specialize()"))

    def bound(self, binding: generic.Binding) -> Program:
        """The program of `binding`, compiled on first use."""
        with self._lock:
            fn = self._programs.get(binding)
            if fn is None:
                fn = _compile_kernel(generic.specialize(self.kernel, binding),
                                     dataclasses.replace(self._origin, binding=binding))
                self._programs[binding] = fn
            return fn

    @property
    def bindings(self) -> tuple[generic.Binding, ...]:
        """The bindings compiled so far."""
        return tuple(self._programs)

    def __reduce__(self) -> tuple:
        return _recompile, (self._origin,)

    def __repr__(self) -> str:
        return f"<tiledsl generic kernel '{self.name}' {generic.signature(self.kernel)}>"

    def __getattr__(self, attr: str) -> Any:
        if not attr.startswith("_") and hasattr(Program, attr):  # a program's, without a binding
            raise diag.OptionError(message=(
                f"kernel '{self.name}' is generic ({generic.signature(self.kernel)}): {attr} belongs "
                "to a specialization, fn.specialize(T=..., batch=...) or fn.for_args(<arguments>)"))
        raise AttributeError(f"'Generic' object has no attribute '{attr}'")


@dataclass(frozen=True)
class Training:
    """What a differentiated call runs: `forward` (the program returning its outputs and the
    values its backward saves) and `backward`, as `derivation` connects them."""

    derivation: autodiff.Derivation
    forward: Program
    backward: Program


def _unshared(outs: tuple, taken: set[int], contiguous: bool = False) -> tuple:
    """`outs` with a copy of each one whose memory an earlier output (or `taken`, the inputs')
    holds: `return y, y` gives two tensors, never one twice."""
    fresh = []
    for o in outs:
        if o.untyped_storage().data_ptr() in taken:
            o = o.clone(memory_format=torch.contiguous_format)
        elif contiguous:
            o = o.contiguous()
        taken.add(o.untyped_storage().data_ptr())
        fresh.append(o)
    return tuple(fresh)


def _through_op(args: tuple, kwargs: dict) -> bool:
    """Must this call go through the dispatcher: is it traced (`traced`), does an input need
    a gradient, or is autocast on for an input's device (the op's Autocast kernel casts the
    arguments: `torch_op.autocast_args`)? On every call: the arguments are walked once, and
    a device's autocast state is asked only when some autocast is on."""
    if _tracing():
        return True
    grad, autocast = torch.is_grad_enabled(), torch._C._is_any_autocast_enabled()
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or (grad and a.requires_grad)
                                            or (autocast and _autocasting(a.device.type))):
            return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what a call's kernels read directly


def traced(args: tuple, kwargs: dict) -> bool:
    """Is a tracer watching this call, so that it must see the op and nothing may branch on
    the values on the host: a tracing state (`_tracing`) or an input that is a tensor
    subclass (FakeTensor, a functional or proxy tensor)?"""
    return _tracing() or any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN
                             for a in (*args, *kwargs.values()))


def _tracing() -> bool:
    """torch.compile/export, a dispatch mode (make_fx's tracer in real mode, a
    FlopCounterMode: it sees plain tensors, and a direct run would show it the kernels' own
    aten calls), torch.func's transforms (vmap's and func.grad's tensors are wrappers the
    kernels cannot read), or torch.jit.trace."""
    return bool(torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
                or torch._C._len_torch_dispatch_stack() or torch._ops._len_torch_dispatch_stack_pre_dispatch()
                or torch._C._get_tracing_state() is not None)


def _autocasting(device_type: str) -> bool:
    """Is torch.autocast on for this device type (the ones the ops' Autocast kernels are
    registered for: `torch_op._register_autocast`)? A meta tensor's is not asked about:
    torch raises for a device autocast does not know."""
    return device_type in torch_op.AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


class CapturedCall:
    """A call captured in a CUDA graph (`Program.cuda_graph`).

    The capture owns static copies of the tensor arguments and the outputs.
    Calling it with new tensors of the captured shapes, dtypes and device
    copies them into the static inputs and replays the graph; it returns the
    static outputs, which the next replay overwrites (clone them to keep
    them). Scalars and sizes are part of the capture: a call with others is
    an error. A replay allocates nothing: outputs and the kernels' arguments
    were fixed when the graph was captured.
    """

    def __init__(self, runtime: Backend, bound: Any) -> None:
        import torch

        self.runtime = runtime
        self.dims = dict(bound.dims)
        self.inputs = [v.clone() if isinstance(v, torch.Tensor) else v for v in bound.values]
        static = BoundCall(self.inputs, self.dims, bound.device)
        runtime.run(static)  # builds the launch plan (compiles, autotunes) outside the capture
        side = torch.cuda.Stream(bound.device)
        side.wait_stream(torch.cuda.current_stream(bound.device))
        with torch.cuda.stream(side):
            runtime.run(static)  # warm up on a side stream, as torch.cuda.graph asks
        torch.cuda.current_stream(bound.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outs = runtime.run(static)
        self.outputs = outs[0] if len(outs) == 1 else tuple(outs)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        bound = self.runtime.binder(args, kwargs)
        if bound.dims != self.dims:
            raise diag.ArgumentError(self.runtime.graph.span, message=(
                f"a captured call replays at the sizes it was captured with "
                f"({_sizes(self.dims)}), got {_sizes(bound.dims)}; capture again for new sizes"))
        for i, (value, static) in enumerate(zip(bound.values, self.inputs, strict=True)):
            if hasattr(static, "copy_"):  # a tensor argument
                if value.device != static.device:
                    raise diag.ArgumentError(self.runtime.graph.span, message=(
                        f"a captured call replays on {static.device}, got a tensor on {value.device}"))
                static.copy_(value)
            elif value != static and not (value != value and static != static):  # NaN is NaN
                name = self.runtime.graph.op(self.runtime.graph.params[i]).attr("name")
                raise diag.ArgumentError(self.runtime.graph.span, message=(
                    f"scalar '{name}' was captured as {static!r}; a replay cannot change it to "
                    f"{value!r} (declare it a tensor parameter, e.g. f32[1], to vary it, or capture again)"))
        self.graph.replay()
        return self.outputs


def _sizes(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))
