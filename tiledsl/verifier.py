"""IR verifier: the invariants every pass must preserve.

Checked: the graph is acyclic; every node has a payload; every op has its
kind's arity and the type its rule infers from its operands; parameters are
listed in order; exactly one `return`, with no users; every kernel region is
well formed (operands defined before use, types re-inferred, inputs typed as
their producers' results), and every kernel carries the plan its template
consumes (`plans.TEMPLATES`), consistent with its region (the plan's `verify`).
A violation is a compiler bug and raises `VerificationError` naming the node
and the pass that broke it.
"""

from __future__ import annotations

import networkx as nx

from tiledsl import ops
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op, Region
from tiledsl.plans import TEMPLATES
from tiledsl.types import TensorType


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
    want = TEMPLATES.get(k.template)
    if want is None:
        fail(f"kernel @{k.name} names no template ('{k.template}')", k.span)
    if not isinstance(k.plan, want):
        fail(f"kernel @{k.name} ({k.template}) carries {type(k.plan).__name__}, expected "
             f"{want.__name__}", k.span)
    k.plan.verify(PlanCheck(k, fail))


class PlanCheck:
    """What a plan's `verify` checks it against: its kernel's region, with the checks every
    plan makes (the kind of op a value names) and the way to fail, naming the kernel."""

    def __init__(self, kernel: KernelOp, fail) -> None:
        self.region: Region = kernel.region
        self._kernel, self._fail = kernel, fail
        self._n_in = len(self.region.inputs)

    def fail(self, message: str) -> None:
        self._fail(f"kernel @{self._kernel.name}: {message}", self._kernel.span)

    def part(self, region: Region) -> PlanCheck:
        """The checks of a member's plan against its part of the region (`Region.part`)."""
        return PlanCheck(self._kernel.replace(region=region), self._fail)

    def kind(self, v: int) -> str | None:
        """The kind of the op defining value v; None for an input."""
        if not 0 <= v < self._n_in + len(self.region.ops):
            self.fail(f"its plan names value {v}, which the region does not define")
        return self.region.ops[v - self._n_in].op.kind if v >= self._n_in else None

    def expect(self, v: int, kinds: tuple, role: str) -> None:
        """Value v is defined by an op of one of `kinds` (None: an input)."""
        if self.kind(v) not in kinds:
            self.fail(f"its plan's {role} is {self.kind(v) or 'an input'}")

    def operands(self, v: int) -> tuple[int, ...]:
        """The operands of the op defining value v."""
        return self.region.ops[v - self._n_in].operands
