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
from tiledsl.passes.fusion.admission import epilogue_refusal, prologue_op_refusal
from tiledsl.passes.fusion.grow import elementwise_candidate, fuse_groups
from tiledsl.passes.fusion.legality import GroupPlan
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class FuseEpilogue(Pass):
    name = "fuse-epilogue"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def elementwise(node: int) -> bool:
            return elementwise_candidate(graph, node)

        def admit_for(plan: GroupPlan, seed: int):
            prologue: set[int] = set()  # members feeding the matmul's operands

            def admit(group: set[int], cand: int) -> Refusal | None:
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
           prologue: set[int]) -> Refusal | None:
    users = [u for u, _ in graph.users(cand)]
    if _is_prologue(graph, cand, seed, prologue):
        if any(u in group and u != seed and u not in prologue for u in users):
            return Refusal(Rule.OTHER_INDEX, "it feeds both a matmul operand and the epilogue")
        return prologue_op_refusal(graph, cand, any(u not in group for u in users))
    epilogue = [m for m in group if m != seed and m not in prologue]
    return epilogue_refusal(graph, group, cand, graph.op(seed).shape, "the product", epilogue)
