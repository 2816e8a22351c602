"""Ahead-of-time compilation of generated kernels for a GPU target, without a GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` lowers a
kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin on any machine. Given
a launch (each argument's type and specialization, and the sizes of the
call), this builds exactly what would run on an H100:
- arguments specialized as Triton's launcher does (`launch.specialize`):
  16-byte-aligned pointers and integers divisible by 16 carry
  `tt.divisibility = 16`, integers equal to 1 are compiled in. Without that
  the compiler cannot vectorize loads or pipeline them with `cp.async`, and
  the kernel it builds is not the one that runs;
- the launch configuration is the GPU's (`launch_config(dims, "cuda")`, or
  one of its autotune candidates), not the interpreter's.

`inspect_program` does this for every kernel of a program at given sizes
(`tiledsl ptx`): registers, spills, shared memory, wgmma shapes, TMA copies, and the static
profile of its hottest loop (`loop_profile`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .cache import load
from .launch import PINNED_OPTIONS
from .loop_profile import loop_profile, work_of
from .program import Launch

SM90 = ("cuda", 90, 32)


def compile_launch(launch: Launch, target: tuple[str, int, int] = SM90, config: Any = None) -> Any:
    """The `CompiledKernel` (with `.asm["ptx"]`, `.asm["cubin"]`) of a recorded launch.

    `config` picks a launch configuration (default: the GPU's for these sizes).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from tiledsl.diagnostics import OptionError

    emitted = launch.kernel
    cfg = config or emitted.launch_config(dict(launch.dims), "cuda")
    fn = load(emitted.source, emitted.fn_name, "cuda", emitted.ir())
    if not isinstance(fn, JITFunction):  # Triton read TRITON_INTERPRET when it was imported
        raise OptionError(message=(
            "cannot compile for a GPU in a process that imported Triton with TRITON_INTERPRET=1 "
            "set (every kernel, Triton's own library included, is then built for its interpreter); "
            "unset it: CPU tensors run through the interpreter without it ('tiledsl ptx' unsets it "
            "itself)"))
    signature: dict[str, str] = dict(launch.signature)
    signature.update({name: "constexpr" for name in cfg.constexprs})
    constexprs: dict[Any, Any] = dict(cfg.constexprs)
    attrs = {}
    for i, arg in enumerate(launch.arguments):
        if arg.type == "constexpr":
            constexprs[(i,)] = arg.value
        elif arg.aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps or 4, "num_stages": cfg.num_stages or 3, **PINNED_OPTIONS}
    return triton.compile(source, target=GPUTarget(*target), options=options)


@functools.cache
def ptxas_options() -> tuple[str, ...]:
    """The ptxas options the installed Triton's `make_cubin` passes: line info, and where it
    has it its workaround for a register allocation bug of ptxas 13 (`--regAllocOptLevel=2`,
    Triton 3.9 here); FFMA fusion is on, as `launch.PINNED_OPTIONS` has it."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend

    source = inspect.getsource(CUDABackend.make_cubin)
    return ("-lineinfo", *(["--regAllocOptLevel=2"] if "--regAllocOptLevel=2" in source else []))


def resource_usage(compiled: Any, arch: int = 90) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame of a compiled kernel, from `ptxas -v`.

    The numbers a GPU driver would report (`n_spills`, `n_regs`) need a GPU;
    ptxas gives the same counts from the PTX on any machine, run with the options Triton
    compiles the cubin with (`ptxas_options`: its register allocation differs without them;
    a split-KV decode kernel spilled 12 bytes at 72 registers where the cubin Triton built
    used 77 and none).
    """
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    gpu = target.group(1).rstrip(",") if target else f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run([get_ptxas(arch).path, *ptxas_options(), "-v", f"--gpu-name={gpu}", str(src),
                                 "-o", str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    text = result.stdout + result.stderr

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame")}


@dataclass(frozen=True)
class KernelReport:
    """What the GPU would run for one kernel at one configuration."""

    name: str
    config: dict[str, Any]
    registers: int
    spill_bytes: int  # spill stores + spill loads, per thread
    shared_bytes: int
    wgmma: list[str]  # the warpgroup MMA shapes it issues, e.g. "m64n128k16"
    tma: int  # TMA copies (cp.async.bulk.tensor) in the PTX
    # the hottest loop's static profile (`loop_profile`): counts per warp and iteration, the
    # work an iteration does, and modeled H100 cycles (an estimate)
    loop: dict[str, Any] | None = None
    # the launch: its function (a kernel of several launches, a split row program's partials
    # then its combine, has one report each), its grid, and the scratch memory allocated for
    # it (a later launch of the kernel reads the first's)
    function: str = ""
    grid: tuple[int, ...] = ()
    workspace_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Inspection:
    """A kernel's report with what it was compiled to (`CompiledKernel.asm`: ttgir, ptx,
    cubin), for `tiledsl ptx --dump`."""

    report: KernelReport
    asm: dict[str, Any]


def inspect_launch(launch: Launch, config: Any = None, arch: int = 90) -> KernelReport:
    """Compile one launch for `sm_<arch>` (at `config`, default the GPU's) and report it."""
    return inspect_compiled(launch, config, arch).report


def inspect_compiled(launch: Launch, config: Any = None, arch: int = 90) -> Inspection:
    """`inspect_launch`, keeping what the kernel was compiled to."""
    cfg = config or launch.kernel.launch_config(dict(launch.dims), "cuda")
    compiled = compile_launch(launch, ("cuda", arch, 32), cfg)
    ptx = compiled.asm["ptx"]
    usage = resource_usage(compiled, arch)
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\S*\.(m\d+n\d+k\d+)", ptx)),
                    key=lambda s: [int(n) for n in re.findall(r"\d+", s)])
    config_text = {**{k: v for k, v in cfg.constexprs.items() if k != "INTERPRETER"},
                   "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.persistent:
        config_text["programs"] = cfg.grid[0]  # a persistent grid
    work, unit = work_of(launch.kernel.kernel.plan, cfg.constexprs)
    loop = loop_profile(compiled, cfg.num_warps or 4, work, unit)
    emitted, dims = launch.kernel, dict(launch.dims)
    workspace = sum(n * getattr(torch, dtype).itemsize for n, dtype in emitted.workspace(dims, "cuda")) \
        if emitted.workspace is not None else 0
    report = KernelReport(emitted.kernel.name, config_text, usage["registers"],
                          usage["spill_stores"] + usage["spill_loads"],
                          int(getattr(compiled.metadata, "shared", 0)), shapes,
                          len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), loop,
                          emitted.fn_name, tuple(cfg.grid), workspace)
    return Inspection(report, {k: compiled.asm[k] for k in ("ttgir", "ptx", "cubin") if k in compiled.asm})


def meta_launches(fn: Any, dims: Mapping[str, int], scalars: Mapping[str, Any] | None = None) -> list:
    """The launches a call of `fn` at `dims` makes, computed without running it: arguments are
    fresh contiguous tensors on torch's "meta" device (shapes and strides, no memory), whose
    pointers are aligned as a caching allocator's are."""
    import torch

    from tiledsl import diagnostics as diag
    from tiledsl.binding import BoundCall, eval_shape, torch_dtype
    from tiledsl.testing import needed_dims
    from tiledsl.types import DType

    missing = [d for d in needed_dims(fn) if d not in dims]
    if missing:
        raise diag.OptionError(message=f"no size given for {', '.join(missing)}")
    if not hasattr(fn.runtime, "launches_at"):
        raise diag.OptionError(message="only the Triton backend's kernels can be inspected")

    # a scalar that the launcher does not specialize (not 1, not a multiple of 16)
    stand_in = {DType.BOOL: True, DType.I8: 3, DType.U8: 3, DType.I16: 3, DType.I32: 3, DType.I64: 3}
    graph = fn.fused_graph()
    args: dict[str, Any] = {}
    scalars = dict(scalars or {})
    for node in graph.params:
        op = graph.op(node)
        name, t = op.attr("name"), op.attr("type")
        if op.attr("scalar"):
            args[name] = scalars.get(name, stand_in.get(t.dtype, 0.5))
        else:
            args[name] = torch.empty(eval_shape(t.shape, dims), dtype=torch_dtype(t.dtype),
                                     device="meta")
    bound = BoundCall(list(args.values()), {d: dims[d] for d in needed_dims(fn)},
                      torch.device("meta"))
    return fn.runtime.launches_at(bound)


def inspect_program(fn: Any, dims: Mapping[str, int], scalars: Mapping[str, Any] | None = None,
                    every_candidate: bool = False, arch: int = 90) -> list[KernelReport]:
    """Every kernel of a compiled program as it would run on a GPU at `dims`, compiled
    without one (`meta_launches`); `every_candidate` reports each autotune candidate instead
    of the configuration a launch uses first."""
    return [i.report for i in inspect_program_compiled(fn, dims, scalars, every_candidate, arch)]


def inspect_program_compiled(fn: Any, dims: Mapping[str, int], scalars: Mapping[str, Any] | None = None,
                             every_candidate: bool = False, arch: int = 90) -> list[Inspection]:
    """`inspect_program`, keeping what each kernel was compiled to."""
    out = []
    for launch in meta_launches(fn, dims, scalars):
        configs = launch.kernel.launch_candidates(dict(launch.dims), "cuda") if every_candidate else []
        for cfg in configs or [None]:
            out.append(inspect_compiled(launch, cfg, arch))
    return out
