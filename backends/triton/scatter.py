"""The indexed template (scatters): values written, or added, at indices they carry (`put` ops).

Each program handles BLOCK consecutive elements of the written values' space, as
the pointwise template does: the elementwise ops that compute the values and
their indices run in registers (a gathered row times a weight, say), then each
`put` stores its values (or adds them with `tl.atomic_add`) at the element its
indices name in its result, which starts at 0 (`plans.zero_filled`), or as a copy of the
x of a `put_into` (the out-of-place scatter; the launch copies it first); a put_into adding
onto a put of the kernel adds into that put's buffer (`ScatterPlan.into`). A negative
index counts from the end; an element whose index is out of range is not
written. Adds of f16 and bf16 values go to an f32 result. Atomic adds make the
order of the additions at one element unspecified: float results are not
bitwise reproducible where indices repeat, nor is which write wins.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl import ops
from tiledsl.ir import KernelOp
from tiledsl.types import Compute

from .base import CAPS, EmittedKernel, Hints, LaunchConfig, cdiv, finish, numel
from .codegen import next_pow2
from .pointwise import FlatProgram
from .render import all_of


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    """The scatter program over the flat index of the written values (no dots)."""
    region, plan = kernel.region, kernel.plan
    shape = plan.shape
    prog = FlatProgram(region, shape, lambda sig: [sig.tensor("out", j, region.value_type(v).shape)
                                                   for j, v in enumerate(plan.puts)], lambda tensors: True)
    sig, body, em, outs = prog.sig, prog.body, prog.em, prog.outs
    vals = prog.inputs()
    buffers = plan.buffers()
    em.run(region, vals, prog.index, skip=buffers.__contains__)
    n_in = len(region.inputs)
    out_of = dict(zip(plan.puts, outs, strict=True))
    for v in sorted(buffers):  # each put, into its output's buffer (a chain of adds: one)
        out = out_of[buffers[v]]
        put = region.ops[v - n_in]
        src, *indices = put.operands[ops.WRITTEN[put.op.kind]:]
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
        if all(d == 1 for i in indices for d in region.value_type(i).shape):
            ptrs += " + 0 * offs"  # one element of the result: a pointer per lane all the same
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
