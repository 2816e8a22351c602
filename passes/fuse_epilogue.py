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
  the operand tile is loaded;
- dual GEMMs: a further matmul of the same A whose product the epilogue reads
  (LLaMA's MLP `silu(x @ w1.T) * (x @ w3.T)`), with its own B operand and
  accumulator: each A tile is loaded once for both (`MAX_ACCUMULATORS`).

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
from tiledsl.passes.fusion.profitability import MAX_ACCUMULATORS
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class FuseEpilogue(Pass):
    name = "fuse-epilogue"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def candidate(node: int) -> bool:
            return elementwise_candidate(graph, node) or _is_matmul(graph, node)

        def admit_for(plan: GroupPlan, seed: int):
            matmuls = {seed}  # the seed and the dual matmuls admitted with it
            prologue: set[int] = set()  # members feeding the matmuls' operands
            memo: dict = {}  # producers' sources, with the duals this seed may take

            def joins(node: int) -> bool:
                return _is_matmul(graph, node) and _dual_refusal(graph, seed, set(), node) is None

            def admit(group: set[int], cand: int) -> Refusal | None:
                if _is_matmul(graph, cand):
                    reason = _dual_refusal(graph, seed, matmuls, cand)
                    if reason is None and not plan.creates_cycle(group, cand):
                        matmuls.add(cand)
                    return reason
                reason = _admit(graph, group, cand, matmuls, prologue, joins, memo)
                if reason is None and _is_prologue(graph, cand, matmuls, prologue):
                    prologue.add(cand)
                return reason

            return admit

        fuse_groups(graph, ctx.remarks, self.name, "matmul", lambda node: _is_matmul(graph, node),
                    candidate, admit_for)


def _is_matmul(graph: Graph, node: int) -> bool:
    return graph.op(node).kind == "matmul"


def _dual_refusal(graph: Graph, seed: int, matmuls: set[int], cand: int) -> Refusal | None:
    """Why matmul `cand` cannot share the kernel of `seed` as a dual GEMM (its own
    accumulator over the same A tiles)."""
    first, other = graph.op(seed), graph.op(cand)
    if graph.operands(cand)[0] != graph.operands(seed)[0]:
        return Refusal(Rule.OP, "a dual GEMM shares the A operand; these multiply different ones")
    if other.shape != first.shape or other.dtype is not first.dtype:
        return Refusal(Rule.TILE, f"its product {other.type} is not the kernel's {first.type}")
    if len(matmuls) >= MAX_ACCUMULATORS:
        return Refusal(Rule.PROFIT, f"a GEMM kernel holds at most {MAX_ACCUMULATORS} accumulators")
    return None


def _is_prologue(graph: Graph, cand: int, matmuls: set[int], prologue: set[int]) -> bool:
    """Does `cand` feed a matmul's operands (directly or through the prologue)?"""
    return any(u in matmuls or u in prologue for u, _ in graph.users(cand))


def _admit(graph: Graph, group: set[int], cand: int, matmuls: set[int], prologue: set[int],
           joins, memo: dict) -> Refusal | None:
    users = [u for u, _ in graph.users(cand)]
    if _is_prologue(graph, cand, matmuls, prologue):
        if any(u in group and u not in matmuls and u not in prologue for u in users):
            return Refusal(Rule.OTHER_INDEX, "it feeds both a matmul operand and the epilogue")
        return prologue_op_refusal(graph, cand, any(u not in group for u in users))
    epilogue = [m for m in group if m not in matmuls and m not in prologue]
    seed = min(matmuls)
    return epilogue_refusal(graph, group, cand, graph.op(seed).shape, "the product", epilogue,
                            joins, memo)
