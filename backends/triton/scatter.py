"""The indexed template (scatters): values written, or added, at indices they carry (`put` ops).

Each program handles BLOCK consecutive elements of the written values' space, as
the pointwise template does: the elementwise ops that compute the values and
their indices run in registers (a gathered row times a weight, say), then each
`put` stores its values (or adds them with `tl.atomic_add`) at the element its
indices name in its result, which starts at 0 (`plans.zero_filled`). A negative
index counts from the end; an element whose index is out of range is not
written. Adds of f16 and bf16 values go to an f32 result. Atomic adds make the
order of the additions at one element unspecified: float results are not
bitwise reproducible where indices repeat, nor is which write wins.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl.ir import KernelOp, Op
from tiledsl.ops.render import all_of
from tiledsl.types import Compute

from .base import CAPS, PROGRAM_ID, EmittedKernel, Hints, LaunchConfig, cdiv, decompose, finish, numel
from .codegen import Code, Signature, next_pow2
from .expr import Emitter, Val


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The scatter program over the flat index of the written values (no dots)."""
    region, plan = kernel.region, kernel.plan
    shape = plan.shape
    rank = len(shape)
    sig = Signature()
    body = Code()
    em = Emitter(body)

    tensors = {i: sig.tensor("in", i, inp.type.shape) for i, inp in enumerate(region.inputs)
               if not inp.scalar and inp.type.rank > 0}
    scalars = {i: sig.scalar(i) for i, inp in enumerate(region.inputs) if inp.scalar}
    outs = [sig.tensor("out", j, region.value_type(v).shape) for j, v in enumerate(plan.puts)]
    total = sig.numel(shape)
    block = sig.constexpr("BLOCK")

    body(PROGRAM_ID)
    body(f"offs = pid.to(tl.int64) * {block} + tl.arange(0, {block})")
    body(f"mask = offs < {total}")
    index_names: list[str | None] = [None if d == 1 else f"i{a}" for a, d in enumerate(shape)]
    if rank == 1 and shape[0] != 1:
        index_names = ["offs"]
    elif rank > 1:
        decompose(body, "offs", shape, index_names, sig.size, "t")

    em.gather_from(region, tensors, sig.size)
    vals: dict[int, Val] = {}
    for i, inp in enumerate(region.inputs):
        if i in scalars:
            vals[i] = em.scalar(scalars[i], inp.type.dtype)
        elif i not in tensors:  # a 0-dim tensor
            vals[i] = em.load_at(sig.tensor("in", i, ()).ptr, None, inp.type)
        elif region.read_whole(i):
            ref = tensors[i]
            offset = ref.offset(index_names[rank - inp.type.rank:])
            vals[i] = (em.load_at(ref.ptr, None, inp.type) if offset == "0"
                       else em.load_at(f"{ref.ptr} + {offset}", "mask", inp.type))

    def index(op: Op) -> Val:
        axis = op.attr("axis")
        return em.index(None if op.shape[axis] == 1 else index_names[axis + rank - len(op.shape)])

    puts = set(plan.puts)
    em.run(region, vals, index, skip=puts.__contains__)
    n_in = len(region.inputs)
    for out, v in zip(outs, plan.puts, strict=True):
        put = region.ops[v - n_in]
        src, *indices = put.operands
        t = put.op.type
        terms, inside = [], ["mask"]
        for i, d, stride in zip(indices, t.shape, out.strides, strict=True):
            size = sig.size(d)
            i = em.tensor(vals[i])
            j = em.assign(f"tl.where({i.text} < 0, {i.text} + {size}, {i.text}).to(tl.int64)", Compute.I64)
            inside += [f"{j.text} >= 0", f"{j.text} < {size}"]
            if stride is not None:
                terms.append(f"{j.text} * {stride}")
        where = em.assign(all_of(*inside), Compute.BOOL).text
        value = em.store_value(vals[src], t)
        ptrs = " + ".join([out.ptr, *terms])
        if put.op.attr("accumulate"):
            body(f'tl.atomic_add({ptrs}, {value}, mask={where}, sem="relaxed")')
        else:
            body(f"tl.store({ptrs}, {value}, mask={where})")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        n = numel(shape, dims)
        # half the pointwise block: each element carries its indices and their bounds too
        # (1024 f16 adds spill on sm_90)
        blk = max(16, min(next_pow2(n), CAPS[device]["flat"] // 2))
        return LaunchConfig((cdiv(n, blk),), {"BLOCK": blk}, num_warps=4)

    return finish(kernel, sig, body, configure, em)
