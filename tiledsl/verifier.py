"""IR verifier: the invariants every pass must preserve.

Checked: the graph is acyclic; every node has a payload; every op has its
kind's arity and the type its rule infers from its operands; parameters are
listed in order; exactly one `return`, with no users; every kernel region is
well formed (operands defined before use, types re-inferred, inputs typed as
their producers' results), and every kernel carries the plan its template
consumes, consistent with its region. A violation is a compiler bug and raises
`VerificationError` naming the node and the pass that broke it.
"""

from __future__ import annotations

import networkx as nx

from tiledsl import ops
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op, Region
from tiledsl.plans import PLAN_TYPES, AttentionBackwardPlan, AttentionPlan, GemmPlan, PointwisePlan, RowPlan
from tiledsl.types import DType, TensorType


class VerificationError(InternalError):
    template = "IR verification failed{after}: {message}"


def verify(graph: Graph, after: str | None = None) -> None:
    where = f" after pass '{after}'" if after else ""

    def fail(message: str, span=None) -> None:
        raise VerificationError(span, after=where, message=message)

    if not nx.is_directed_acyclic_graph(graph.nx):
        fail("the graph has a cycle")
    returns = [n for n in graph.nodes() if graph.op(n).kind == "return"]
    if len(returns) != 1 or returns[0] != graph.output:
        fail(f"expected exactly one return node, found {len(returns)}")
    if graph.nx.out_degree(graph.output):
        fail("the return node has users")
    params = sorted((n for n in graph.nodes() if graph.op(n).kind == "param"),
                    key=lambda n: graph.op(n).attr("index"))
    if params != graph.params:
        fail("the parameter list does not match the param nodes")

    for node in graph.nodes():
        op = graph.op(node)
        edges = graph.operand_edges(node)
        slots = sorted(k for _, _, k in graph.nx.in_edges(node, keys=True))
        if slots != list(range(len(slots))):
            fail(f"node {node} has operand slots {slots}", op.span)
        types = []
        for src, res in edges:
            producer = graph.op(src)
            if isinstance(producer, KernelOp):
                if res >= len(producer.region.outputs):
                    fail(f"node {node} uses result {res} of kernel @{producer.name}", op.span)
                types.append(producer.result_types[res])
            else:
                if res != 0:
                    fail(f"node {node} uses result {res} of a single-result op", op.span)
                types.append(producer.type)
        if isinstance(op, KernelOp):
            _verify_kernel(op, tuple(types), fail)
        elif isinstance(op, Op):
            if op.kind not in ops.OPS:
                fail(f"unknown op kind '{op.kind}'", op.span)
            if op.kind != "return":
                _verify_op(op, tuple(types), f"node {node}", fail)
        else:
            fail(f"node {node} has no op payload")


def _verify_op(op: Op, types: tuple[TensorType, ...], what: str, fail) -> None:
    arity = ops.OPS[op.kind].arity
    if arity >= 0 and len(types) != arity:  # -1: any number (the type rule checks)
        fail(f"{what} ({op.kind}) has {len(types)} operands, expected {arity}", op.span)
    try:
        inferred = ops.infer(op.kind, types, op.attr_map)
    except ops.RuleError as err:
        fail(f"{what} ({op.kind}) is ill-typed: {err}", op.span)
        return
    if inferred != op.type:
        fail(f"{what} ({op.kind}) has type {op.type}, but its operands give {inferred}", op.span)


def _verify_kernel(k: KernelOp, types: tuple[TensorType, ...], fail) -> None:
    region: Region = k.region
    if len(types) != len(region.inputs):
        fail(f"kernel @{k.name} has {len(types)} operands for {len(region.inputs)} inputs", k.span)
    for i, (given, inp) in enumerate(zip(types, region.inputs, strict=False)):
        if given != inp.type:
            fail(f"kernel @{k.name} input {i} is {inp.type} but its operand is {given}", k.span)
    n = len(region.inputs)
    for i, rop in enumerate(region.ops):
        for v in rop.operands:
            if not 0 <= v < n + i:
                fail(f"kernel @{k.name} op {i} uses value {v} before it is defined", k.span)
        operand_types = tuple(region.value_type(v) for v in rop.operands)
        _verify_op(rop.op, operand_types, f"kernel @{k.name} op {i}", fail)
    for v in region.outputs:
        if not 0 <= v < n + len(region.ops):
            fail(f"kernel @{k.name} yields undefined value {v}", k.span)
    _verify_plan(k, fail)


def _verify_plan(k: KernelOp, fail) -> None:
    region, plan = k.region, k.plan
    want = PLAN_TYPES.get(k.template)
    if want is None:
        fail(f"kernel @{k.name} names no template ('{k.template}')", k.span)
    if not isinstance(plan, want):
        fail(f"kernel @{k.name} ({k.template}) carries {type(plan).__name__}, expected "
             f"{want.__name__}", k.span)
    n_in, n_values = len(region.inputs), len(region.inputs) + len(region.ops)

    def kind(v: int) -> str | None:
        if not 0 <= v < n_values:
            fail(f"kernel @{k.name}: its plan names value {v}, which the region does not define",
                 k.span)
        return region.ops[v - n_in].op.kind if v >= n_in else None

    def expect(v: int, kinds: tuple, role: str) -> None:
        if kind(v) not in kinds:
            fail(f"kernel @{k.name}: its plan's {role} is {kind(v) or 'an input'}", k.span)

    if isinstance(plan, PointwisePlan):
        if any(t.shape != plan.shape for t in region.output_types):
            fail(f"kernel @{k.name}: an output does not have the plan's shape", k.span)
    elif isinstance(plan, RowPlan):
        if not (len(plan.layouts) == len(plan.phases) == n_values and 0 <= plan.axis < len(plan.shape)):
            fail(f"kernel @{k.name}: its row plan does not cover its region", k.span)
        for v, layout in enumerate(plan.layouts):
            if layout is not None and len(layout) != region.value_type(v).rank:
                fail(f"kernel @{k.name}: value {v} has a layout of the wrong rank", k.span)
        for v in plan.reducing:
            expect(v, ops.ROW_KINDS, "reduction")
    elif isinstance(plan, GemmPlan):
        expect(plan.matmul, ("matmul",), "matmul")
        if region.ops[plan.matmul - n_in].operands != (plan.a, plan.b):
            fail(f"kernel @{k.name}: its plan's operands are not the matmul's", k.span)
        for d in plan.duals:
            expect(d.matmul, ("matmul",), "dual matmul")
            if region.ops[d.matmul - n_in].operands != (plan.a, d.b):
                fail(f"kernel @{k.name}: a dual matmul does not share the A operand", k.span)
        for source, chain in ((plan.a_source, plan.a_prologue), (plan.b_source, plan.b_prologue),
                              *((d.b_source, d.b_prologue) for d in plan.duals)):
            expect(source, (None,), "operand source")
            if source not in chain:
                fail(f"kernel @{k.name}: an operand source is outside its prologue", k.span)
        for v in plan.epilogue:
            kind(v)
    elif isinstance(plan, AttentionPlan):
        expect(plan.qk, ("matmul",), "q @ k.T")
        expect(plan.pv, ("matmul",), "p @ v")
        if plan.softmax is None:  # p @ v multiplies the scores themselves
            if region.ops[plan.pv - n_in].operands != (plan.scores, plan.v):
                fail(f"kernel @{k.name}: its attention plan does not match p @ v", k.span)
            for v in plan.row_sums:
                expect(v, ("sum",), "sum over the keys")
            if plan.bound_cond is not None and region.value_type(plan.bound_cond).dtype is not DType.BOOL:
                fail(f"kernel @{k.name}: its attention plan's mask condition is not a bool", k.span)
        else:
            expect(plan.softmax, ("softmax",), "softmax")
            p = plan.softmax if plan.p_cast is None else plan.p_cast
            if plan.p_cast is not None:
                expect(plan.p_cast, ("cast",), "the cast of p")
                if region.ops[plan.p_cast - n_in].operands != (plan.softmax,):
                    fail(f"kernel @{k.name}: its attention plan's cast of p does not read the softmax",
                         k.span)
            if region.ops[plan.pv - n_in].operands != (p, plan.v) \
                    or region.ops[plan.softmax - n_in].operands != (plan.scores,):
                fail(f"kernel @{k.name}: its attention plan does not match p @ v", k.span)
        for v in (plan.q_source, plan.k_source, plan.v):
            expect(v, (None,), "q, k or v")
        for v in (*plan.score_ops, *plan.lse, *plan.epilogue):
            kind(v)
        for v in plan.lse_casts:
            expect(v, ("cast",), "widening of the scores")
    elif isinstance(plan, AttentionBackwardPlan):
        for d in plan.dots:
            expect(d.matmul, ("matmul",), "score dot")
            expect(d.a_source, (None,), "score dot operand")
            expect(d.b_source, (None,), "score dot operand")
        for p in plan.products:
            expect(p.matmul, ("matmul",), "product")
            expect(p.y if p.y_source is None else p.y_source, (None,), "product operand")
        if not plan.products or plan.over not in ("queries", "keys"):
            fail(f"kernel @{k.name}: its attention backward plan has no product", k.span)
        for v in (*plan.score_ops, *plan.epilogue):
            kind(v)
        for v in plan.prologues:
            kind(v)
        for r in plan.reductions:
            for v in r.sums:
                expect(v, ("sum", "reshape"), "reduction chain")
            expect(r.result, ("sum",), "reduction")
            if r.result not in region.outputs or region.value_type(r.result).dtype is not DType.F32:
                fail(f"kernel @{k.name}: its reduction {r.result} is not an f32 output the "
                     "programs add into", k.span)
