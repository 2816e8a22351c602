"""IR verifier: the invariants every pass must preserve.

Checked: the graph is acyclic; every node has a payload; every op has its
kind's arity and the type its rule infers from its operands; parameters are
listed in order; exactly one `return`, with no users; every kernel region is
well formed (operands defined before use, types re-inferred, inputs typed as
their producers' results). A violation is a compiler bug and raises
`VerificationError` naming the node and the pass that broke it.
"""

from __future__ import annotations

import networkx as nx

from tiledsl import ops
from tiledsl.diagnostics import InternalError
from tiledsl.ir import Graph, KernelOp, Op, Region
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
    if len(types) != arity:
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
