"""The pointwise template: an elementwise region over one iteration space.

Each program handles BLOCK consecutive elements of the (broadcast) output
shape. A flat index is split into per-dim indices only when some input needs
them; each input is read through its own strides, so broadcasting (stride 0
or a literal size-1 dim), transposed views and non-contiguous tensors need no
copies. Outputs are fresh contiguous tensors, stored at the flat index.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl.ir import KernelOp, Op

from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, next_pow2
from .expr import Emitter, Val


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The pointwise program over the flat index (no dots: `allow_tf32` changes nothing)."""
    region = kernel.region
    out_types = region.output_types
    shape = kernel.plan.shape
    rank = len(shape)
    sig = Signature()
    body = Code()
    em = Emitter(body)

    tensors = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
               if not inp.scalar and inp.type.rank > 0}
    scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
    outs = [sig.tensor("out", j, ()).ptr for j in range(len(out_types))]
    total = sig.numel(shape)
    block = sig.constexpr("BLOCK")

    body(PROGRAM_ID)
    body(f"offs = pid.to(tl.int64) * {block} + tl.arange(0, {block})")
    body(f"mask = offs < {total}")

    needs_index = any(op.kind == "index" for op in kernel.covered) or any(
        any(s is not None for s in ref.strides) and rank > 1 and region.read_whole(i)
        for i, ref in tensors.items())
    index_names: list[str | None] = [None if d == 1 else f"i{a}" for a, d in enumerate(shape)]
    if rank == 1 and shape[0] != 1:
        index_names = ["offs"]
    elif needs_index:
        decompose(body, "offs", shape, index_names, sig.size, "t")

    em.gather_from(region, tensors, sig.size)
    inputs: dict[int, Val] = {}
    for i, inp in enumerate(region.inputs):
        if i in scalars:
            inputs[i] = em.scalar(scalars[i], inp.type.dtype)
            continue
        if i not in tensors:  # a 0-dim tensor
            inputs[i] = em.load_at(sig.tensor("in", i, ()).ptr, None, inp.type)
            continue
        ref = tensors[i]
        if region.read_whole(i):
            offset = ref.offset(index_names[rank - inp.type.rank:])
            inputs[i] = (em.load_at(ref.ptr, None, inp.type) if offset == "0"
                         else em.load_at(f"{ref.ptr} + {offset}", "mask", inp.type))

    def index(op: Op) -> Val:
        axis = op.attr("axis")
        return em.index(None if op.shape[axis] == 1 else index_names[axis + rank - len(op.shape)])

    vals = em.run(region, inputs, index)
    for j, (value, t) in enumerate(zip(region.outputs, out_types, strict=True)):
        body(f"tl.store({outs[j]} + offs, {em.store_value(vals[value], t)}, mask=mask)")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        n = numel(shape, dims)
        blk = max(16, min(next_pow2(n), CAPS[device]["flat"]))
        return LaunchConfig((cdiv(n, blk),), {"BLOCK": blk}, num_warps=4)

    return finish(kernel, sig, body, configure, em, programs=f"tl.cdiv({total}, {block})")
