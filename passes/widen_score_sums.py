"""widen-score-sums: the attention backward's sums of score values run in f32.

Before: a score space (`passes/fusion/score_space.py`) whose value is summed by a chain of
f16 or bf16 sums, a broadcast bias's gradient `sum(sum(ds, axis=0), axis=0)`, or ALiBi's
slope gradient: `%s = sum %ds : f16[N]`.
After: the chain reads `%w = cast %ds : f32[.., M, N]` (a score op, marked with the
space) and sums in f32, and a cast back to the chain's dtype follows its last sum:
`%s = sum %w : f32[N]`, `%r = cast %s : f16[N]`, read where the sum was.
fuse-attention-backward sums such a chain per tile and adds the tiles' sums atomically,
which in a narrow float would round at every add; the value summed is the same, rounded
once at the end. A chain already in f32 is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.builder import Builder
from tiledsl.ir import Graph
from tiledsl.passes.fusion import score_space
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import DType


@register
@dataclass(frozen=True)
class WidenScoreSums(Pass):
    name = "widen-score-sums"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for found in score_space.spaces(graph):
            for x, chain in found.reduced:
                _widen(graph, x, chain)


def _widen(graph: Graph, x: int, chain: list[int]) -> None:
    last = graph.op(chain[-1])
    if last.dtype not in score_space.NARROW:
        return
    b = Builder(graph)
    wide = b.op("cast", [x], graph.op(x).span, dtype=DType.F32)
    graph.set_score_space(wide, graph.score_space(x))  # a score op, in x's place
    graph.set_operands(chain[0], [wide])
    for n in chain:
        b.retype(n)
    narrow = b.op("cast", [chain[-1]], last.span, dtype=last.dtype)
    for user, slot in graph.users(chain[-1]):
        if user != narrow:
            edges = graph.operand_edges(user)
            edges[slot] = (narrow, 0)
            graph.set_operands(user, edges)
