"""The `tiledsl` command line, in the manner of mlir-opt.

    tiledsl opt FILE [--passes P] [--print-ir-after-all] [--print-ir-after NAME] [--timing]
    tiledsl triton FILE            the generated Triton source of every kernel
    tiledsl dot FILE               Graphviz DOT of the fusion graph
    tiledsl explain FILE           the fusion report
    tiledsl run FILE --dims M=128,N=64 [--scalar scale=0.125] [--device cpu|cuda]
    tiledsl ptx FILE --dims M=4096,N=4096 [--all] [--arch sm_90] [--json] [--dump DIR]
                                   each kernel compiled for the GPU as it would run there
                                   (no GPU needed): registers, spills, shared memory,
                                   wgmma shapes, TMA copies, its hottest loop's static
                                   profile; --dump writes its TTGIR, PTX and cubin
    tiledsl check FILE             parse and check every kernel in a file
    tiledsl passes                 the registered passes

Every subcommand that reads a program takes `-k/--kernel NAME` for files with
several kernels. Errors print as compiler diagnostics and exit with status 1; so does a
standard output that cannot be written (`tiledsl: write error: ...`), and a reader that
went away (`| head`) ends a command quietly, with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tiledsl import diagnostics as diag
from tiledsl.dims import evaluate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiledsl", description="tiledsl: tile DSL -> fused Triton kernels")
    p.add_argument("-V", "--version", action=_VersionAction, nargs=0,
                   help="print tiledsl's version and those of torch, Triton and Python, and exit")
    sub = p.add_subparsers(dest="command", required=True)

    def program_command(name: str, help_text: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_text)
        s.add_argument("file", help="a .tdsl file ('-' reads standard input)")
        s.add_argument("-k", "--kernel", help="the kernel to compile, when the file has several")
        s.add_argument("--passes", help="the pass pipeline (default: the full fusing pipeline)")
        s.add_argument("--backward", action="store_true",
                       help="the kernel's backward program (gradients of its float tensor parameters)")
        s.add_argument("--bind", metavar="T=DTYPE,...=N",
                       help="a generic kernel's binding: its dtype variables, and the leading dims '...' "
                            "stands for, e.g. T=bf16,...=2")
        return s

    opt = program_command("opt", "run a pass pipeline and print the IR")
    opt.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    opt.add_argument("--print-ir-after", action="append", default=[], metavar="PASS",
                     help="print the IR after this pass (repeatable; 'graph' is the input)")
    opt.add_argument("--locations", action="store_true", help="print DSL locations as loc(line:col)")
    opt.add_argument("--timing", action="store_true", help="print the time each pass took")
    opt.add_argument("--verify", action="store_true", help="verify the IR after every pass")
    opt.add_argument("--remarks", action="store_true",
                     help="print the fusion decisions (made and refused) after the IR")
    opt.add_argument("--no-lower", action="store_true",
                     help="stop at the graph IR: do not append lower-kernels to the pipeline")

    program_command("triton", "print the generated Triton source")
    program_command("dot", "print Graphviz DOT of the fusion graph")
    program_command("explain", "print the fusion report")
    run = program_command("run", "run a kernel on random inputs and check it against torch")
    run.add_argument("--dims", default="", help="sizes of the dim symbols, e.g. M=128,N=64")
    run.add_argument("--scalar", action="append", default=[], metavar="NAME=VALUE",
                     help="the value of a scalar parameter (default: random)")
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    run.add_argument("--backend", default="triton", choices=("triton", "reference"))
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--repeat", type=int, default=3, help="timed runs after the first (default 3)")
    ptx = program_command("ptx", "compile each kernel for a GPU (no GPU needed) and report it")
    ptx.add_argument("--dims", default="", help="sizes of the dim symbols, e.g. M=4096,N=4096")
    ptx.add_argument("--scalar", action="append", default=[], metavar="NAME=VALUE",
                     help="the value of a scalar parameter (ints 1 and multiples of 16 specialize)")
    ptx.add_argument("--arch", default="sm_90", help="the GPU architecture (default sm_90)")
    ptx.add_argument("--all", action="store_true",
                     help="every autotune candidate, not only the configuration used first")
    ptx.add_argument("--json", action="store_true", help='print {"kernels": [...]} as JSON')
    ptx.add_argument("--dump", metavar="DIR", help="write each kernel's (and candidate's) .ttgir, "
                     ".ptx, .cubin and .json (configuration, resources, loop profile) into DIR")
    sub.add_parser("check", help="parse and check every kernel of a file").add_argument("file")
    sub.add_parser("passes", help="list the registered passes")
    return p


class _VersionAction(argparse.Action):
    """--version, whose text (torch's and Triton's versions) is found only when asked for:
    building the parser must import neither (importing Triton reads TRITON_INTERPRET, which
    `tiledsl ptx` must clear first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    """tiledsl's version and those of what it runs on."""
    import platform

    import torch
    import triton

    import tiledsl

    return (f"tiledsl {tiledsl.__version__} (torch {torch.__version__}, triton {triton.__version__}, "
            f"python {platform.python_version()})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Its output goes through `_Stdout`: a failed write to standard output
    (a full disk, a closed descriptor) is one line on stderr and status 1, like coreutils'
    `write error`; a reader that went away (`| head`) ends the command quietly with status 1,
    as Python's documentation of SIGPIPE advises."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stdout = sys.stdout
    sys.stdout = checked = _Stdout(stdout)
    try:
        try:
            code = _dispatch(argv)
        except SystemExit:  # argparse's --help and --version, and its usage errors
            checked.flush()
            raise
        checked.flush()
        return code
    except diag.TileDSLError as err:
        print(str(err), file=sys.stderr)
        return 1
    except BrokenPipeError:
        _discard(stdout)
        return 1
    except _WriteError as err:
        _discard(stdout)
        print(f"tiledsl: write error: {os.strerror(err.errno)}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout


def _dispatch(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ptx" and _triton_interprets():
        return _ptx_in_fresh_process(args, argv)
    return _COMMANDS[args.command](args)


class _WriteError(Exception):
    """Standard output could not be written (`errno`: why)."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_


class _Stdout:
    """Standard output for one command: writes go to `stream`, and a failed one raises
    `_WriteError` (a closed descriptor, where Python made `sys.stdout` None, is EBADF), so
    `main` can tell them from every other OSError. A broken pipe stays a BrokenPipeError.
    Anything else (`encoding`, `isatty`) is the stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._do(lambda stream: stream.write(text))

    def flush(self) -> None:
        self._do(lambda stream: stream.flush())

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _do(self, action):
        if self._stream is None:
            raise _WriteError(errno.EBADF)
        try:
            return action(self._stream)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise _WriteError(err.errno or errno.EIO) from None


def _discard(stream) -> None:
    """Drop what `stream` still buffers: its descriptor is pointed at /dev/null, so the
    interpreter's final flush neither fails again nor prints a traceback."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO), or None
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _read(path: str) -> tuple[str, str]:
    """(text, display name) of a program file, or of standard input for '-'. The argument
    is always a file name: a missing file is an error, never program text. Both are read
    as bytes, with the size bound of `tiledsl.files`, and decoded as UTF-8 whatever the
    locale says."""
    from pathlib import Path

    from tiledsl.files import read_program, read_stream

    if path == "-":  # sys.stdin is None when the process started with descriptor 0 closed
        return read_stream(getattr(sys.stdin, "buffer", None))
    return read_program(Path(path))


def _compile(args, **kw):
    from tiledsl.api import Generic, compile_text
    from tiledsl.generic import parse_binding

    text, name = _read(args.file)
    fn = compile_text(text, name, args.kernel, pipeline=args.passes, **kw)
    if isinstance(fn, Generic):
        if args.bind is None:
            raise diag.OptionError(message=(
                f"kernel '{fn.name}' is generic ({_signature(fn.kernel)}): give its binding with "
                "--bind, e.g. --bind " + _example_binding(fn.kernel)))
        fn = fn.bound(parse_binding(fn.kernel, args.bind))
    elif args.bind is not None:
        raise diag.OptionError(message=f"--bind: kernel '{fn.name}' is not generic")
    return fn.backward if args.backward else fn


def _signature(kernel) -> str:
    from tiledsl.generic import signature

    return signature(kernel)


def _example_binding(kernel) -> str:
    from tiledsl.generic import has_ellipsis

    parts = [f"{tp.name}={tp.dtypes[0]}" for tp in kernel.type_params]
    if any(has_ellipsis(p.type) for p in kernel.params):
        parts.append("...=1")
    return ",".join(parts)


def _cmd_opt(args) -> int:
    from tiledsl.api import DEFAULT_PIPELINE
    from tiledsl.parser import parse
    from tiledsl.passes.lower_kernels import LowerKernels
    from tiledsl.passes.manager import PassManager, print_ir_to
    from tiledsl.printer import print_graph
    from tiledsl.sema import analyze, select_kernel

    text, name = _read(args.file)
    program = parse(text, name)
    if args.kernel is not None:
        kernels = [select_kernel(program, args.kernel)]
    else:  # like mlir-opt on a module: every kernel, in order
        select_kernel(program, program.kernels[0].name)  # reports duplicate names
        kernels = list(program.kernels)
    pipeline = args.passes if args.passes is not None else DEFAULT_PIPELINE
    lower = LowerKernels.name
    if not args.no_lower and args.passes is not None and not pipeline.rstrip().endswith(lower):
        pipeline = f"{pipeline},{lower}" if pipeline.strip() else lower
    wanted = set(args.print_ir_after)
    stages = ["graph"] + [p.strip() for p in pipeline.split(",") if p.strip()]
    for stage in args.print_ir_after:
        if stage not in stages:
            raise diag.OptionError(message=(
                f"--print-ir-after {stage}: no such stage in this pipeline"
                f"{diag.did_you_mean(stage, stages)} (stages: {', '.join(stages)})"))
    dump = print_ir_to(sys.stdout, args.locations)

    def after(stage: str, g) -> None:
        if args.print_ir_after_all or stage in wanted or stage.split(".")[0] in wanted:
            dump(stage, g)

    manager = PassManager(pipeline, verify=args.verify or None, snapshots=False, print_after=after)
    for kernel in kernels:
        graph = analyze(_concrete(kernel, args.bind))
        if args.backward:
            from tiledsl.api import normalized
            from tiledsl.autodiff import derive

            graph = derive(normalized(graph)).backward
        result = manager.run(graph)
        if not (args.print_ir_after_all or wanted):
            sys.stdout.write(print_graph(result.graph, locations=args.locations))
        if args.remarks:
            for remark in result.context.remarks:
                print(f"// remark: {remark}")
        if args.timing:
            total = sum(t for _, t in result.timings)
            print(f"// pass timing for @{graph.name}:", file=sys.stderr)
            for stage, seconds in result.timings:
                print(f"//   {stage:<16} {seconds * 1e3:8.3f} ms", file=sys.stderr)
            print(f"//   {'total':<16} {total * 1e3:8.3f} ms", file=sys.stderr)
    return 0


def _cmd_triton(args) -> int:
    fn = _compile(args)
    for k in fn.kernels:
        print(f"# ===== {k.name} ({k.template}) =====")
        print(k.source)
    return 0


def _cmd_dot(args) -> int:
    sys.stdout.write(_compile(args).to_dot())
    return 0


def _cmd_explain(args) -> int:
    sys.stdout.write(_compile(args).explain())
    return 0


def _parse_assignments(items: Sequence[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (x for chunk in items for x in chunk.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise diag.OptionError(message=f"{what} must look like NAME=VALUE, got {item!r}")
        if key.strip() in out:
            raise diag.OptionError(message=f"{what} gives {key.strip()} twice")
        out[key.strip()] = value.strip()
    return out


MAX_RUN_DIM = 2**31 - 1
MAX_RUN_ELEMENTS = 2**31


def _run_dims(fn, text: str, limit: bool = True) -> dict[str, int]:
    """--dims, checked against the program's dims (`limit`: and small enough for random
    inputs)."""
    from tiledsl import testing

    dims: dict[str, int] = {}
    for key, value in _parse_assignments([text], "--dims").items():
        try:
            dims[key] = int(value)
        except ValueError:
            raise diag.OptionError(message=f"--dims {key}={value[:40]}: the size must be an integer") \
                from None
        if not 1 <= dims[key] <= MAX_RUN_DIM:
            raise diag.OptionError(message=(
                f"--dims {key}={value[:40]}: the size must be between 1 and {MAX_RUN_DIM}"))
    needed = testing.needed_dims(fn)
    missing = [d for d in needed if d not in dims]
    if missing:
        raise diag.OptionError(message=(
            f"give a size for every dim with --dims: missing {', '.join(missing)} "
            f"(e.g. --dims {','.join(f'{d}=64' for d in needed)})"))
    unknown = [d for d in dims if d not in needed]
    if unknown:
        raise diag.OptionError(message=(
            f"--dims names {', '.join(unknown)}, which '{fn.name}' does not use "
            f"(its dims: {', '.join(needed) or 'none'})"))
    if limit:
        _check_run_sizes(fn, dims)
    return dims


def _check_run_sizes(fn, dims: dict[str, int]) -> None:
    """Refuse sizes `tiledsl run` cannot hold before allocating anything: it draws every
    input, and its torch reference, run op by op, allocates every value of the program
    (outputs included), so a terabyte result is refused here, not by the allocator."""
    graph = fn.fused_graph()
    for node in graph.params:
        count = math.prod(evaluate(d, dims) for d in graph.op(node).attr("type").shape)
        if count > MAX_RUN_ELEMENTS:
            raise diag.OptionError(message=(
                f"--dims gives '{graph.op(node).attr('name')}' {count} elements; tiledsl run draws "
                f"random inputs of at most {MAX_RUN_ELEMENTS}"))
    source = fn.source_graph
    for node in source.topo_order():
        op = source.op(node)
        count = math.prod(evaluate(d, dims) for d in op.shape)
        if count > MAX_RUN_ELEMENTS:
            where = f" at {op.span.location()}" if op.span else ""
            raise diag.OptionError(message=(
                f"--dims gives the {op.kind}{where} {count} elements; tiledsl run checks the "
                f"program against torch op by op, with values of at most {MAX_RUN_ELEMENTS} elements"))


def _run_scalars(fn, items: Sequence[str]) -> dict[str, object]:
    """--scalar values, each read as its parameter's type (floats take inf and nan)."""
    from tiledsl.types import DType

    graph = fn.fused_graph()
    params = {graph.op(n).attr("name"): graph.op(n) for n in graph.params if graph.op(n).attr("scalar")}
    out: dict[str, object] = {}
    for name, value in _parse_assignments(items, "--scalar").items():
        if name not in params:
            raise diag.OptionError(message=(
                f"--scalar {name}: '{fn.name}' has no scalar parameter '{name}'"
                f"{diag.did_you_mean(name, params)} (scalars: {', '.join(params) or 'none'})"))
        dtype = params[name].attr("type").dtype
        shown = f"--scalar {name}={value[:40]}"
        if dtype is DType.BOOL:
            if value not in ("true", "false"):
                raise diag.OptionError(message=f"{shown}: {name} is a bool: give true or false")
            out[name] = value == "true"
        elif dtype.is_int:
            try:
                out[name] = int(value)
            except ValueError:
                raise diag.OptionError(message=f"{shown}: {name} is an {dtype}: give an integer") from None
            lo, hi = dtype.int_range
            if not lo <= out[name] <= hi:
                raise diag.OptionError(message=f"{shown}: {name} is an {dtype}: the value does not fit")
        else:
            try:
                out[name] = float(value)
            except ValueError:
                raise diag.OptionError(message=(
                    f"{shown}: {name} is {dtype}: give a number (inf and nan too)")) from None
    return out


def _run_device(requested: str | None) -> str:
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise diag.OptionError(message=f"--device {requested}: tiledsl runs on cpu or cuda (cuda:N)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise diag.OptionError(message=f"--device {requested}: no CUDA device is available here")
        if device.index is not None and device.index >= count:
            raise diag.OptionError(message=f"--device {requested}: there are {count} CUDA device(s)")
    return str(device)


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def _cmd_run(args) -> int:
    import torch

    from tiledsl import testing

    if not 0 <= args.seed <= MAX_SEED:
        raise diag.OptionError(message=f"--seed {str(args.seed)[:40]}: the seed must be between 0 and "
                               f"{MAX_SEED}")
    device = _run_device(args.device)
    fn = _compile(args, backend=args.backend)
    dims = _run_dims(fn, args.dims)
    scalars = _run_scalars(fn, args.scalar)
    gen = torch.Generator().manual_seed(args.seed)
    with _allocating("random inputs"):
        inputs = testing.random_inputs(fn, dims, "cpu", gen, scalars)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with _allocating("the program's outputs"):
        outputs, first, times = _timed_calls(fn, inputs, device, args.repeat)
    cpu_inputs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with _allocating("the torch reference's values"):
        report = testing.compare(outputs, fn.reference(**cpu_inputs, float64=True),
                                 fn.reference(**cpu_inputs))
    where = "Triton interpreter" if device == "cpu" and args.backend == "triton" else device
    print(f"{fn.name} on {where}: {len(fn.kernels)} kernel(s), dims "
          + ", ".join(f"{k}={v}" for k, v in dims.items()))
    for i, out in enumerate(report.outputs):
        status = "ok" if out.ok else "MISMATCH"
        print(f"  output {i}: max abs error {out.error:.3g} vs float64 "
              f"(eager {out.eager_error:.3g}, tolerance {out.tolerance:.3g}) {status}")
    print(f"  first call {first * 1e3:.2f} ms (includes Triton compilation)"
          + (f", then median {sorted(times)[len(times) // 2] * 1e3:.3f} ms over {len(times)} runs"
             if times else ""))
    return 0 if report.ok else 2


def _timed_calls(fn, inputs: dict, device: str, repeat: int) -> tuple[object, float, list[float]]:
    """(outputs, seconds of the first call, seconds of each of `repeat` more)."""
    start = time.perf_counter()
    outputs = fn(**inputs)
    _sync(device)
    first = time.perf_counter() - start
    times = []
    for _ in range(max(0, repeat)):
        start = time.perf_counter()
        fn(**inputs)
        _sync(device)
        times.append(time.perf_counter() - start)
    return outputs, first, times


@contextlib.contextmanager
def _allocating(what: str) -> Iterator[None]:
    """An allocation that fails inside (torch's CPU and CUDA out-of-memory errors, Python's
    MemoryError) is an `OptionError` naming `what`; any other error passes through."""
    import torch

    try:
        yield
    except (RuntimeError, MemoryError) as err:
        text = str(err)
        if not (isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text):
            raise
        tried = re.search(r"tried to allocate (\d[\d.]*\s*\w+)", text, re.IGNORECASE)
        detail = f"tried to allocate {tried.group(1)}" if tried else text.splitlines()[0][:120]
        raise diag.OptionError(message=f"cannot allocate {what} at these sizes ({detail})") from None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _cmd_ptx(args) -> int:
    import json

    # Triton reads TRITON_INTERPRET whenever @triton.jit runs, for its own standard library
    # when triton.language is imported: set, every kernel would be an InterpretedFunction,
    # which triton.compile cannot lower. ptx compiles kernels and runs none, so it needs no
    # interpreter. `main` has made sure that no Triton imported with it set is loaded here.
    os.environ.pop("TRITON_INTERPRET", None)
    from tiledsl.backends.triton.aot import inspect_program_compiled

    arch = _gpu_arch(args.arch)
    with _dump_directory(args.dump) as dump:  # refused before anything is compiled
        fn = _compile(args)
        dims = _run_dims(fn, args.dims, limit=False)
        inspections = inspect_program_compiled(fn, dims, _run_scalars(fn, args.scalar), args.all, arch)
        if dump is not None:
            _dump(dump, args.dump, inspections)
    reports = [i.report for i in inspections]
    if args.json:
        print(json.dumps({"kernels": [r.as_dict() for r in reports]}))
        return 0
    for r in reports:
        config = ", ".join(f"{k}={v}" for k, v in r.config.items())
        print(f"{r.name}: {config}")
        print(f"  registers {r.registers}, spills {r.spill_bytes} bytes, shared "
              f"{r.shared_bytes} bytes, wgmma {' '.join(r.wgmma) or 'none'}, TMA copies {r.tma}")
        if r.loop is not None:
            print("  " + _loop_line(r.loop))
    return 0


def _triton_interprets() -> bool:
    """Was Triton already imported in this process with TRITON_INTERPRET=1 set (its standard
    library built for the interpreter, so nothing here can compile for a GPU)? Whatever
    imported it (a caller of `main`, a future import in tiledsl itself), `main` then runs
    `ptx` in a fresh process."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return False
    from triton.runtime.jit import JITFunction

    return not isinstance(getattr(standard, "cdiv", None), JITFunction)


def _ptx_in_fresh_process(args, argv: Sequence[str]) -> int:
    """`tiledsl ptx ARGV` in a child process without TRITON_INTERPRET, its output and status
    passed on as this process's (its program text read here when it is standard input)."""
    import tiledsl

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(tiledsl.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    source = _read("-")[0].encode() if args.file == "-" else None
    result = subprocess.run([sys.executable, "-m", "tiledsl.cli", *argv], env=env, input=source,
                            stdin=subprocess.DEVNULL if source is None else None,
                            capture_output=True, check=False)
    sys.stderr.write(result.stderr.decode(errors="replace"))
    sys.stdout.write(result.stdout.decode(errors="replace"))
    return result.returncode


def _loop_line(loop: dict) -> str:
    """One line of a kernel's loop profile."""
    mma = ", ".join(f"{n} {shape}" for shape, n in loop["mma"].items()) or "no mma"
    m = loop["modeled"]
    return (f"loop ({loop['source']}): {loop['instructions']} instructions, {loop['mufu']} MUFU, {mma}, "
            f"{loop['barriers']} barriers, {loop['shared_ops']} shared ops per warp and iteration "
            f"({loop['warps']} warps, {loop['work']} {loop['work_unit']}s); modeled H100 cycles (an "
            f"estimate): tensor {m['tensor']}, issue {m['issue']}, MUFU {m['mufu']}, memory "
            f"{m['memory']}: {m['bound']}-bound")


@contextlib.contextmanager
def _dump_directory(text: str | None) -> Iterator[Path | None]:
    """The `--dump DIR` directory, made (with its parents) and written to once before the
    command compiles anything, so that a file or an unwritable place there is refused at
    once; the directories made are removed again if the command fails."""
    if text is None:
        yield None
        return
    path = Path(text)
    made = []  # the directories this makes, innermost first
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        made.append(p)
    try:
        if os.path.lexists(path) and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        _remove_empty(made)
        raise diag.OptionError(message=(
            f"--dump {text}: cannot write files there ({err.strerror or err})")) from None
    try:
        yield path
    except BaseException:
        _remove_empty(made)
        raise


def _remove_empty(directories: list[Path]) -> None:
    for d in directories:
        with contextlib.suppress(OSError):
            d.rmdir()


def _dump(directory: Path, text: str, inspections: list) -> None:
    """Each kernel's compiled forms and report, as <kernel>.<ext>; with several
    configurations of one kernel (--all), <kernel>_c<i>.<ext>."""
    import json

    seen: dict[str, int] = {}
    for inspection in inspections:
        name = inspection.report.name
        seen[name] = seen.get(name, -1) + 1
        stem = name if seen[name] == 0 and sum(i.report.name == name for i in inspections) == 1 \
            else f"{name}_c{seen[name]}"
        files = [(f"{stem}.{ext}", data) for ext, data in inspection.asm.items()]
        files.append((f"{stem}.json", json.dumps(inspection.report.as_dict(), indent=1) + "\n"))
        for filename, data in files:
            try:
                if isinstance(data, bytes):
                    (directory / filename).write_bytes(data)
                else:
                    (directory / filename).write_text(data)
            except OSError as err:  # a full disk, the directory removed meanwhile
                raise diag.OptionError(message=(
                    f"--dump {text}: cannot write {filename} ({err.strerror or err})")) from None


def _gpu_arch(text: str) -> int:
    """The compute capability of `--arch sm_<N>`, if tiledsl's kernels run there (sm_80 and
    newer) and the installed Triton can compile for it. An architecture Triton's LLVM does
    not know aborts the process (`LLVM ERROR: Cannot select`), so it is refused here."""
    arch = re.fullmatch(r"sm_(\d{1,6})a?", text)
    if arch is None or int(arch.group(1)) < 80:
        raise diag.OptionError(message=f"--arch {text[:40]}: give an NVIDIA architecture "
                               "sm_80 or newer, e.g. sm_90")
    capability = int(arch.group(1))
    supported = _triton_gpu_archs(capability)
    if capability not in supported:
        import triton

        raise diag.OptionError(message=(
            f"--arch {text}: the installed Triton ({triton.__version__}) cannot compile for "
            f"sm_{capability}; it compiles for {', '.join(f'sm_{c}' for c in supported)}"))
    return capability


def _triton_gpu_archs(requested: int) -> list[int]:
    """The capabilities from sm_80 on that the installed Triton compiles for (the requested
    one among them if it can): those whose architecture name (sm_90a from sm_90 on) the
    ptxas Triton picks for them accepts as --gpu-name. Triton bundles its LLVM and ptxas
    together, so what ptxas knows, LLVM knows."""
    from triton.backends.nvidia import compiler

    def name(capability: int) -> str:
        if hasattr(compiler, "sm_arch_from_capability"):
            return compiler.sm_arch_from_capability(capability)
        return f"sm_{capability}{'a' if capability >= 90 else ''}"

    def accepted(capability: int) -> frozenset[str]:
        return _ptxas_gpu_names(compiler.get_ptxas(capability).path)

    try:
        listed = {int(n) for c in (80, 90) for n in re.findall(r"sm_(\d+)", " ".join(accepted(c)))}
        return sorted(c for c in listed | {requested} if c >= 80 and name(c) in accepted(c))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        raise diag.OptionError(message=f"--arch: cannot run Triton's ptxas ({err})") from None


@functools.cache
def _ptxas_gpu_names(path: str) -> frozenset[str]:
    """The --gpu-name values a ptxas accepts, from its --help."""
    result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, check=True)
    return frozenset(re.findall(r"'(sm_\w+)'", result.stdout))


def _concrete(kernel, bind: str | None):
    """`kernel`, specialized by `--bind` where it is generic."""
    from tiledsl import generic

    if not generic.is_generic(kernel):
        return kernel
    generic.check(kernel)
    if bind is None:
        raise diag.OptionError(message=(
            f"kernel '{kernel.name}' is generic ({generic.signature(kernel)}): give its binding with "
            "--bind, e.g. --bind " + _example_binding(kernel)))
    return generic.specialize(kernel, generic.parse_binding(kernel, bind))


def _cmd_check(args) -> int:
    from tiledsl import generic
    from tiledsl.parser import parse
    from tiledsl.sema import analyze

    text, name = _read(args.file)
    program = parse(text, name)
    for k in program.kernels:
        if generic.is_generic(k):  # its dtype bindings (or a covering set), one leading dim
            generic.check(k)
            checked = generic.check_bindings(k)
            for b in checked.bindings:
                try:
                    analyze(generic.specialize(k, b))
                except diag.TileDSLError as err:
                    err.notes += (diag.Note(f"with the binding {b}"),)
                    raise
            n = len(checked.bindings)
            if checked.coverage == "every":
                print(f"{name}: kernel '{k.name}' ok ({n} bindings: "
                      + "; ".join(str(b) for b in checked.bindings) + ")")
            else:
                what = ("every pair of dtypes of two variables" if checked.coverage == "pairs"
                        else "every dtype of each variable")
                total = (str(checked.total) if checked.total < 10**18
                         else f"about 10^{math.floor(math.log10(checked.total))}")
                print(f"{name}: kernel '{k.name}' ok ({n} bindings of {total}: {what})")
            continue
        analyze(k)
        print(f"{name}: kernel '{k.name}' ok")
    return 0


def _cmd_passes(args) -> int:
    from tiledsl.passes.registry import REGISTRY, _load_builtin_passes

    _load_builtin_passes()
    for name in sorted(REGISTRY):
        doc = (REGISTRY[name].__doc__ or "").strip()
        module_doc = sys.modules[REGISTRY[name].__module__].__doc__ or doc
        print(f"{name:<16} {module_doc.strip().splitlines()[0]}")
    return 0


_COMMANDS = {"opt": _cmd_opt, "triton": _cmd_triton, "dot": _cmd_dot, "explain": _cmd_explain,
             "run": _cmd_run, "ptx": _cmd_ptx, "check": _cmd_check, "passes": _cmd_passes}


if __name__ == "__main__":
    sys.exit(main())
