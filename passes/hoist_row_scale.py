"""hoist-row-scale: a factor constant along K is taken out of a GEMM's A operand and applied
to its product: (r * A) @ B = r * (A @ B), for r of shape [..., M, 1].

Before: a pre-norm projection `cast(xf * rsqrt(mean(xf * xf, -1) + eps) * g, f16) @ w.T`.
The row statistic needs the whole row of x, so the normalised A operand is a tensor of its
own: one row kernel writes it and the GEMM reads it back.
After: `cast(cast(cast(xf * g, f16) @ w.T, f32) * rsqrt(mean(xf * xf, -1) + eps), f16)`. The
scale is an epilogue of the GEMM, and the statistic is a reduction of the GEMM's own A tiles
along K, which fuse-epilogue computes in the K loop (`GemmPlan.row_stats`): the
normalisation and the projection are one kernel, and the [M, K] normalised tensor is never
formed.

The factor is found through the ops that form A, each read by nothing else: `mul`s, whose
operands are factors, and float `cast`s. A factor is hoisted when its shape is [..., M, 1],
or when it is a scalar scaling a softmax (`lam * p` is then a softmax again, which
fuse-attention takes; a scalar on any other tensor is already a cheap prologue), and
dropping it leaves the `mul` with the type it had. Rounding moves: A is rounded to the
dot's dtype before the scale instead of after it, and the scale is applied to the f32
accumulator; the result is within the numerics contract's tolerance like any reordering of
a reduction. Not when A is rounded to f16 after the scale: unscaled values may not fit
f16's range and precision (a refused remark says so; bf16 and f32 operands are hoisted).
Each rewrite is a fused remark with its modelled saving.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import cost
from tiledsl.ir import Graph, Op, make_attrs
from tiledsl.passes.fusion.legality import describe_node
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.types import DType, broadcasts_to, format_shape

NAME = "hoist-row-scale"


@register
@dataclass(frozen=True)
class HoistRowScale(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for mm in graph.topo_order():
            op = graph.op(mm)
            if not (isinstance(op, Op) and op.kind == "matmul" and op.dtype.is_float):
                continue
            a_type = graph.result_type(graph.operands(mm)[0])
            refused: list[int] = []
            pairs = _row_factors(graph, graph.operands(mm)[0], mm, refused)
            for factor in refused:
                ctx.remarks.append(FusionRemark.refused(NAME, Refusal(Rule.OP, (
                    f"the A operand is rounded to f16 after {_describe(graph, factor)} scales it; unscaled "
                    "it could overflow f16 or lose precision, so the scale stays on A (a bf16 or f32 "
                    "operand has no such limit)")), graph.op(factor), op))
            if not pairs:
                continue
            saving = cost.format_poly(cost.add(*[cost.tensor_bytes(a_type)] * 2))
            for _, factor in pairs:
                shape = graph.op(factor).shape
                what = f"the row scale {_describe(graph, factor)} {format_shape(shape)}" if shape else \
                    f"the scale {_describe(graph, factor)}"
                ctx.remarks.append(FusionRemark(
                    NAME, True, None, graph.op(factor), op,
                    f"{what} is applied to the product, not to the A operand ((r * A) @ B = r * (A @ B)): "
                    f"the scaled {format_shape(a_type.shape)} operand need not be stored "
                    f"(modelled saving: {saving} B)"))
            _hoist(graph, mm, pairs)


def _describe(graph: Graph, node: int) -> str:
    op = graph.op(node)
    return f"'{op.attr('name')}'" if op.kind == "param" else describe_node(graph, node)


def _row_factors(graph: Graph, a: int, mm: int, refused: list[int]) -> list[tuple[int, int]]:
    """(mul, factor) pairs: a `mul` among the ops forming A (through muls and float casts,
    each read only by the next) and its operand constant along K.

    Not below a cast that narrows to f16: the unscaled values would be rounded to f16's
    range and precision (a large activation overflows, a small one loses bits), where the
    scaled ones fitted; such factors go to `refused`. bf16 has f32's range."""
    rows = graph.op(mm).shape[:-1]
    found: list[tuple[int, int]] = []
    stack, reader, narrowed = [a], {a: mm}, {a: False}
    while stack:
        n = stack.pop()
        op = graph.op(n)
        if not isinstance(op, Op) or [u for u, _ in graph.users(n)] != [reader[n]]:
            continue
        if op.kind == "cast" and op.dtype.is_float and graph.op(graph.operands(n)[0]).dtype.is_float:
            (src,) = graph.operands(n)
            reader[src] = n
            narrowed[src] = narrowed[n] or (op.dtype is DType.F16 and graph.op(src).dtype is not DType.F16)
            stack.append(src)
        elif op.kind == "mul":
            x, y = graph.operands(n)
            for factor, other in ((y, x), (x, y)):
                if factor != other and _constant_along_k(graph, factor, rows) \
                        and graph.op(other).type == op.type and graph.op(factor).dtype.is_float \
                        and (graph.op(factor).shape != () or _is_softmax(graph, other)):
                    if narrowed[n]:
                        refused.append(factor)
                    else:
                        found.append((n, factor))
                    break
            else:
                for o in (x, y):
                    if o not in reader:
                        reader[o] = n
                        narrowed[o] = narrowed[n]
                        stack.append(o)
    return found


def _is_softmax(graph: Graph, node: int) -> bool:
    """A softmax, through float casts: a scalar factor is hoisted only off one (a scaled
    softmax is not attention; a scaled tensor is already a cheap prologue)."""
    op = graph.op(node)
    while isinstance(op, Op) and op.kind == "cast":
        node = graph.operands(node)[0]
        op = graph.op(node)
    return isinstance(op, Op) and op.kind == "softmax"


def _constant_along_k(graph: Graph, node: int, rows) -> bool:
    """A scalar, or a [..., M, 1] value whose rows broadcast to the product's."""
    return broadcasts_to(graph.op(node).shape, (*rows, 1))


def _hoist(graph: Graph, mm: int, pairs: list[tuple[int, int]]) -> None:
    """Drop each factor from its `mul` and multiply the product by them all, in f32."""
    op = graph.op(mm)
    spans = [graph.op(mul).span for mul, _ in pairs]
    for mul, factor in pairs:
        (other,) = [o for o in graph.operands(mul) if o != factor]
        graph.replace_uses(mul, other)
        graph.remove(mul)
    users = graph.users(mm)

    def f32(node: int, like: Op) -> int:
        if graph.op(node).dtype is DType.F32:
            return node
        t = graph.op(node)
        return graph.add(Op("cast", DType.F32, t.shape, make_attrs(dtype=DType.F32), like.span), [node])

    product = f32(mm, op)
    for (_, factor), span in zip(pairs, spans, strict=True):
        product = graph.add(Op("mul", DType.F32, op.shape, (), span),
                            [product, f32(factor, graph.op(factor))])
    if op.dtype is not DType.F32:
        product = graph.add(Op("cast", op.dtype, op.shape, make_attrs(dtype=op.dtype), op.span), [product])
    for user, slot in users:
        edges = graph.operand_edges(user)
        edges[slot] = (product, 0)
        graph.set_operands(user, edges)
