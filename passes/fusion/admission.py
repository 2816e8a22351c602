"""Admitting elementwise ops into a GEMM or attention kernel: one set of checks for every
pass that grows one (fuse-epilogue, fuse-attention).

- An epilogue op consumes the kernel's output element for element: its result
  has the output's shape (legality: "tile" or "other-index"), it reads no
  group value transposed or broadcast ("other-index"), and the epilogue reads
  at most `MAX_EPILOGUE_INPUTS` extra tensors ("profit").
- A prologue op feeds a dot operand from one tensor of the operand's shape
  plus scalars ("other-index" otherwise), is cheap to recompute per tile and
  has no other user ("profit", `profitability.prologue_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable

from tiledsl.ir import Graph
from tiledsl.types import Shape, format_shape

from .legality import reads_other_index
from .profitability import MAX_EPILOGUE_INPUTS, prologue_refusal
from .remarks import Refusal, Rule


def epilogue_refusal(graph: Graph, group: set[int], cand: int, shape: Shape, what: str,
                     epilogue: Iterable[int]) -> Refusal | None:
    """Why `cand` cannot join the epilogue of a kernel whose output (`what`) has `shape`.

    `epilogue`: the epilogue ops admitted so far; the extra tensors they and `cand`
    read from outside the group count against `MAX_EPILOGUE_INPUTS`.
    """
    op = graph.op(cand)
    if op.shape != shape:
        consumer = any(s in group for s in graph.operands(cand))
        if not consumer and len(op.shape) <= len(shape):
            return Refusal(Rule.OTHER_INDEX, f"the epilogue would read it broadcast from "
                           f"{format_shape(op.shape)} to {format_shape(shape)}")
        return Refusal(Rule.TILE, f"its result {format_shape(op.shape)} is not {what}'s "
                       f"{format_shape(shape)}")
    why = reads_other_index(graph, cand, group)
    if why:
        return Refusal(Rule.OTHER_INDEX, why)
    extra = {e for m in (*epilogue, cand) for e in graph.operand_edges(m)
             if e[0] not in group and e[0] != cand and graph.result_type(*e).rank > 0}
    if len(extra) > MAX_EPILOGUE_INPUTS:
        return Refusal(Rule.PROFIT, f"the epilogue would read more than {MAX_EPILOGUE_INPUTS} extra "
                       "tensors")
    return None


def prologue_op_refusal(graph: Graph, cand: int, users_outside: bool) -> Refusal | None:
    """Why `cand` cannot be applied to each loaded tile of a dot operand."""
    op = graph.op(cand)
    why = prologue_refusal(op.kind, users_outside)
    if why:
        return Refusal(Rule.PROFIT, why)
    tensors = [s for s in graph.operand_edges(cand) if graph.result_type(*s).rank > 0]
    if len(tensors) != 1 or graph.result_type(*tensors[0]).shape != op.shape:
        return Refusal(Rule.OTHER_INDEX,
                       "a prologue reads one operand tensor element for element (plus scalars)")
    return None
