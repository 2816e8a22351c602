"""Row tiling shared by the reduce and softmax templates.

A value of shape S is viewed as rows along `axis`: the other ("kept") dims
index rows, `axis` indexes positions in a row. A program owns BLOCK_O rows
and walks each row in chunks of BLOCK_R, so rows longer than a block loop and
any axis works: the reduced axis need not be the last or contiguous. Inputs
are read through their strides at the [BLOCK_O, BLOCK_R] tile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tiledsl.ir import Op, Region
from tiledsl.types import Shape, TensorType

from .base import CAPS, LaunchConfig, cdiv, decompose, numel
from .codegen import Code, Signature, TensorRef, next_pow2
from .expr import Emitter, Val


@dataclass
class RowTile:
    """Names and emission helpers for one row-tiled kernel."""

    sig: Signature
    body: Code
    em: Emitter
    shape: Shape  # the shape being walked (the reduction's input)
    axis: int
    kept_index: list[str | None]  # per dim of `shape`: the row-index name (None at `axis`)
    length: str  # source text of the row length

    def tile_indices(self, r: str) -> list[str | None]:
        """Per-dim index expressions at the tile: rows down, positions across."""
        out: list[str | None] = []
        for d, name in enumerate(self.kept_index):
            if d == self.axis:
                out.append(None if self.shape[d] == 1 else f"{r}[None, :]")
            else:
                out.append(None if name is None else f"{name}[:, None]")
        return out

    def pointer(self, ref: TensorRef, rank: int, r: str) -> str | None:
        """Pointers of a tensor at the tile, or None when it is a single element.

        A tensor that does not vary along rows or along positions (a literal
        size-1 dim has no stride) is broadcast to the full tile shape, so
        pointer, mask and value shapes always agree.
        """
        lead = len(self.shape) - rank
        indices = self.tile_indices(r)[lead:]
        offset = ref.offset(indices)
        if offset == "0":
            return None
        used = [i for i, s in zip(indices, ref.strides, strict=True) if i is not None and s is not None]
        ptr = f"{ref.ptr} + {offset}"
        if any(i.endswith("[:, None]") for i in used) and any(i.endswith("[None, :]") for i in used):
            return ptr
        return f"tl.broadcast_to({ptr}, [BLOCK_O, BLOCK_R])"

    def load(self, ref: TensorRef, t: TensorType, r: str, mask: str) -> Val:
        ptr = self.pointer(ref, t.rank, r)
        load = f"tl.load({ref.ptr})" if ptr is None else f"tl.load({ptr}, mask={mask}, other=0)"
        return self.em.load(load, t.dtype)

    def emit_inputs(self, region: Region, refs: Mapping[int, TensorRef],
                    scalars: Mapping[int, str], r: str, mask: str) -> dict[int, Val]:
        vals: dict[int, Val] = {}
        for i, inp in enumerate(region.inputs):
            if i in scalars:
                vals[i] = self.em.scalar(scalars[i], inp.type.dtype)
            else:
                vals[i] = self.load(refs[i], inp.type, r, mask)
        return vals

    def index(self, op: Op, r: str) -> Val:
        """An `index` op evaluated at the tile."""
        axis = op.attr("axis") + len(self.shape) - len(op.shape)
        expr = self.tile_indices(r)[axis]
        if expr is None:
            return Val("0", "i", True, 0)
        return self.em.assign(f"({expr}).to(tl.int32)", "i")


def row_tile(sig: Signature, body: Code, shape: Shape, axis: int) -> RowTile:
    """Emit the program prologue: row ids `o`, their mask, and per-dim row indices."""
    kept = [d for d in range(len(shape)) if d != axis]
    rows = sig.numel(tuple(shape[d] for d in kept), "n_rows")
    length = sig.size(shape[axis])
    body("pid = tl.program_id(0)")
    body("o = pid.to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O)")
    body(f"omask = o < {rows}")
    names: list[str | None] = [None] * len(shape)
    for d in kept:
        names[d] = None if shape[d] == 1 else f"j{d}"
    decompose(body, "o", [shape[d] for d in kept], [names[d] for d in kept], sig.size, "q")
    sig.constexpr("BLOCK_O")
    sig.constexpr("BLOCK_R")
    return RowTile(sig, body, Emitter(body), shape, axis, names, length)


def row_configure(shape: Shape, axis: int):
    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        full = numel(shape, dims)
        length = shape[axis] if isinstance(shape[axis], int) else dims[shape[axis]]
        rows = full // length
        caps = CAPS[device]
        block_r = max(2, min(next_pow2(length), caps["row"]))
        block_o = max(1, min(next_pow2(rows), caps["tile"] // block_r))
        warps = 4 if block_r * block_o <= 2048 else 8
        return LaunchConfig((cdiv(rows, block_o),), {"BLOCK_O": block_o, "BLOCK_R": block_r},
                            num_warps=warps)

    return configure
