"""Building a reference kernel for sm_90 without a GPU, specialized as Triton's launcher would
specialize its arguments, and running it on torch tensors on either device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiledsl.backends.triton.aot import SM90, resource_usage
from tiledsl.backends.triton.launch import PINNED_OPTIONS
from tiledsl.backends.triton.loop_profile import loop_profile

# the element types of pointer arguments, as Triton's signatures name them
POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
           torch.float8_e4m3fn: "*fp8e4nv", torch.int64: "*i64", torch.int32: "*i32"}


@dataclass(frozen=True)
class Build:
    """One reference kernel at one shape: how to compile it for sm_90 and the work one
    iteration of its hottest loop does (for `loop_profile`)."""

    name: str
    role: str  # what it computes, to pair it with tiledsl's kernel of the same role
    fn: Any  # the @triton.jit kernel
    args: Mapping[str, Any]  # name -> a torch dtype (a pointer), an int or a float
    constexprs: Mapping[str, Any]
    warps: int
    stages: int
    work: int
    work_unit: str

    def compile(self) -> Any:
        return compile_sm90(self.fn, self.args, self.constexprs, self.warps, self.stages)


def compile_sm90(fn: Any, args: Mapping[str, Any], constexprs: Mapping[str, Any], warps: int,
                 stages: int) -> Any:
    """The `CompiledKernel` a launch of `fn` with these arguments would run on an H100: pointers
    (given by their element dtype) are 16-byte aligned as torch's allocations are, integers
    divisible by 16 carry `tt.divisibility`, integers equal to 1 are compiled in."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    consts: dict[Any, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name], consts[name] = "constexpr", constexprs[name]
            continue
        value = args[name]
        if isinstance(value, torch.dtype):
            signature[name] = POINTER[value]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name}: give a torch dtype, an int or a float, not {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*SM90),
                          options={"num_warps": warps, "num_stages": stages, **PINNED_OPTIONS})


def report(build: Build) -> dict[str, Any]:
    """Registers, spills, shared memory and the hottest loop's profile of a build."""
    compiled = build.compile()
    usage = resource_usage(compiled)
    return {"name": build.name, "role": build.role, "registers": usage["registers"],
            "spill_bytes": usage["spill_stores"] + usage["spill_loads"],
            "shared_bytes": int(getattr(compiled.metadata, "shared", 0)),
            "config": {**build.constexprs, "num_warps": build.warps, "num_stages": build.stages},
            "loop": loop_profile(compiled, build.warps, build.work, build.work_unit)}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`: compiled for CUDA tensors, through Triton's interpreter
    for CPU tensors (tiledsl's way of running both in one process)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and tensors[0].is_cuda:
        from tiledsl.backends.triton.program import ensure_allocator

        ensure_allocator()  # device-side TMA descriptors need scratch memory
        kernel[grid](*args, **kwargs)
        return
    from tiledsl.backends.triton.interpret import interpreted, interpreting

    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    with interpreting():
        interpreted(kernel)[grid](*args, **kwargs)
