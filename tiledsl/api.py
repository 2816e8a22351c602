"""`tiledsl.compile()` and the compiled program it returns.

    fn = tiledsl.compile(source_or_path, kernel=None, backend="triton")
    out = fn(q, k, v, scale=0.125)
    fn.kernels, fn.graph, fn.ir(stage), fn.explain(), fn.to_dot()
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

from tiledsl import diagnostics as diag
from tiledsl.backends.interface import BACKENDS, Backend, Kernel, make_backend
from tiledsl.binding import BoundCall, bind
from tiledsl.ir import Graph, KernelOp
from tiledsl.parser import parse
from tiledsl.passes.manager import PassManager, PipelineResult
from tiledsl.passes.registry import PassContext
from tiledsl.printer import print_graph
from tiledsl.sema import analyze, select_kernel

DEFAULT_PIPELINE = ("canonicalize,sink-reshape,cse,dce,online-softmax,distribute-matmul,hoist-row-scale,"
                    "recompute,fuse-attention,fuse-epilogue,fuse-rows,fuse-elementwise,fuse-horizontal,"
                    "lower-kernels")


def check_option(where: str, name: str, value: Any, expected: str, *types: type) -> None:
    """An `OptionError` unless `value` is one of `types` (bool is not an int here)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise diag.OptionError(message=(
            f"{where}: '{name}' must be {expected}, got {type(value).__name__}"))


def load_source(source: str | os.PathLike) -> tuple[str, str]:
    """(text, display name) of program text or a path to a .tdsl file."""
    check_option("compile()", "source", source, "program text or a path", str, os.PathLike)
    if isinstance(source, os.PathLike) or (
        "\n" not in source and "{" not in source
        and (source.endswith(".tdsl") or os.path.isfile(source))
    ):
        return read_program(Path(source))
    return source, "<string>"


def read_program(path: Path) -> tuple[str, str]:
    """(text, display name) of a program file, or an `OptionError` saying why not."""
    shown = str(path)  # messages escape control characters themselves
    try:
        data = path.read_bytes()
    except OSError as err:
        raise diag.OptionError(message=f"cannot read {shown}: {err.strerror}") from None
    except (ValueError, UnicodeError):  # a NUL byte or an unencodable character in the path
        raise diag.OptionError(message=f"cannot read {shown}: not a valid file name") from None
    try:
        return data.decode("utf-8"), str(path)
    except UnicodeDecodeError as err:
        raise diag.OptionError(message=(
            f"cannot read {shown}: it is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
            f"{err.start})")) from None


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
    graph = analyze(selected, check_bounds)
    manager = PassManager(pipeline or DEFAULT_PIPELINE, verify=verify)
    if not manager.passes or manager.passes[-1].name != "lower-kernels":
        manager = PassManager(manager.pipeline + ",lower-kernels" if manager.passes
                              else "lower-kernels", verify=verify)
    try:
        result = manager.run(graph, PassContext())
        return Program(result, backend, manager.pipeline, allow_tf32)
    except diag.TileDSLError:
        raise
    except Exception as err:  # a compiler bug: report it at the kernel, keep the cause
        raise diag.InternalError(selected.name_span, message=(
            f"{type(err).__name__}: {err} (while compiling kernel '{selected.name}'; "
            "this is a tiledsl bug, please report it)")) from err


class Program:
    """A compiled kernel: call it with torch tensors, or inspect every stage."""

    def __init__(self, result: PipelineResult, backend: str, pipeline: str,
                 allow_tf32: bool = False) -> None:
        self._result = result
        self._graph: Graph = result.graph
        self.name = self._graph.name
        self.backend = backend
        self.pipeline = pipeline
        self.runtime: Backend = make_backend(backend, self._graph, allow_tf32)
        self.kernels: list[Kernel] = self.runtime.kernels

    # --- running --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runtime = self.runtime
        bound = runtime.binder(args, kwargs)
        return self._returned(runtime.run(bound), bound.dims)

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

    def cuda_graph(self, *args: Any, **kwargs: Any) -> CapturedCall:
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

    def reference(self, *args: Any, float64: bool = False, **kwargs: Any) -> Any:
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

    def draw(self, path: str | os.PathLike, dot_binary: str = "dot") -> Path:
        """Render the fusion graph with Graphviz; the format follows the suffix (.svg, .png, .pdf)."""
        import shutil
        import subprocess

        check_option("draw()", "path", path, "a path", str, os.PathLike)
        out = Path(path)
        exe = shutil.which(dot_binary)
        if exe is None:
            raise diag.OptionError(message=(
                f"drawing needs Graphviz's '{dot_binary}' program, which is not installed "
                "(Debian/Ubuntu: apt install graphviz; macOS: brew install graphviz; conda: conda "
                "install graphviz); fn.to_dot() gives the DOT text without it"))
        fmt = out.suffix.lstrip(".") or "svg"
        result = subprocess.run([exe, f"-T{fmt}", "-o", str(out)], input=self.to_dot(), text=True,
                                capture_output=True)
        if result.returncode != 0:
            raise diag.OptionError(message=f"Graphviz could not draw {out}: {result.stderr.strip()}")
        return out

    def fused_graph(self) -> Graph:
        return self._graph

    def kernel_ops(self) -> Sequence[KernelOp]:
        return [self._graph.op(n) for n in self._graph.kernels()]


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
