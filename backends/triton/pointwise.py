"""The pointwise template: an elementwise region over one iteration space.

Each program handles BLOCK consecutive elements of the (broadcast) output
shape. A flat index is split into per-dim indices only when some input needs
them; each input is read through its own strides, so broadcasting (stride 0
or a literal size-1 dim), transposed views and non-contiguous tensors need no
copies. Outputs are fresh contiguous tensors, stored at the flat index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tiledsl.ir import KernelOp, Op, Region

from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, TensorRef, next_pow2
from .expr import Emitter, Val


class FlatProgram:
    """A program over BLOCK consecutive elements of the flat index of `shape` (the pointwise
    and the indexed templates): its signature (the region's inputs, then the outputs `outs`
    declares, then the element count and BLOCK), the per-dim indices when `split` (or the
    flat one for rank 1), the inputs read there, and the `index` ops' values."""

    def __init__(self, region: Region, shape: tuple, outs: Callable[[Signature], list],
                 split: Callable[[Mapping[int, TensorRef]], bool]) -> None:
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
        body(f"offs = pid.to(tl.int64) * {self.block} + tl.arange(0, {self.block})")
        body(f"mask = offs < {self.total}")
        rank = len(shape)
        self.index_names: list[str | None] = [None if d == 1 else f"i{a}" for a, d in enumerate(shape)]
        if rank == 1 and shape[0] != 1:
            self.index_names = ["offs"]
        elif split(self.tensors):
            decompose(body, "offs", shape, self.index_names, sig.size, "t")
        self.em.gather_from(region, self.tensors, sig.size)

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
                           else em.load_at(f"{ref.ptr} + {offset}", "mask", inp.type))
        return vals

    def index(self, op: Op) -> Val:
        axis = op.attr("axis")
        rank = len(self.shape)
        return self.em.index(None if op.shape[axis] == 1 else self.index_names[axis + rank - len(op.shape)])


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

    prog = FlatProgram(region, shape, outs, needs_index)
    sig, body, em = prog.sig, prog.body, prog.em
    vals = em.run(region, prog.inputs(), prog.index)
    for j, (value, t) in enumerate(zip(region.outputs, out_types, strict=True)):
        body(f"tl.store({prog.outs[j]} + offs, {em.store_value(vals[value], t)}, mask=mask)")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        n = numel(shape, dims)
        blk = max(16, min(next_pow2(n), CAPS[device]["flat"]))
        return LaunchConfig((cdiv(n, blk),), {"BLOCK": blk}, num_warps=4)

    return finish(kernel, sig, body, configure, em, programs=f"tl.cdiv({prog.total}, {prog.block})")
