"""What every code template produces, and helpers they share.

A template turns a `KernelOp` into an `EmittedKernel`: the module source,
the ordered kernel parameters with how to fill each (`ArgSpec`), and a
`configure(dims, device)` that picks the grid and compile-time constants for
the sizes of one call. Only constants derived from sizes (block shapes) are
`tl.constexpr`, so a new size recompiles only when it moves a block size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiledsl.diagnostics import TileHintError, TileSizeError
from tiledsl.dims import evaluate
from tiledsl.ir import KernelOp
from tiledsl.source import Span

from .codegen import ArgSpec, Code, Signature, header
from .expr import HELPERS, Emitter


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple[int, ...]
    constexprs: dict[str, Any]
    num_warps: int | None = None
    num_stages: int | None = None
    # a persistent grid: fewer programs than tiles, each looping over tiles (GEMM)
    persistent: bool = False


Hints = Mapping[str, tuple[int, Span]]

# Triton's largest tile (TRITON_MAX_TENSOR_NUMEL): a block of a dot template's rows
# (BLOCK_M, BLOCK_N) times any of its other blocks (a head dim's BLOCK_D, a GEMM's BLOCK_K)
MAX_TILE = 1 << 20
ROW_BLOCKS = ("BLOCK_M", "BLOCK_N")


def oversized_tile(cfg: LaunchConfig) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The first [row block, other block] tile of a configuration past `MAX_TILE`."""
    consts = cfg.constexprs
    for a in (r for r in ROW_BLOCKS if r in consts):
        for b, vb in consts.items():
            if b != a and b.startswith("BLOCK_") and consts[a] * vb > MAX_TILE:
                return (a, consts[a]), (b, vb)
    return None


def fit_rows(blocks: Mapping[str, int], widths: Sequence[int], hinted: Container[str],
             smallest: int = 16) -> dict[str, int]:
    """`blocks` (BLOCK_M, BLOCK_N) with each one no hint fixed halved, down to `smallest`
    (tl.dot's), until its tiles against every width in `widths` fit in `MAX_TILE`."""
    out = dict(blocks)
    widest = max(widths, default=1)
    for name, value in out.items():
        while name not in hinted and value > smallest and value * widest > MAX_TILE:
            value //= 2
        out[name] = value
    return out


# the line that numbers a pointwise or row program; a merged launch (`merged.py`) rebases it
PROGRAM_ID = "pid = tl.program_id(0)"


@dataclass(frozen=True)
class Function:
    """A kernel's @triton.jit function before it became a module, as a merged launch
    (`merged.py`) calls it: its signature, body, the helpers it calls, and how many programs
    it runs (source text over its parameters and constexprs)."""

    sig: Signature
    lines: tuple[str, ...]
    helpers: frozenset[str]
    programs: str | None


@dataclass(frozen=True)
class EmittedKernel:
    kernel: KernelOp
    fn_name: str
    source: str
    params: tuple[tuple[str, ArgSpec], ...]
    configure: Callable[[Mapping[str, int], str], LaunchConfig] = field(compare=False)
    # configurations worth timing on this device for these sizes (GPU autotuning)
    candidates: Callable[[Mapping[str, int], str], list[LaunchConfig]] | None = field(
        default=None, compare=False)
    interpreter_flag: bool = False  # the kernel takes INTERPRETER: tl.constexpr
    hints: Hints = field(default_factory=dict, compare=False)  # the program's @tile hints
    function: Function | None = field(default=None, compare=False)
    # the scratch memory a call at these sizes on this target ("cuda", "interpreter") needs,
    # one (elements, torch dtype name) per workspace (None: the kernel takes none)
    workspace: Callable[[Mapping[str, int], str], tuple[tuple[int, str], ...]] | None = field(
        default=None, compare=False)
    # the launches that follow this one in the same kernel, reading its workspaces and
    # writing its other results (a split row program's combine): one call runs them all
    then: tuple[EmittedKernel, ...] = ()
    # inputs the launcher hands over K-major (their second-to-last dim contiguous, a copy
    # where the caller's tensor is not: `launch.k_major`): 8-bit B operands of a GEMM, which
    # Hopper's fp8 wgmma reads only K-major
    k_major: tuple[int, ...] = ()

    def launch_config(self, dims: Mapping[str, int], device: str) -> LaunchConfig:
        cfg = self.configure(dims, device)
        too_big = oversized_tile(cfg)
        if too_big:
            raise self._tile_error(too_big, dims)
        return self._flagged(cfg, device)

    def launch_candidates(self, dims: Mapping[str, int], device: str) -> list[LaunchConfig]:
        if self.candidates is None:
            return []
        return [self._flagged(c, device) for c in self.candidates(dims, device) if not oversized_tile(c)]

    def resource_error(self, err: Any) -> Exception:
        """The error of a launch a GPU refused for its resources (Triton's `OutOfResources`:
        shared memory, registers): at the program's tile hints when it has some, since they
        chose the configuration; without hints a configuration of ours that does not fit is
        a tiledsl bug."""
        from tiledsl.diagnostics import InternalError

        need = f"{err.required} of {err.name}, where this GPU has {err.limit}"
        if self.hints:
            first = min(self.hints.values(), key=lambda h: (h[1].line, h[1].column))
            given = ", ".join(f"{n}={v}" for n, (v, _) in self.hints.items())
            return TileHintError(first[1], message=(
                f"tile hints {given} make the {self.kernel.template} kernel {self.kernel.name} need "
                f"{need}: use smaller blocks or fewer num_stages"))
        return InternalError(self.kernel.span, message=(
            f"the {self.kernel.template} kernel {self.kernel.name} needs {need} at its default "
            "configuration (this is a tiledsl bug, please report it)"))

    def _tile_error(self, tile: tuple[tuple[str, int], tuple[str, int]], dims: Mapping[str, int]):
        """The error of a configuration with a tile past `MAX_TILE`: at the hint that chose
        one of its blocks, else at the kernel (the sizes alone need it)."""
        (a, va), (b, vb) = tile
        shape = f"[{a}, {b}] tile of {va} x {vb} = {va * vb} elements"
        limit = f"more than Triton holds in one tile ({MAX_TILE} = 2^20)"
        sizes = ", ".join(f"{k} = {v}" for k, v in sorted(dims.items()))
        hinted = [n for n in (a, b) if n in self.hints]
        if hinted:
            name = hinted[0]
            other = vb if name == a else va
            return TileHintError(self.hints[name][1], message=(
                f"tile hint {name}={self.hints[name][0]} gives the {self.kernel.template} kernel "
                f"{self.kernel.name} a {shape} at this call's sizes ({sizes}), {limit}; "
                f"use {name} <= {max(1, MAX_TILE // other)}"))
        return TileSizeError(self.kernel.span, message=(
            f"at this call's sizes ({sizes}) the {self.kernel.template} kernel {self.kernel.name} "
            f"needs a {shape} even with its smallest blocks, {limit}"))

    def _flagged(self, cfg: LaunchConfig, device: str) -> LaunchConfig:
        if not self.interpreter_flag:
            return cfg
        consts = {**cfg.constexprs, "INTERPRETER": device == "interpreter"}
        return LaunchConfig(cfg.grid, consts, cfg.num_warps, cfg.num_stages, cfg.persistent)

    def with_candidates(self, candidates) -> EmittedKernel:
        return dataclasses.replace(self, candidates=candidates)

    def with_k_major(self, inputs: tuple[int, ...]) -> EmittedKernel:
        return dataclasses.replace(self, k_major=inputs)

    def ir(self) -> str:
        """The kernel's IR as text (part of its cache key)."""
        from tiledsl.printer import print_region

        return "\n".join(print_region(self.kernel.region, plan=self.kernel.plan))


def hint(hints: Hints, name: str, default: int) -> int:
    return hints[name][0] if name in hints else default


def describe(cfg: LaunchConfig) -> dict[str, Any]:
    """A launch configuration by its parameters (what the autotuner records of a choice)."""
    described = {**{k: v for k, v in cfg.constexprs.items() if isinstance(v, int | bool)},
                 "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.persistent:
        described["persistent"] = True
    return described


def hinted_first(hinted: LaunchConfig | None, found: list[LaunchConfig]) -> list[LaunchConfig]:
    """Autotune candidates, each once: the configuration a program's tile hints give first
    (the one timed first, and used untimed once the tuning budget is spent; None without
    hints), then the template's."""
    out: list[LaunchConfig] = []
    for cfg in ([hinted] if hinted is not None else []) + found:
        if all(describe(cfg) != describe(c) for c in out):
            out.append(cfg)
    return out


def require_dot_hints(hints: Hints, names: Sequence[str]) -> None:
    """tl.dot needs every tile dim to be at least 16."""
    for name in names:
        if name in hints and hints[name][0] < 16:
            value, span = hints[name]
            raise TileHintError(span, message=(
                f"tile hint {name} must be at least 16 for a matmul kernel (tl.dot's smallest "
                f"tile), got {value}"))


def finish(kernel: KernelOp, sig: Signature, body: Code,
           configure: Callable[[Mapping[str, int], str], LaunchConfig],
           em: Emitter, hints: Hints | None = None, programs: str | None = None,
           workspace: Callable[[Mapping[str, int], str], tuple[tuple[int, str], ...]] | None = None,
           then: tuple[EmittedKernel, ...] = (), fn_name: str | None = None) -> EmittedKernel:
    """Assemble the module with the helpers it calls; kernels that convert bf16 or f8 take
    `INTERPRETER`. `programs`: how many programs the kernel runs, for a template a merged
    launch may hold (pointwise, rows); `then`: the launches that follow it (`EmittedKernel`)."""
    fn_name = fn_name or f"{kernel.name}_{kernel.template}"
    code = Code()
    for line in header(kernel):
        code(line)
    # the conversion helpers take INTERPRETER (mul_combine does not)
    flag = any("INTERPRETER" in HELPERS[name] for name in em.helpers)
    if flag:
        sig.constexpr("INTERPRETER")
    for name in sorted(em.helpers):
        for line in HELPERS[name].splitlines():
            code(line)
    for line in sig.dim_comments():
        code(line)
    widening = sig.widening()
    code("@triton.jit")
    code(sig.render(fn_name))
    with code.indent():
        for line in widening + body.lines:
            code(line)
    function = Function(sig, tuple(widening + body.lines), frozenset(em.helpers), programs)
    return EmittedKernel(kernel, fn_name, code.text(), tuple(sig.params), configure,
                         interpreter_flag=flag, hints=dict(hints or {}), function=function,
                         workspace=workspace, then=then)


def decompose(code: Code, flat: str, dims: Sequence[int | str], names: Sequence[str | None],
              size: Callable[[int | str], str], tmp: str) -> None:
    """Split a flat row-major index into per-dim indices (None: a literal size-1 dim, index 0).

    Only the sizes the split divides by become kernel parameters (via `size`).
    """
    live = [(d, n) for d, n in zip(dims, names, strict=True) if n is not None]
    rem = flat
    for step, (dim, name) in enumerate(reversed(live)):
        if step == len(live) - 1:
            code(f"{name} = {rem}")
        else:
            code(f"{name} = {rem} % {size(dim)}")
            code(f"{tmp}{step} = {rem} // {size(dim)}")
            rem = f"{tmp}{step}"


def batch_names(batch: Sequence[int | str]) -> list[str | None]:
    """A dot template's batch indices, one per batch dim (None: a literal size-1 dim). Named
    `bi<n>`, apart from the operand tiles `a`, `b`, `b1`, ... a template also names."""
    return [None if d == 1 else f"bi{i}" for i, d in enumerate(batch)]


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (an H100 SXM's 132 without one)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


def numel(shape, dims: Mapping[str, int]) -> int:
    total = 1
    for d in shape:
        total *= evaluate(d, dims)
    return total


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Block-size caps per device (flat: a pointwise program's block of the flat index; row and
# tile: a row program's row block and its tile of short rows): the interpreter runs each
# program in numpy, so fewer, larger programs are faster there; GPUs want register-sized
# tiles (a row program's row block on CUDA: `rows.one_pass_limit`).
CAPS = {
    "interpreter": {"flat": 1 << 14, "row": 1 << 12, "tile": 1 << 16},
    "cuda": {"flat": 1024, "tile": 4096},
}
