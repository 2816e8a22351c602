"""fuse-epilogue: a matmul and the elementwise ops around it become one GEMM kernel.

Before: `matmul` then elementwise ops on its result, each its own kernel
(composable-kernel's `(a @ b) * d * e` is three).
After: one `matmul` kernel per matmul whose region holds
- the epilogue: every elementwise op that consumes the product element for
  element (result shape = the product's shape), and elementwise producers of
  their extra operands that have that shape too; they run on the f32
  accumulator before the one store. Extra operands ("D tensors") of any
  broadcastable shape (bias `[N]`, row and column scales, full tensors,
  batch-broadcast ones, scalars, dims) are read at the output tile through
  their strides. A member used outside the group (returned, or read by a
  later kernel) is stored as well: the kernel has several outputs.
- the prologue: cheap elementwise ops that feed one GEMM operand element for
  element from a single tensor (a cast or scale of A), applied right after
  the operand tile is loaded.

Refused, with a recorded rule: an op reading the product transposed or
broadcast ("other-index", e.g. `c + c.T`), an op whose result is larger than
the product ("tile"), an operand that depends on the product ("cycle"), and
prologues that are not worth recomputing per tile ("profit").
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ir import Graph
from tiledsl.passes.fusion.grow import elementwise_candidate, fuse_groups
from tiledsl.passes.fusion.legality import GroupPlan, reads_other_index, result_type
from tiledsl.passes.fusion.profitability import MAX_EPILOGUE_INPUTS, prologue_refusal
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import format_shape


@register
@dataclass(frozen=True)
class FuseEpilogue(Pass):
    name = "fuse-epilogue"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def elementwise(node: int) -> bool:
            return elementwise_candidate(graph, node)

        def admit_for(plan: GroupPlan, seed: int):
            prologue: set[int] = set()  # members feeding the matmul's operands

            def admit(group: set[int], cand: int) -> tuple[str, str] | None:
                reason = _admit(graph, group, cand, seed, prologue)
                if reason is None and _is_prologue(graph, cand, seed, prologue):
                    prologue.add(cand)
                return reason

            return admit

        fuse_groups(graph, ctx.remarks, self.name, "matmul",
                    lambda node: graph.op(node).kind == "matmul", elementwise, admit_for)


def _is_prologue(graph: Graph, cand: int, seed: int, prologue: set[int]) -> bool:
    """Does `cand` feed the matmul's operands (directly or through the prologue)?"""
    return any(u == seed or u in prologue for u, _ in graph.users(cand))


def _admit(graph: Graph, group: set[int], cand: int, seed: int,
           prologue: set[int]) -> tuple[str, str] | None:
    op = graph.op(cand)
    users = [u for u, _ in graph.users(cand)]
    if _is_prologue(graph, cand, seed, prologue):
        if any(u in group and u != seed and u not in prologue for u in users):
            return "other-index", "it feeds both a matmul operand and the epilogue"
        why = prologue_refusal(op.kind, any(u not in group for u in users))
        if why:
            return "profit", why
        tensors = [s for s in graph.operand_edges(cand) if result_type(graph, *s).rank > 0]
        if len(tensors) != 1 or result_type(graph, *tensors[0]).shape != op.shape:
            return "other-index", "a prologue reads one operand tensor element for element (plus scalars)"
        return None
    product = graph.op(seed).shape
    if op.shape != product:
        consumer = any(s in group for s in graph.operands(cand))
        if not consumer and len(op.shape) <= len(product):
            return "other-index", (f"the epilogue would read it broadcast from "
                                   f"{format_shape(op.shape)} to {format_shape(product)}")
        return "tile", f"its result {format_shape(op.shape)} is not the product's {format_shape(product)}"
    why = reads_other_index(graph, cand, group)
    if why:
        return "other-index", why
    extra = {e for m in group | {cand} for e in graph.operand_edges(m)
             if e[0] not in group and e[0] != cand and result_type(graph, *e).rank > 0}
    if len(extra) > MAX_EPILOGUE_INPUTS + 2:
        return "profit", f"the epilogue would read more than {MAX_EPILOGUE_INPUTS} extra tensors"
    return None
