"""Deterministic text form of the graph IR and the fused IR.

Names are assigned at print time: parameters print as `%name`, other values
as `%0, %1, ...` in a topological order that breaks ties by creation order, so
the same program always prints the same text (golden tests rely on it).

    func @rmsnorm(%x: f32[M, N], %w: f32[N], %eps: f32) -> (f32[M, N]) {
      %0 = mul %x, %x : f32[M, N]
      %1 = mean %0 {axis = 1, keepdims = true} : f32[M, 1]
      ...
      return %5
    }

Kernel nodes of the fused IR print their region indented under them, and
the plan the pass that formed the kernel recorded (`tiledsl.plans`):

      %2 = kernel @k1 rows(%0) : f32[M, 1] {
      ^(%a0: f32[M, N]):
        %r0 = mean %a0 {axis = 1, keepdims = true} : f32[M, 1]
        yield %r0
        plan rows {space = [M, N], axis = 1, phases = 1, reducing = (%r0), layouts = (...)}
      }
"""

from __future__ import annotations

import math

from tiledsl.ir import Graph, KernelOp, Op, Region
from tiledsl.ops.structure import format_items
from tiledsl.plans import Plan
from tiledsl.types import DType, TensorType

# attrs that are implied by the result type or the signature
_HIDDEN_ATTRS = {"type", "name", "index", "scalar", "shape"}


def format_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if math.isnan(value):
            return "nan"
        return repr(value)
    if isinstance(value, DType):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(format_value(v) for v in value) + ")"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _attrs(op: Op) -> str:
    shown = [(k, v) for k, v in op.attrs if k not in _HIDDEN_ATTRS]
    if op.kind in ("const", "dim"):
        shown = []
    if not shown:
        return ""
    return " {" + ", ".join(f"{k} = [{format_items(v)}]" if k == "items" else f"{k} = {format_value(v)}"
                            for k, v in shown) + "}"


def _loc(op: Op | KernelOp, locations: bool) -> str:
    if not locations or op.span is None:
        return ""
    return f"  loc({op.span.line}:{op.span.column})"


def _op_head(op: Op, operands: list[str]) -> str:
    if op.kind == "const":
        return f"const {format_value(op.attr('value'))}"
    if op.kind == "dim":
        return f"dim {op.attr('symbol')}"
    return op.kind + (" " + ", ".join(operands) if operands else "")


def print_graph(graph: Graph, locations: bool = False) -> str:
    names: dict[tuple[int, int], str] = {}
    for p in graph.params:
        names[(p, 0)] = "%" + graph.op(p).attr("name")
    sig = ", ".join(f"{names[(p, 0)]}: {graph.op(p).attr('type')}" for p in graph.params)
    results = ", ".join(str(t) for t in graph.returns)
    hints = ""
    if graph.hints:
        hints = " attributes {" + ", ".join(
            f"{k} = {v}" for k, (v, _) in sorted(graph.hints.items())) + "}"
    lines = [f"func @{graph.name}({sig}) -> ({results}){hints} {{"]
    counter = 0
    for node in graph.topo_order():
        op = graph.op(node)
        if isinstance(op, Op) and op.kind == "param":
            continue
        args = [names[e] if e[1] == 0 or e in names else names[(e[0], 0)] + f"#{e[1]}"
                for e in graph.operand_edges(node)]
        if isinstance(op, Op) and op.kind == "return":
            lines.append("  return " + ", ".join(args) + _loc(op, locations))
            continue
        name = f"%{counter}"
        counter += 1
        if isinstance(op, KernelOp):
            n_out = len(op.region.outputs)
            for r in range(n_out):
                names[(node, r)] = name if r == 0 else f"{name}#{r}"
            lhs = name if n_out == 1 else f"{name}:{n_out}"
            types = ", ".join(str(t) + ("" if op.out_order(r) is None else
                                        f" stored {format_value(op.out_order(r))}")
                              for r, t in enumerate(op.result_types))
            lines.append(f"  {lhs} = kernel @{op.name} {op.template}({', '.join(args)}) : "
                         f"{types}{_loc(op, locations)} {{")
            lines.extend("  " + line for line in print_region(op.region, locations, op.plan))
            lines.append("  }")
        else:
            names[(node, 0)] = name
            mark = "  // recomputed by each reader" if graph.recomputed(node) else ""
            if graph.score_space(node) is not None:
                mark += f"  // {graph.score_space(node)}"
            lines.append(f"  {name} = {_op_head(op, args)}{_attrs(op)} : {op.type}"
                         f"{_loc(op, locations)}{mark}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_region(region: Region, locations: bool = False, plan: Plan | None = None) -> list[str]:
    """A region's lines; with its kernel's plan, the plan after the yield."""
    names = [f"%a{i}" for i in range(len(region.inputs))]
    sig = ", ".join(f"{names[i]}: {_input_type(inp.type, inp.scalar)}"
                    for i, inp in enumerate(region.inputs))
    lines = [f"^({sig}):"]
    for i, rop in enumerate(region.ops):
        name = f"%r{i}"
        names.append(name)
        operands = [names[v] for v in rop.operands]
        lines.append(f"  {name} = {_op_head(rop.op, operands)}{_attrs(rop.op)} : {rop.op.type}"
                     f"{_loc(rop.op, locations)}")
    lines.append("  yield " + ", ".join(names[v] for v in region.outputs))
    if plan is not None:
        lines.append("  " + plan.format(names.__getitem__))
    return lines


def _input_type(t: TensorType, scalar: bool) -> str:
    return f"{t} (by value)" if scalar else str(t)
