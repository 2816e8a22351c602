"""sum-precision: an f32 sum accumulates in f64 only where an f32 result can show its error.

Before: every f32 sum, mean, prod, cumsum or cumprod (a reduction or scan declared `wide`)
accumulates in f64 (row_reduce.py), as good as correctly rounded: `%s = sum %x : f32[M, 1]`.
After: one whose value reaches only 16-bit float results (the program's returned f16, bf16
or f8 tensors; through any ops and kernels) is marked to accumulate in f32:
`%s = sum %x {accumulator = "f32"} : f32[M, 1]`. Each lane sums its share in f32 and the
lanes combine as a tree: a relative error (of the sum of magnitudes) of about (n / lanes
+ log2 lanes) * 2^-24, under 2^-15 for rows of 32768 over 128 lanes, where the result's
rounding to 16 bits is 2^-11 (f16) or 2^-8 (bf16). An f64 accumulator costs a conversion
an element (and f64 adds at half the f32 rate on an H100): an f16 layer norm's or RMSNorm's
row sums, and the attention backward's rowsum(dO * O), now run in f32. A sum any f32 (or
integer, or bool) result depends on stays f64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import networkx as nx

from tiledsl import ops
from tiledsl.ir import Graph, Op, make_attrs
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import DType


@register
@dataclass(frozen=True)
class SumPrecision(Pass):
    name = "sum-precision"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        exact = {node for node, res in graph.outputs
                 if not _rounds_to_16_bits(graph.result_type(node, res).dtype)}
        shows = exact.union(*(nx.ancestors(graph.nx, node) for node in exact))  # what they read
        for node in list(graph.nodes()):
            op = graph.op(node)
            if isinstance(op, Op) and node not in shows and ops.in_f64(op):
                attrs = make_attrs(**op.attr_map, **{ops.ACCUMULATE: "f32"})
                graph.set_op(node, dataclasses.replace(op, attrs=attrs))


def _rounds_to_16_bits(dtype: DType) -> bool:
    return dtype in (DType.F16, DType.BF16) or dtype.is_f8
