"""Building the plan a kernel carries, from the spec of the pass that formed it.

Every pass that forms kernels (the fusion passes and lower-kernels) goes through
`regions.replace_with_kernel`, which outlines the group's region, renumbers the pass's
spec (`fusion.spec`) as its values and asks `plan_kernel` for the plan. A planner reads
the roles the spec gives and adds facts of the region's dataflow only; it decides no role
again. The plans themselves, and what each field means, are in `tiledsl.plans`.
"""

from __future__ import annotations

from collections.abc import Callable

from tiledsl.ir import Region
from tiledsl.plans import (
    AttentionBackwardPlan,
    AttentionPlan,
    DualB,
    GemmPlan,
    MergedPlan,
    Plan,
    PointwisePlan,
    RowPlan,
    ScatterPlan,
)

from .attention import attention_backward_plan, attention_plan, operand_source
from .legality import (
    PASS_OPS,
    ROW_OPS,
    across_reductions,
    partial_reductions,
    row_layouts,
    selected,
    short_across,
    split_tail,
)
from .spec import GemmSpec, MergedSpec, PointwiseSpec, RowSpec, ScatterSpec, Spec


def pointwise_plan(region: Region, spec: PointwiseSpec) -> PointwisePlan:
    assert all(t.shape == spec.shape for t in region.output_types), "pointwise outputs share one shape"
    return PointwisePlan(spec.shape)


def scatter_plan(region: Region, spec: ScatterSpec) -> ScatterPlan:
    """The puts are the region's outputs; a put_into adding onto a put of the kernel adds into
    its buffer (`into`), and each output starts as the x of the first put of its chain (an
    input), or at 0."""
    n_in = len(region.inputs)
    into, starts = [], []
    for v in region.outputs:
        while region.ops[v - n_in].op.kind == "put_into" and region.ops[v - n_in].operands[0] >= n_in:
            into.append((v, region.ops[v - n_in].operands[0]))
            v = region.ops[v - n_in].operands[0]
        r = region.ops[v - n_in]
        starts.append(r.operands[0] if r.op.kind == "put_into" else None)
    return ScatterPlan(spec.shape, tuple(region.outputs), tuple(starts), tuple(sorted(into)))


def row_plan(region: Region, spec: RowSpec) -> RowPlan:
    """How every value maps onto the space fuse-rows admitted the members against, which
    reductions reduce along it (and which only begin one over several axes, `partial`), and
    how many passes over the row each value waits for."""
    space = spec.space
    layouts = row_layouts(region, space)
    assert isinstance(layouts, dict), f"not a row program: {layouts.detail}"
    partial = partial_reductions(region, space, layouts)
    across, across_reducing = across_reductions(region, space, layouts)
    chosen = frozenset(v for v in selected(region) if space.runs & set(layouts[v]))
    n_in = len(region.inputs)
    values = range(n_in + len(region.ops))
    reducing, sources, phases = set(), [], []
    for v in values:
        rop = region.ops[v - n_in] if v >= n_in else None
        operands = rop.operands if rop is not None else ()
        reduces = rop is not None and rop.op.kind in ROW_OPS and v not in partial \
            and v not in across_reducing and bool(space.runs & set(layouts.get(operands[0], ())))
        if reduces:
            reducing.add(v)
            source = operands[0]
            while source in partial:  # the start of a reduction over several axes
                source = region.ops[source - n_in].operands[0]
            sources.append((v, source))
        phases.append(max((phases[o] for o in operands), default=0)
                      + (reduces and rop.op.kind in PASS_OPS and operands[0] not in chosen))
    split = across is not None and not short_across(space, across)
    tail = split_tail(region, layouts, across_reducing) if split else frozenset()
    assert isinstance(tail, frozenset), f"not a split row program: {getattr(tail, 'detail', tail)}"
    return RowPlan(space.shape, space.axes, tuple(layouts.get(v) for v in values),
                   frozenset(reducing), tuple(phases), partial, tuple(sources), chosen, across,
                   across_reducing, split, tail)


def gemm_plan(region: Region, spec: GemmSpec) -> GemmPlan:
    """The GEMM of the spec's matmul and duals (one accumulator each, over the same A tiles),
    statistics and batch sums; the operands' prologues are the ops their values are computed
    from."""
    n_in = len(region.inputs)
    mm, more, stats = spec.matmul, tuple(sorted(spec.duals)), tuple(sorted(spec.stats))
    sums = spec.batch_sums
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
    stat_chain = frozenset().union(*(region.depends(region.ops[v - n_in].operands[0]) for v in stats))
    prologue = a_chain | b_chain | frozenset().union(*(d.b_prologue for d in duals)) | stat_chain
    matmuls = {mm, *more}
    prologue_only = _prologue_only(region, matmuls | set(stats), prologue)
    # the muls scaling each summed product and the ops computing their factors, at the
    # product's tile inside the batch loop
    scales = frozenset(region.depends(spec.batch_scales[-1]) - region.depends(mm) - set(range(n_in))) \
        if spec.batch_scales else frozenset()
    epilogue = tuple(v for v in range(n_in, n_in + len(region.ops))
                     if v not in matmuls and v not in prologue_only and v not in stats and v not in sums
                     and v not in scales)
    return GemmPlan(mm, a, b, operand_source(region, a_chain), operand_source(region, b_chain),
                    a_chain, b_chain, prologue_only, epilogue, tuple(duals), stats, stat_chain,
                    spec.summed_axes, sums, spec.batch_scales, scales, spec.segment)


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


def merged_plan(region: Region, spec: MergedSpec) -> MergedPlan:
    """The kernels fuse-horizontal merged, each a member with its own plan."""
    return MergedPlan(spec.members)


# each template's planner, by its plan class (`plans.TEMPLATES`)
PLANNERS: dict[type[Plan], Callable[[Region, Spec], Plan]] = {
    PointwisePlan: pointwise_plan,
    RowPlan: row_plan,
    GemmPlan: gemm_plan,
    AttentionPlan: attention_plan,
    AttentionBackwardPlan: attention_backward_plan,
    MergedPlan: merged_plan,
    ScatterPlan: scatter_plan,
}


def plan_kernel(region: Region, spec: Spec) -> Plan:
    """The plan of `region` from the pass's `spec`, in the region's values (`spec.in_region`)."""
    return PLANNERS[spec.plan](region, spec)
