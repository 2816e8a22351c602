"""TMA descriptors for dot operands, shared by the GEMM and attention templates.

An operand read as it is from a tensor (up to three batch dims, no literal
size-1 dim, a half-precision dot) gets `tl.make_tensor_descriptor`s before its
loop, one per way a call may lay it out: as it is (`in<i>_tma`: aligned, unit
last stride) and, when `swappable`, as a transposed view of contiguous rows
(`in<i>_tma_t`: read as those rows and transposed in the kernel). Each call
sets the flags (`launch.argument_function`); Triton compiles the one path they
pick, the pointer path when none is set. Out-of-bounds elements of a
descriptor load arrive as zeros, so these loads need no masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tiledsl.types import DType, TensorType

from .codegen import Code, Signature, TensorRef
from .expr import Emitter


def eligible(t: TensorType, dot: DType) -> bool:
    """Can a descriptor serve a dot operand read as it is from a tensor of type `t`?"""
    return t.dtype is dot and dot is not DType.F32 and 1 not in t.shape and 2 <= t.rank <= 5


@dataclass(frozen=True)
class Descriptors:
    """The descriptors `<name>_desc` (and `<name>_desc_t`) of one operand's source tensor."""

    name: str
    rank: int
    tile: tuple[str, str]  # the block of the source's last two dims, laid out as it is
    flipped: bool  # the operand is that block transposed
    flags: tuple[tuple[str, bool], ...]  # (flag, swapped)


def declare(sig: Signature, body: Code, name: str, index: int, ref: TensorRef, t: TensorType,
            tile: tuple[str, str], flipped: bool = False, swappable: bool = True) -> Descriptors:
    """Emit the descriptors of input `index` (shape `t.shape`, one batch element per block)."""
    flags = []
    for swapped in (False, True) if swappable else (False,):
        flag = sig.tma_ready(index, swapped)
        order = list(range(t.rank))
        block = list(tile)
        if swapped:
            order[-2:] = order[-1], order[-2]
            block.reverse()
        body(f"if {flag}:")
        with body.indent():
            body(f"{name}_desc{'_t' if swapped else ''} = tl.make_tensor_descriptor({ref.ptr}, "
                 f"shape=[{', '.join(sig.size(t.shape[a]) for a in order)}], "
                 f"strides=[{ref.descriptor_strides(order)}], "
                 f"block_shape=[{', '.join(['1'] * (t.rank - 2) + block)}])")
        flags.append((flag, swapped))
    return Descriptors(name, t.rank, tile, flipped, tuple(flags))


def coordinates(batch: list[str | None], at: list[str]) -> str:
    """A descriptor's block coordinates: this program's batch element, then `at` in the last
    two dims. TMA takes int32 coordinates; a kernel computing its indices in int64 (`WIDE`)
    narrows them, exactly, since every dim is below 2^31."""
    return ", ".join([*(f"{b}.to(tl.int32)" for b in batch),
                      *(c if c.isdigit() else f"tl.cast({c}, tl.int32)" for c in at)])


@contextmanager
def load_or_pointers(em: Emitter, desc: Descriptors | None, target: str, at: tuple[str, str],
                     bnames: list[str | None], dot: DType) -> Iterator[None]:
    """Load `target` through one of the descriptors when the call set its flag (the block at
    `at` in the source's last two dims, this program's batch element in the others), else
    the pointer path the `with` body emits."""
    body = em.code
    if desc is None:
        yield
        return
    batch = bnames[len(bnames) - (desc.rank - 2):]
    for i, (flag, swapped) in enumerate(desc.flags):
        tile, coords = list(desc.tile), list(at)
        if swapped:
            tile.reverse()
            coords.reverse()
        body(f"{'if' if i == 0 else 'elif'} {flag}:")
        with body.indent():
            load = f"{desc.name}_desc{'_t' if swapped else ''}.load([{coordinates(batch, coords)}])"
            if desc.rank > 2:
                load += f".reshape([{', '.join(tile)}])"
            body(f"{target} = {f'tl.trans({load})' if desc.flipped != swapped else load}")
            if dot is DType.BF16 or dot.is_f8:  # the interpreter multiplies them as raw bits
                body("if INTERPRETER:")
                with body.indent():
                    body(f"{target} = {em.widen(target, dot)}")
    body("else:")
    with body.indent():
        yield
