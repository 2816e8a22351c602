"""Building the plan a kernel carries, from the region a pass has just formed.

Every pass that forms kernels (the fusion passes and lower-kernels) goes
through `regions.replace_with_kernel`, which outlines the group's region and
asks `plan_kernel` for the plan of its template. The plans themselves, and
what each field means, are in `tiledsl.plans`.
"""

from __future__ import annotations

from collections.abc import Callable

from tiledsl import ops
from tiledsl.ir import Region
from tiledsl.ops import Category
from tiledsl.plans import (
    TEMPLATES,
    AttentionBackwardPlan,
    AttentionPlan,
    DualB,
    GemmPlan,
    Member,
    MergedPlan,
    Plan,
    PointwisePlan,
    RowPlan,
)
from tiledsl.types import broadcast_shapes

from .attention import attention_backward_plan, attention_plan, operand_source
from .legality import (
    PASS_OPS,
    ROW_OPS,
    RowSpace,
    continues_reduction,
    partial_reductions,
    reduced_axes,
    row_layouts,
)


def pointwise_plan(region: Region) -> PointwisePlan:
    shape = broadcast_shapes(*(t.shape for t in region.output_types))
    assert all(t.shape == shape for t in region.output_types), "pointwise outputs share one shape"
    return PointwisePlan(shape)


def row_space(region: Region) -> RowSpace:
    """The space of a row program: the shape of its first reduction's or softmax's operand,
    and the axes it reduces, with the reductions reducing what it leaves (a reduction over
    several axes, one op per axis: `legality.continues_reduction`)."""
    n_in = len(region.inputs)
    for i, rop in enumerate(region.ops):
        if rop.op.kind in ROW_OPS:
            (x,) = rop.operands
            chain, v = [rop.op], n_in + i
            while v not in region.outputs and len(readers := [n_in + k for k, r in enumerate(region.ops)
                                                               if v in r.operands]) == 1 \
                    and continues_reduction(chain[-1], region.ops[readers[0] - n_in].op):
                v = readers[0]
                chain.append(region.ops[v - n_in].op)
            x_type = region.value_type(x)
            return RowSpace(x_type.shape, reduced_axes(x_type.rank, chain))
    raise AssertionError("a row program has at least one reduction or softmax")


def row_plan(region: Region) -> RowPlan:
    space = row_space(region)
    layouts = row_layouts(region, space)
    assert isinstance(layouts, dict), f"not a row program: {layouts.detail}"
    partial = partial_reductions(region, space, layouts)
    n_in = len(region.inputs)
    values = range(n_in + len(region.ops))
    reducing, sources, phases = set(), [], []
    for v in values:
        rop = region.ops[v - n_in] if v >= n_in else None
        operands = rop.operands if rop is not None else ()
        reduces = rop is not None and rop.op.kind in ROW_OPS and v not in partial \
            and bool(space.runs & set(layouts.get(operands[0], ())))
        if reduces:
            reducing.add(v)
            source = operands[0]
            while source in partial:  # the start of a reduction over several axes
                source = region.ops[source - n_in].operands[0]
            sources.append((v, source))
        phases.append(max((phases[o] for o in operands), default=0)
                      + (reduces and rop.op.kind in PASS_OPS))
    return RowPlan(space.shape, space.axes, tuple(layouts.get(v) for v in values),
                   frozenset(reducing), tuple(phases), partial, tuple(sources))


def gemm_plan(region: Region) -> GemmPlan:
    """The first matmul of the region, and any further ones of the same A (a dual GEMM)."""
    n_in = len(region.inputs)
    mm, *more = [n_in + i for i, r in enumerate(region.ops) if ops.category(r.op.kind) is Category.MATMUL]
    a, b = region.ops[mm - n_in].operands
    a_chain, b_chain = frozenset(region.depends(a)), frozenset(region.depends(b))
    duals = []
    for m in more:
        a_m, b_m = region.ops[m - n_in].operands
        assert a_m == a, "the matmuls of a dual GEMM share their A operand"
        chain = frozenset(region.depends(b_m))
        duals.append(DualB(m, b_m, operand_source(region, chain), chain))
    # statistics of A's rows (`hoist-row-scale`'s norms), accumulated in the K loop from the
    # same loaded tiles; the ops they are computed from run there too
    stats = tuple(n_in + i for i, r in enumerate(region.ops) if ops.category(r.op.kind) is Category.REDUCTION)
    stat_chain = frozenset().union(*(region.depends(region.ops[v - n_in].operands[0]) for v in stats))
    prologue = a_chain | b_chain | frozenset().union(*(d.b_prologue for d in duals)) | stat_chain
    matmuls = {mm, *more}
    prologue_only = _prologue_only(region, matmuls | set(stats), prologue)
    epilogue = tuple(v for v in range(n_in, n_in + len(region.ops))
                     if v not in matmuls and v not in prologue_only and v not in stats)
    return GemmPlan(mm, a, b, operand_source(region, a_chain), operand_source(region, b_chain),
                    a_chain, b_chain, prologue_only, epilogue, tuple(duals), stats, stat_chain)


def _prologue_only(region: Region, matmuls: set[int], prologue: frozenset[int]) -> frozenset[int]:
    """Prologue ops whose values the epilogue does not read (an input, a constant or a scalar
    op may feed both an operand and the epilogue, which then computes it again)."""
    n_in, body = len(region.inputs), region.ops
    ops_in = {v for v in prologue if v >= n_in}
    stack = list(region.outputs)
    stack += [o for k, r in enumerate(body) if n_in + k not in ops_in and n_in + k not in matmuls
              for o in r.operands]
    needed: set[int] = set()
    while stack:
        v = stack.pop()
        if v in needed or v in matmuls or v < n_in:
            continue
        needed.add(v)
        stack.extend(body[v - n_in].operands)
    return frozenset(ops_in - needed)


def merged_plan(region: Region) -> MergedPlan:
    """One member per iteration space: the region's independent parts (ops joined by the
    values they pass; a shared input joins nothing), grouped by the space each is planned
    over (a row program's row space and axis, or a pointwise outputs' shape), in the order
    of their first ops (a row space is its shape and every axis it reduces). fuse-horizontal
    merges kernels of different spaces only, so each member is one of the kernels it merged."""
    n_in = len(region.inputs)
    root = list(range(len(region.ops)))

    def find(k: int) -> int:
        while root[k] != k:
            root[k] = root[root[k]]
            k = root[k]
        return k

    for k, rop in enumerate(region.ops):
        for o in rop.operands:
            if o >= n_in:
                root[find(k)] = find(o - n_in)
    parts: dict[int, list[int]] = {}
    for k in range(len(region.ops)):
        parts.setdefault(find(k), []).append(k)
    def part(ks: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], Region]:
        values = tuple(n_in + k for k in sorted(ks))
        inputs = tuple(sorted({o for v in values for o in region.ops[v - n_in].operands if o < n_in}))
        outputs = tuple(j for j, v in enumerate(region.outputs) if v in values)
        return inputs, values, outputs, region.part(inputs, values, outputs)

    spaces: dict[tuple, list[int]] = {}
    for ks in parts.values():
        if any(region.ops[k].op.kind in ROW_OPS for k in ks):
            space = row_space(part(ks)[3])  # its shape and every axis it reduces
            key = (RowPlan.template, space.shape, space.axes)
        else:
            key = (PointwisePlan.template, broadcast_shapes(*(region.value_type(n_in + k).shape for k in ks
                                                   if n_in + k in region.outputs)))
        spaces.setdefault(key, []).extend(ks)
    members = []
    for key, ks in spaces.items():
        inputs, values, outputs, region_part = part(ks)
        members.append(Member(inputs, values, outputs, row_plan(region_part) if key[0] == RowPlan.template
                              else pointwise_plan(region_part)))
    return MergedPlan(tuple(members))


# each template's planner, by its plan class (`plans.TEMPLATES`)
PLANNERS: dict[type[Plan], Callable[[Region], Plan]] = {
    PointwisePlan: pointwise_plan,
    RowPlan: row_plan,
    GemmPlan: gemm_plan,
    AttentionPlan: attention_plan,
    AttentionBackwardPlan: attention_backward_plan,
    MergedPlan: merged_plan,
}


def plan_kernel(template: str, region: Region) -> Plan:
    return PLANNERS[TEMPLATES[template]](region)
