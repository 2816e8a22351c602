"""Structured emission of Triton source with compiler-owned names.

`Code` is an indented line buffer. `Signature` hands out the kernel's
parameter names (`in0_ptr`, `in0_s1`, `d0`, `out0_ptr`, `BLOCK`) and records,
for each, how the launcher fills it (`ArgSpec`). DSL identifiers never become
Python names: dim symbols map to `d0, d1, ...`, and the only user text in a
generated module is in comments passed through `comment()`, which escapes
anything that could end the comment line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tiledsl.diagnostics import escape
from tiledsl.ir import KernelOp
from tiledsl.types import Shape


def comment(text: str) -> str:
    """`text` made safe for a `#` comment: one line, printable, no user-controlled escapes."""
    return "# " + escape(text).replace("\n", "\\n")


class Code:
    """An indented buffer of source lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._indent = 0

    def __call__(self, line: str = "") -> None:
        self.lines.append(("    " * self._indent + line) if line else "")

    @contextlib.contextmanager
    def indent(self) -> Iterator[None]:
        self._indent += 1
        try:
            yield
        finally:
            self._indent -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# --- launch-time argument specs -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ptr:
    """Data pointer of kernel input `index` (role "in") or output `index` (role "out")."""

    role: str
    index: int


@dataclass(frozen=True, slots=True)
class Stride:
    role: str
    index: int
    dim: int


@dataclass(frozen=True, slots=True)
class DimSize:
    symbol: str


@dataclass(frozen=True, slots=True)
class Numel:
    """The product of a shape's dims."""

    shape: Shape


@dataclass(frozen=True, slots=True)
class Scalar:
    """A by-value input (scalar parameter or dim)."""

    index: int


@dataclass(frozen=True, slots=True)
class TmaReady:
    """A constexpr flag computed per call: input `index` can be read through a TMA
    descriptor (its data 16-byte aligned, its last stride 1, its other strides multiples
    of 16 bytes). The kernel holds both paths; Triton compiles the one the flag picks.
    `swapped`: the same with the last two dims swapped (a transposed view of a tensor
    whose rows are contiguous, read by a descriptor over those rows and transposed)."""

    index: int
    swapped: bool = False
    role: str = "in"  # "out": a fresh output, contiguous (its data alignment is checked)


@dataclass(frozen=True, slots=True)
class Wide:
    """A constexpr flag computed per call: some tensor the kernel reads or writes has an
    element offset past int32's range, or a dim is near it. The kernel then computes every
    index and offset in int64 (`base.finish` widens its size and stride arguments);
    otherwise in int32, which the launcher has proved cannot overflow (`launch.fits_int32`)."""


@dataclass(frozen=True, slots=True)
class Workspace:
    """Scratch memory the launcher allocates for each call, the kernel's `index`-th, as many
    elements of a dtype as its `EmittedKernel.workspace` asks at the call's sizes: a row
    program sorting rows longer than its registers hold (`row_select.py`, long selections), the
    partials of a split row program that its combine launch merges."""

    index: int = 0


@dataclass(frozen=True, slots=True)
class RowsFlat:
    """A constexpr flag computed per call: the tensor's dims `axes` (a row program's row
    dims, in the order its flat row index runs over them, the last fastest) collapse, each
    stride the next one's times its size, so a row's offset is the flat row index times the
    last one's stride (no division of the row index into the dims' indices)."""

    index: int
    axes: tuple[int, ...]
    role: str = "in"  # "out": a fresh output, contiguous unless stored transposed


ArgSpec = Ptr | Stride | DimSize | Numel | Scalar | TmaReady | Wide | Workspace | RowsFlat
# arguments passed positionally as `tl.constexpr` (Triton compiles a kernel per value)
FLAGS = (TmaReady, Wide, RowsFlat)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor argument: its pointer name and one stride name per dim (None: literal size 1)."""

    ptr: str
    strides: tuple[str | None, ...]
    role: str  # "in" or "out", and its number among them (`Signature.tensor`)
    index: int

    def descriptor_strides(self, order: Sequence[int]) -> str:
        """The strides of a TMA descriptor over this tensor, its axes in `order`: the last is
        the literal 1 (a descriptor asks for a compile-time unit stride, which the call's
        `TmaReady` flag guarantees) even where the kernel has widened the stride names."""
        names = [self.strides[a] for a in order]
        return ", ".join([*names[:-1], "1"])

    def offset(self, indices: Sequence[str | None]) -> str:
        """`i0 * s0 + i1 * s1 ...` over the dims that have both an index and a stride."""
        terms = [f"{i} * {s}" for i, s in zip(indices, self.strides, strict=True)
                 if i is not None and s is not None]
        return " + ".join(terms) if terms else "0"


class Signature:
    """The parameters of one generated kernel, in order."""

    def __init__(self) -> None:
        self.params: list[tuple[str, ArgSpec]] = []
        self.constexprs: list[str] = []
        self._dims: dict[str, str] = {}

    def _add(self, name: str, spec: ArgSpec) -> str:
        self.params.append((name, spec))
        return name

    def tensor(self, role: str, index: int, shape: Shape) -> TensorRef:
        prefix = f"{role}{index}"
        ptr = self._add(f"{prefix}_ptr", Ptr(role, index))
        strides = tuple(
            None if d == 1 else self._add(f"{prefix}_s{axis}", Stride(role, index, axis))
            for axis, d in enumerate(shape)
        )
        return TensorRef(ptr, strides, role, index)

    def scalar(self, index: int) -> str:
        return self._add(f"in{index}_val", Scalar(index))

    def size(self, dim: int | str) -> str:
        """Source text for a dim's size: a literal, or the kernel parameter bound to the symbol."""
        if isinstance(dim, int):
            return str(dim)
        if dim not in self._dims:
            self._dims[dim] = self._add(f"d{len(self._dims)}", DimSize(dim))
        return self._dims[dim]

    def numel(self, shape: Shape, name: str = "numel") -> str:
        if all(isinstance(d, int) for d in shape):
            total = 1
            for d in shape:
                total *= d
            return str(total)
        return self._add(name, Numel(shape))

    def workspace(self, index: int = 0) -> str:
        """The pointer of the kernel's `index`-th workspace, declared once."""
        name = f"work{index or ''}_ptr"
        if any(n == name for n, _ in self.params):
            return name
        return self._add(name, Workspace(index))

    def constexpr(self, name: str) -> str:
        self.constexprs.append(name)
        return name

    def rows_flat(self, role: str, index: int, axes: tuple[int, ...]) -> str:
        """The flag that a tensor's row dims `axes` collapse (`RowsFlat`), one per tensor."""
        name = f"{role}{index}_flat"
        if not any(n == name for n, _ in self.params):
            self._add(name, RowsFlat(index, axes, role))
        return name

    def tma_ready(self, index: int, swapped: bool = False, role: str = "in") -> str:
        """The flag of one tensor's descriptors: one parameter however many operands the
        tensor serves (attention's k and v given the same tensor)."""
        name = f"{role}{index}_tma{'_t' if swapped else ''}"
        if any(n == name for n, _ in self.params):
            return name
        return self._add(name, TmaReady(index, swapped, role))

    def wide(self) -> str:
        """The flag `Wide`, declared once: a body that reads it asks for it here, so no
        kernel names a flag its signature lacks."""
        if not any(isinstance(spec, Wide) for _, spec in self.params):
            self._add("WIDE", Wide())
        return "WIDE"

    def widening(self) -> list[str]:
        """`if WIDE:` and the casts that make every size and stride argument int64, so every
        index and offset computed from them is (see `Wide`); nothing for a kernel without
        any. Adds the flag to the signature."""
        names = [n for n, spec in self.params if isinstance(spec, Stride | DimSize | Numel)]
        if not names:
            return []
        return [f"if {self.wide()}:", *(f"    {n} = tl.cast({n}, tl.int64)" for n in names)]

    def render(self, fn_name: str) -> str:
        names = [f"{n}: tl.constexpr" if isinstance(spec, FLAGS) else n for n, spec in self.params]
        names += [f"{c}: tl.constexpr" for c in self.constexprs]
        return f"def {fn_name}({', '.join(names)}):"

    def dim_comments(self) -> list[str]:
        return [comment(f"{name} = size of dim {sym}") for sym, name in self._dims.items()]


def header(kernel: KernelOp) -> list[str]:
    """Module preamble: what this kernel computes and where it came from (escaped)."""
    lines = [comment(f"tiledsl kernel {kernel.name} ({kernel.template})")]
    for op in kernel.covered:
        where = f" at {op.span.location()}" if op.span is not None else ""
        lines.append(comment(f"  {op.kind} -> {op.type}{where}"))
    lines += ["import triton", "import triton.language as tl", ""]
    return lines


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
