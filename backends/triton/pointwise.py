"""The pointwise template: an elementwise region over one iteration space.

Each program handles BLOCK consecutive elements of the (broadcast) output
shape. A flat index is split into per-dim indices only when some input needs
them; each input is read through its own strides, so broadcasting (stride 0
or a literal size-1 dim), transposed views and non-contiguous tensors need no
copies. Outputs are fresh contiguous tensors, stored at the flat index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from tiledsl import ops
from tiledsl.ir import KernelOp, Op, Region

from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, TensorRef, next_pow2
from .expr import Emitter, Val

# the shortest last axis a pointwise program walks by rows (`FlatProgram._tiled`)
TILED_ROW = 16


class FlatProgram:
    """A program over BLOCK consecutive elements of the flat index of `shape` (the pointwise
    and the indexed templates): its signature (the region's inputs, then the outputs `outs`
    declares, then the element count and BLOCK), the per-dim indices when `split` (or the
    flat one for rank 1), the inputs read there, and the `index` ops' values."""

    def __init__(self, region: Region, shape: tuple, outs: Callable[[Signature], list],
                 split: Callable[[Mapping[int, TensorRef]], bool], tiled: bool = False) -> None:
        self.region, self.shape = region, shape
        self.sig, self.body = sig, body = Signature(), Code()
        self.em = Emitter(body)
        self.tensors = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
                        if not inp.scalar and inp.type.rank > 0}
        self.scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
        self.outs = outs(sig)
        self.total = sig.numel(shape)
        self.block = sig.constexpr("BLOCK")
        body(PROGRAM_ID)
        rank = len(shape)
        self.index_names: list[str | None] = [None if d == 1 else f"i{a}" for a, d in enumerate(shape)]
        self.programs = f"tl.cdiv({self.total}, {self.block})"
        self.axis: int | None = None  # a tile's row axis (`_tiled`)
        if rank == 1 and shape[0] != 1:
            self.index_names = ["offs"]
            self._flat()
        elif split(self.tensors):
            # per-dim indices: by rows of the last axis when the launch says so (`TILED`)
            tiled = tiled and shape[-1] != 1 and any(d != 1 for d in shape[:-1])
            if tiled:
                self._tiled()
                body("else:")
            with body.indent() if tiled else contextlib.nullcontext():
                self._flat()
                decompose(body, "offs", shape, self.index_names, sig.size, "t")
        else:
            self._flat()
        self.em.gather_from(region, self.tensors, sig.size)
        self.em.mask = "mask"

    def _flat(self) -> None:
        self.body(f"offs = pid.to(tl.int64) * {self.block} + tl.arange(0, {self.block})")
        self.body(f"mask = offs < {self.total}")
        self.body("cmask = mask")
        self.body("omask = mask")
        self.body("smask = mask")

    def tile_axis(self) -> int:
        """The axis a tile's rows run along: the one most inputs read alike along (are
        broadcast along: RoPE's cos and sin along the heads, so a tile of one token's heads
        reads them once), else the last before the row's (rows contiguous in memory)."""
        shape, region = self.shape, self.region
        rank = len(shape)

        def broadcast(axis: int) -> int:
            count = 0
            for i in self.tensors:
                t = region.inputs[i].type
                k = axis - (rank - t.rank)
                count += region.read_whole(i) and (k < 0 or t.shape[k] == 1)
            return count

        candidates = [a for a in range(rank - 1) if shape[a] != 1]
        return max(reversed(candidates), key=broadcast)

    def _tiled(self) -> None:
        """A [BLOCK_O, BLOCK_R] tile: BLOCK_R positions of the last axis (a row's vector
        loads) by BLOCK_O of the tile axis (`tile_axis`), the other axes one position a
        program. Indices, masks and gathers along the row (rotate-half's other half) are
        computed once per row or column of the tile, not per element, and an input read
        alike along the tile axis is loaded once per column."""
        sig, body, shape = self.sig, self.body, self.shape
        rank = len(shape)
        self.axis = t = self.tile_axis()
        flag, block_o, block_r = (sig.constexpr(n) for n in ("TILED", "BLOCK_O", "BLOCK_R"))
        last, along = sig.size(shape[-1]), sig.size(shape[t])
        others = [a for a in range(rank - 1) if a != t]
        rest = sig.numel(tuple(shape[a] for a in others), "n_rest")
        names = self.index_names
        body(f"if {flag}:")
        with body.indent():
            body(f"n_r = tl.cdiv({last}, {block_r})")
            body(f"n_t = tl.cdiv({along}, {block_o})")
            body(f"r = (pid % n_r) * {block_r} + tl.arange(0, {block_r})")
            body("q = pid // n_r")
            body(f"o = (q % n_t) * {block_o} + tl.arange(0, {block_o})")
            decompose(body, "q // n_t", [shape[a] for a in others], [names[a] for a in others], sig.size, "t")
            body(f"{names[t]} = o[:, None]")
            body(f"{names[-1]} = r[None, :]")
            # the masks of values read along the rows and columns (`mask`), the columns alone
            # (`cmask`), the rows alone (`omask`), neither (`smask`: a program's own element)
            body(f"cmask = (r < {last})[None, :]")
            body(f"omask = (o < {along})[:, None]")
            body("mask = omask & cmask")
            body("smask = pid >= 0")
            offs = None  # the row-major offset of the contiguous output
            for a in range(rank):
                if names[a] is None:
                    continue
                offs = names[a] if offs is None else f"({offs}) * {sig.size(shape[a])} + {names[a]}"
            body(f"offs = {offs}")
        self.programs = (f"({rest} * tl.cdiv({along}, {block_o}) * tl.cdiv({last}, {block_r}) * {flag} "
                         f"+ tl.cdiv({self.total}, {self.block}) * (1 - {flag}))")

    def inputs(self) -> dict[int, Val]:
        """The scalars, 0-dim tensors and inputs read element for element, at the index."""
        region, em, rank = self.region, self.em, len(self.shape)
        vals: dict[int, Val] = {}
        for i, inp in enumerate(region.inputs):
            if i in self.scalars:
                vals[i] = em.scalar(self.scalars[i], inp.type)
            elif i not in self.tensors:  # a 0-dim tensor
                vals[i] = em.load_at(self.sig.tensor("in", i, ()).ptr, None, inp.type)
            elif region.read_whole(i):
                ref = self.tensors[i]
                offset = ref.offset(self.index_names[rank - inp.type.rank:])
                vals[i] = (em.load_at(ref.ptr, None, inp.type) if offset == "0"
                           else em.load_at(f"{ref.ptr} + {offset}", self._mask_of(inp.type), inp.type))
        return vals

    def _mask_of(self, t) -> str:
        """The mask of an input of type t read at the program's positions: a tiled program's
        loads it along the rows and columns it varies along (the same names are `mask` when
        flat)."""
        rank = len(self.shape)
        if self.axis is None:
            return "mask"

        def varies(axis: int) -> bool:
            k = axis - (rank - t.rank)
            return k >= 0 and t.shape[k] != 1

        return {(True, True): "mask", (False, True): "cmask", (True, False): "omask",
                (False, False): "smask"}[(varies(self.axis), varies(rank - 1))]

    def index(self, op: Op) -> Val:
        axis = op.attr("axis")
        rank = len(self.shape)
        if op.shape[axis] == 1:
            return self.em.index(None)
        at = axis + rank - len(op.shape)
        # a position the mask bounds (every one when flat; a tile's rows' and columns', not the
        # tiled program's own position along another axis, a scalar a gather checks itself)
        bounded = self.axis is None or at in (self.axis, rank - 1)
        return self.em.index(self.index_names[at], self.sig.size(self.shape[at]) if bounded else None)


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The pointwise program over the flat index (no dots: `allow_tf32` changes nothing)."""
    region = kernel.region
    out_types = region.output_types
    shape = kernel.plan.shape
    rank = len(shape)

    def needs_index(tensors: Mapping[int, TensorRef]) -> bool:
        return any(op.kind == "index" for op in kernel.covered) or any(
            any(s is not None for s in ref.strides) and rank > 1 and region.read_whole(i)
            for i, ref in tensors.items())

    def outs(sig: Signature) -> list[str]:
        return [sig.tensor("out", j, ()).ptr for j in range(len(out_types))]

    prog = FlatProgram(region, shape, outs, needs_index, tiled=rank > 1)
    tiled = "TILED" in prog.sig.constexprs
    # a gather's index work (per row and column of a tile) spread over a larger tile, unless
    # slow-path or f64 math (tan's libdevice form, an f64 sum) keeps many values live
    wide_tile = any(op.kind == "take" for op in kernel.covered) and not any(
        ops.units(op.kind) >= ops.SLOW_PATH_UNITS or ops.in_f64(op) for op in kernel.covered)
    sig, body, em = prog.sig, prog.body, prog.em
    vals = em.run(region, prog.inputs(), prog.index)
    for j, (value, t) in enumerate(zip(region.outputs, out_types, strict=True)):
        body(f"tl.store({prog.outs[j]} + offs, {em.store_value(vals[value], t)}, mask=mask)")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        n = numel(shape, dims)
        cap = CAPS[device]["flat"]
        blk = max(16, min(next_pow2(n), cap))
        if not tiled:
            return LaunchConfig((cdiv(n, blk),), {"BLOCK": blk}, num_warps=4)
        last, along = numel(shape[-1:], dims), numel(shape[prog.axis:prog.axis + 1], dims)
        block_r = min(next_pow2(last), cap)
        # a tile of 4096 elements for gathers (32 a thread: the per-row and per-column index
        # work spread over more of them), else a flat program's
        tile = 4 * cap if wide_tile else cap
        block_o = max(1, min(tile // block_r, next_pow2(along)))
        # by rows where they fill most of the tile (rotate-half's D = 128 by 32 heads; a row of
        # 17 in a tile of 32 would idle half the lanes: flat)
        by_rows = last >= TILED_ROW and 4 * last >= 3 * cdiv(last, block_r) * block_r \
            and along > 0 and 2 * along >= cdiv(along, block_o) * block_o
        grid = (n // (last * along)) * cdiv(along, block_o) * cdiv(last, block_r) if by_rows else cdiv(n, blk)
        return LaunchConfig((grid,), {"BLOCK": blk, "TILED": int(by_rows), "BLOCK_O": block_o,
                                              "BLOCK_R": block_r}, num_warps=4)

    return finish(kernel, sig, body, configure, em, programs=prog.programs)
