"""The fusion report behind `Program.explain()`.

For each kernel, in launch order: its template, the DSL ops it absorbed and
their lines, its inputs and outputs, and the HBM traffic it moves fused
against the same ops run one kernel each. Then the rewrites that made fusion
possible (values recomputed by their readers), and every fusion that did not
happen: the refusals the passes recorded (with their rule and lines), and,
for any other edge between two kernels, that no fusion pass joins them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from tiledsl import cost, ops
from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.ops.structure import format_items
from tiledsl.passes.distribute_matmul import DistributeMatmul
from tiledsl.passes.fuse_horizontal import FuseHorizontal
from tiledsl.passes.fusion.remarks import FusionRemark, describe
from tiledsl.passes.hoist_row_scale import HoistRowScale
from tiledsl.passes.pipeline import FUSION
from tiledsl.passes.recompute import Recompute
from tiledsl.passes.sink_reshape import SinkReshape
from tiledsl.plans import AttentionBackwardPlan, AttentionPlan, GemmPlan, MergedPlan, RowPlan, ScatterPlan
from tiledsl.types import format_shape

if TYPE_CHECKING:
    from tiledsl.api import Program

# passes whose decisions the kernel list alone does not show: algebraic rewrites, values
# computed again by their readers, independent kernels merged
REWRITE_PASSES = frozenset(p.name for p in (SinkReshape, DistributeMatmul, HoistRowScale, Recompute,
                                            FuseHorizontal))


def _name(graph: Graph, node: int, res: int) -> str:
    op = graph.op(node)
    if isinstance(op, KernelOp):
        return f"{op.name}" + (f"#{res}" if len(op.region.outputs) > 1 else "")
    if op.kind == "param":
        return op.attr("name")
    if op.kind == "transpose":
        (src,) = graph.operand_edges(node)
        return f"{_name(graph, *src)}.T" if op.attr("dims")[1] == op.type.rank - 1 else \
            f"transpose({_name(graph, *src)})"
    if op.kind == "slice":
        (src,) = graph.operand_edges(node)
        return f"{_name(graph, *src)}[{format_items(op.attr('items'))}]"
    if op.kind == "reshape":
        (src,) = graph.operand_edges(node)
        return f"reshape({_name(graph, *src)}, {format_shape(op.shape)})"
    if op.kind == "dim":
        return op.attr("symbol")
    return op.kind


def _traffic(p: cost.Poly, dims: Mapping[str, int] | None) -> str:
    if dims is None:
        return cost.format_poly(p) + " B"
    n = cost.evaluate(p, dims)
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n} B"


def explain(program: Program, dims: Mapping[str, int] | None = None) -> str:
    graph = program.fused_graph()
    # what the kernels that may split launch at these sizes (the backend's launch builder)
    at_sizes = program.runtime.split_launches(dims) if dims is not None else {}
    kernels = [n for n in graph.kernels()]
    n_ops = sum(len(graph.op(k).covered) for k in kernels)
    plural = ("s" if len(kernels) != 1 else "", "s" if n_ops != 1 else "")
    lines = [f"fusion report for @{program.name}",
             f"  pipeline: {program.pipeline}",
             f"  {len(kernels)} kernel{plural[0]} for {n_ops} op{plural[1]}"]
    if not any(p.split("{")[0] in FUSION for p in program.pipeline.split(",")):
        lines.append("  no fusion pass ran: every op is its own kernel")
    fused_total = cost.add(*(cost.kernel_traffic(graph.op(k)) for k in kernels))
    unfused_total = cost.add(*(cost.op_by_op_traffic(graph.op(k).region) for k in kernels))
    lines.append(f"  modeled HBM traffic: {_traffic(fused_total, dims)} fused; "
                 f"{_traffic(unfused_total, dims)} op by op")
    lines.append(f"  saved: {_traffic(cost.sub(unfused_total, fused_total), dims)}")
    lines.append("")
    width = max((len(graph.op(k).name) for k in kernels), default=2)
    for k in kernels:
        op: KernelOp = graph.op(k)
        ops = ", ".join(describe(o) for o in op.covered) or "copy"
        lines.append(f"  {op.name:<{width}}  {op.template:<9} {ops}")
        ins = [f"{_name(graph, *e)}: {t.type}{' (by value)' if t.scalar else ''}"
               for e, t in zip(graph.operand_edges(k), op.region.inputs, strict=True)]
        lines.append(f"  {'':<{width}}    in:  {', '.join(ins) or '-'}")
        outs = []
        for r, t in enumerate(op.result_types):
            users = sorted({_user_name(graph, u) for u, slot in graph.users(k)
                            if graph.operand_edges(u)[slot] == (k, r)})
            # (a merged launch's result that only a later member's combine reads)
            order = op.out_order(r)
            stored = "" if order is None else \
                f" stored as [{', '.join(str(t.shape[a]) for a in order)}]"  # (lower-kernels' layout)
            if isinstance(op.plan, ScatterPlan) and (i := op.plan.starts[r]) is not None:
                how = "written in place of" if op.plan.in_place and op.plan.in_place[r] else \
                    "starting as a copy of"
                stored += f" {how} {_name(graph, *graph.operand_edges(k)[i])}"
            outs.append(f"{t}{stored} -> {', '.join(users) or f'{op.name} (a combine)'}")
        lines.append(f"  {'':<{width}}    out: {'; '.join(outs)}")
        if isinstance(op.plan, (AttentionPlan, AttentionBackwardPlan)):
            lines.append(f"  {'':<{width}}    structure: {_attention_structure(op)}")
        if isinstance(op.plan, AttentionPlan):
            lines.append(f"  {'':<{width}}    launches: {_attention_launches(op.plan)}")
        if isinstance(op.plan, GemmPlan) and op.plan.batch_scales:
            n_in = len(op.region.inputs)
            scales = ", ".join(describe(op.region.ops[v - n_in].op) for v in op.plan.batch_scales)
            lines.append(f"  {'':<{width}}    structure: each summed batch element's product scaled "
                         f"({scales}) before the accumulator adds it")
        if isinstance(op.plan, GemmPlan) and op.plan.segment is not None:
            n_in = len(op.region.inputs)
            rows = op.region.value_type(op.plan.matmul).shape[-3]
            index = describe(op.region.ops[op.plan.segment - n_in].op)
            pad = " " * width
            lines.append(f"  {pad}    structure: grouped GEMM: a tile's rows are elements of {rows}, and "
                         f"each value of {index} among them multiplies its rows by the B matrix it "
                         "selects (one or two a tile where the rows are sorted by it): every B tile is "
                         "loaded once a row tile")
            lines.append(f"  {pad}    launches: 1 (its K loop runs once for each value a tile's rows hold; "
                         "never split)")
        elif isinstance(op.plan, GemmPlan):
            steps = "the K loop of every summed batch element" if op.plan.batch_sums else "the K loop"
            lines.append(f"  {'':<{width}}    launches: 1, or 2 where its output tiles alone cannot fill "
                         f"the GPU (split-K: programs share {steps}, each leaving the partial "
                         "products of its range of it; a combine launch adds them in range order, then "
                         "runs the epilogue)")
        if isinstance(op.plan, RowPlan) and op.plan.split:
            dim = op.plan.shape[op.plan.across]
            reductions = ", ".join(describe(op.region.ops[v - len(op.region.inputs)].op)
                                   for v in sorted(op.plan.across_reducing))
            lines.append(f"  {'':<{width}}    launches: 2 (split: {reductions} across its rows along "
                         f"{dim}, as partials over chunks of rows; a combine launch merges them in "
                         "chunk order)")
        if isinstance(op.plan, MergedPlan) and (split := [m for m in op.plan.members
                                                          if isinstance(m.plan, RowPlan) and m.plan.split]):
            n_in = len(op.region.inputs)
            names = ", ".join(describe(op.region.ops[m.values[v - len(m.inputs)] - n_in].op)
                              for m in split for v in sorted(m.plan.across_reducing))
            lines.append(f"  {'':<{width}}    launches: {1 + len(split)} (its members' programs, then the "
                         f"combine of each split one, in order, merging its partials: {names})")
        if op.name in at_sizes:
            lines.append(f"  {'':<{width}}    at these sizes: {at_sizes[op.name]}")
        fused, alone = cost.kernel_traffic(op), cost.op_by_op_traffic(op.region)
        lines.append(f"  {'':<{width}}    traffic: {_traffic(fused, dims)}"
                     + (f" (op by op: {_traffic(alone, dims)})" if alone != fused else ""))
    lines.append("")
    rewrites = [r for r in program.remarks if isinstance(r, FusionRemark) and r.fused
                and r.pass_name in REWRITE_PASSES]
    if rewrites:
        lines.append("rewrites:")
        lines.extend(f"  {r}" for r in rewrites)
        lines.append("")
    refusals = _refusals(program, graph)
    if refusals:
        lines.append("fusions not made:")
        lines.extend(f"  {r}" for r in refusals)
    else:
        lines.append("fusions not made: none")
    return "\n".join(lines) + "\n"


def _attention_launches(plan: AttentionPlan) -> str:
    """The launches an attention kernel makes: split-KV where its plan allows it."""
    if not plan.kv_split:
        return ("1 (the keys are not split: it stores P, normalised by the statistics of every "
                "key in a second walk)")
    return ("1, or 2 where its (query block, batch) programs alone cannot fill the GPU (split-KV: "
            "each program walks a range of the keys; a combine launch merges their outputs by "
            "their log-sum-exp in range order, then runs the epilogue)")


def _attention_structure(kernel: KernelOp) -> str:
    """Which op of an attention kernel plays which role, in region order."""
    parts = kernel.plan
    n_in = len(kernel.region.inputs)
    roles: dict[str, list[str]] = {}
    for i, rop in enumerate(kernel.region.ops):
        if rop.op.kind not in ("const", "transpose"):
            roles.setdefault(parts.role(n_in + i), []).append(describe(rop.op))
    text = "; ".join(f"{role}: {', '.join(ops)}" for role, ops in roles.items())
    if isinstance(parts, AttentionBackwardPlan):
        own, walk = ("key", "query") if parts.over == "queries" else ("query", "key")
        text += f"; one program per {own} block walks the {walk} blocks"
        if parts.walked:
            axes = ", ".join(str(a) for a in parts.walked)
            noun = "axis" if len(parts.walked) == 1 else "axes"
            text += f" and batch {noun} {axes} of the scores (the query heads sharing a key/value head)"
        text += ", scores recomputed per tile"
        if parts.bound is not None:
            text += f"; {walk} blocks outside the mask's bound, where every value it sums or stores is 0, " \
                "are skipped"
            if parts.bound.exact and parts.bound.lower is None and parts.bound_cond is not None:
                text += ", blocks inside it for every row run without the mask"
        return text
    if parts.bound is not None:
        text += "; key blocks past the mask's bound are skipped"
        if parts.bound.lower is not None:
            text += ", and those before its window"
        if parts.bound.exact:
            text += ", blocks inside it for every row run without the mask"
    return text


def _user_name(graph: Graph, node: int) -> str:
    op = graph.op(node)
    if isinstance(op, KernelOp):
        return op.name
    return "return" if op.kind == "return" else _name(graph, node, 0)


def _refusals(program: Program, graph: Graph) -> list[str]:
    """Recorded refusals, then every kernel-to-kernel edge that no remark explains."""
    remarks = [r for r in program.remarks if isinstance(r, FusionRemark) and not r.fused]
    out = [str(r) for r in remarks]
    covered = {(r.producer, r.consumer) for r in remarks}
    for node in graph.kernels():
        consumer: KernelOp = graph.op(node)
        region = consumer.region
        for slot, (src, res) in enumerate(graph.operand_edges(node)):
            src, res = _through_views(graph, src, res)
            producer = graph.op(src)
            if not isinstance(producer, KernelOp):
                continue
            prod_op = _producing_op(producer, res)
            for rop in region.ops:
                if slot in rop.operands and (prod_op, rop.op) not in covered:
                    covered.add((prod_op, rop.op))
                    out.append(f"{describe(prod_op)} -> {describe(rop.op)}: no fusion pass joins "
                               f"{_a(producer.template)} kernel ({producer.name}) to "
                               f"{_a(consumer.template)} kernel ({consumer.name}) [rule: op]")
    return out


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _through_views(graph: Graph, node: int, res: int) -> tuple[int, int]:
    op = graph.op(node)
    while isinstance(op, Op) and ops.category(op.kind) is ops.Category.LAYOUT:
        node, res = graph.operand_edges(node)[0]
        op = graph.op(node)
    return node, res


def _producing_op(kernel: KernelOp, res: int) -> Op:
    value = kernel.region.outputs[res]
    n_in = len(kernel.region.inputs)
    return kernel.region.ops[value - n_in].op if value >= n_in else kernel.region.ops[0].op
