"""hoist-row-scale: a factor constant along K is taken out of a GEMM's operand and applied
to its product: (r * A) @ B = r * (A @ B), for r of shape [..., M, 1]; A @ (B * c) = (A @ B) * c,
for c of shape [..., 1, N] (a weight's per-channel scale, `(cast(w, f32) * ws).T` with
`ws: [N, 1]`, found through the transpose; the operand left, `cast(w, f32).T`, becomes
canonicalize's `cast(w.T, f32)`, a prologue of the tile the GEMM loads).

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
fuse-attention takes; a scalar on any other tensor is already a cheap prologue), or a
scalar whose product, unscaled, another matmul computes too, equal or transposed (open_clip's
`logit_scale * img @ txt.T` and `logit_scale * txt @ img.T`: one GEMM, its transpose read
as a view), and dropping it leaves the `mul` with the type it had. Rounding moves: A is rounded to the
dot's dtype before the scale instead of after it, and the scale is applied to the f32
accumulator; the result is within the numerics contract's tolerance like any reordering of
a reduction. Not when A is rounded to f16 after the scale: unscaled values may not fit
f16's range and precision (a refused remark says so; bf16 and f32 operands are hoisted).
Nor, for a product narrower than f32, in a compiled pipeline where no fuse-epilogue follows
(`PassContext.following`): the product would be stored and rounded before the scale, a
rounding at another magnitude than the program's (with K = 1 the scaled operand of an
RMSNorm is exactly +-1 and the program's own result rounds once).
Each rewrite is a fused remark with its modelled saving. A product that becomes one another
matmul computes already (the same A and B, or its transpose: `cse.merge_transposed_product`)
is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import cost
from tiledsl.builder import Builder
from tiledsl.ir import Edge, Graph, Op
from tiledsl.passes.canonicalize import TransposedOperand
from tiledsl.passes.cse import merge_transposed_product, transposed_operand
from tiledsl.passes.fuse_epilogue import FuseEpilogue
from tiledsl.passes.fusion.legality import describe_node
from tiledsl.passes.fusion.remarks import FusionRemark, Refusal, Rule
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.passes.rewrite import Rewriter
from tiledsl.types import DType, broadcasts_to, format_shape

NAME = "hoist-row-scale"


@register
@dataclass(frozen=True)
class HoistRowScale(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        # without fuse-epilogue after it, nothing applies the scale to the f32 accumulator
        fused_later = ctx.following is None or FuseEpilogue.name in ctx.following
        order = graph.topo_order()
        twins = _scaled_twins(graph, order)
        visited: set[int] = set()
        for mm in order:
            visited.add(mm)
            op = graph.op(mm)
            if not (isinstance(op, Op) and op.kind == "matmul" and op.dtype.is_float):
                continue
            a_type = graph.result_type(*graph.operand_edges(mm)[0])
            refused: list[Edge] = []
            pairs = _row_factors(graph, mm, refused, mm in twins) + _column_factors(graph, mm, refused)
            for factor in refused:
                self._refuse(ctx, graph, factor, op, (
                    f"the A operand is rounded to f16 after {_describe(graph, factor)} scales it; unscaled "
                    "it could overflow f16 or lose precision, so the scale stays on A (a bf16 or f32 "
                    "operand has no such limit)"))
            if pairs and not fused_later and op.dtype is not DType.F32:
                for factor in pairs:
                    self._refuse(ctx, graph, factor.value, op, (
                        "no fuse-epilogue follows in this pipeline to apply "
                        f"{_describe(graph, factor.value)} to the f32 accumulator: the {op.dtype} product "
                        f"would be rounded before the scale, so the scale stays on {'AB'[factor.slot]}"))
                continue
            if not pairs:
                if mm in twins:  # unscaled, the transpose of a product hoisted before it
                    merge_transposed_product(graph, mm, visited)
                continue
            for factor in pairs:
                operand_type = a_type if factor.slot == 0 else graph.result_type(*graph.operand_edges(mm)[1])
                saving = cost.format_poly(cost.add(*[cost.tensor_bytes(operand_type)] * 2))
                shape = graph.result_type(*factor.value).shape
                kind = "row" if factor.slot == 0 else "column"
                what = f"the {kind} scale {_describe(graph, factor.value)} {format_shape(shape)}" if shape \
                    else f"the scale {_describe(graph, factor.value)}"
                why = f"the scaled {format_shape(operand_type.shape)} operand need not be stored " \
                    f"(modelled saving: {saving} B)"
                if not shape and mm in twins:
                    why = "the product is then one another matmul computes too (equal or transposed), " \
                        "computed once"
                law = "not to the A operand ((r * A) @ B = r * (A @ B))" if factor.slot == 0 else \
                    "not to the B operand (A @ (B * c) = (A @ B) * c)"
                ctx.remarks.append(FusionRemark(
                    NAME, True, None, _value_op(graph, factor.value), op,
                    f"{what} is applied to the product, {law}: {why}"))
            _hoist(graph, mm, pairs)
            b = graph.operands(mm)[1]  # `(cast(w, f32) * ws).T` is now `cast(w, f32).T`
            if any(f.slot == 1 for f in pairs) and isinstance(graph.op(b), Op):
                TransposedOperand().apply(graph, b, graph.op(b), Rewriter(graph))
            if not _merge_equal_product(graph, mm):
                merge_transposed_product(graph, mm, visited)

    @staticmethod
    def _refuse(ctx: PassContext, graph: Graph, factor: Edge, mm: Op, detail: str) -> None:
        ctx.remarks.append(FusionRemark.refused(NAME, Refusal(Rule.OP, detail), _value_op(graph, factor), mm))


def _merge_equal_product(graph: Graph, mm: int) -> bool:
    """Unscaled, A may be what another matmul multiplies by the same B
    (`(x @ w) * f((x * r) @ w)`): one product, computed once (as cse would, which ran before);
    or by B transposed (`s * b @ a.T` beside `s * a @ b.T`: `cse.merge_transposed_product`)."""
    op, edges = graph.op(mm), graph.operand_edges(mm)
    twin = next((u for u, _ in graph.users(edges[0][0]) if u != mm and isinstance(graph.op(u), Op)
                 and graph.op(u).key() == op.key() and graph.operand_edges(u) == edges), None)
    if twin is not None:
        graph.replace_uses(mm, twin)
        graph.remove(mm)
    return twin is not None


def _value_op(graph: Graph, value: Edge) -> Op:
    """The DSL op that computes `value` (for remarks): its node's, or the op of that result
    inside a kernel an earlier pass formed."""
    op = graph.op(value[0])
    if isinstance(op, Op):
        return op
    region = op.region
    v = region.outputs[value[1]] - len(region.inputs)
    return region.ops[v].op if v >= 0 else region.ops[0].op


def _describe(graph: Graph, value: Edge) -> str:
    op = graph.op(value[0])
    return f"'{op.attr('name')}'" if op.kind == "param" else describe_node(graph, value[0])


def _unscaled(graph: Graph, value: Edge) -> Edge:
    """`value` without the 0-d factors of the `mul`s forming it (each read only by the next)."""
    while True:
        op = graph.op(value[0])
        if not (isinstance(op, Op) and op.kind == "mul" and len(graph.users(value[0])) == 1):
            return value
        x, y = graph.operand_edges(value[0])
        scalar = [e for e in (x, y)
                  if graph.result_type(*e).shape == () and graph.result_type(*e).dtype.is_float]
        rest = [e for e in (x, y) if e not in scalar]
        if len(rest) != 1 or graph.result_type(*rest[0]) != op.type:
            return value
        value = rest[0]


def _scaled_twins(graph: Graph, order: list[int]) -> set[int]:
    """The matmuls whose A, unscaled by 0-d factors, another matmul multiplies by the same
    B, or which another computes transposed (`s * a @ b.T` and `s * b @ a.T`): with the
    scalars hoisted they are one product (`_merge_equal_product`)."""
    seen: dict[tuple, list[int]] = {}
    for mm in order:
        op = graph.op(mm)
        if isinstance(op, Op) and op.kind == "matmul" and op.dtype.is_float:
            a, b = graph.operand_edges(mm)
            a = _unscaled(graph, a)
            seen.setdefault((op.dtype, op.attrs, op.weak, a, b), []).append(mm)
            bt = transposed_operand(graph, b)
            if bt is not None:
                seen.setdefault((op.dtype, op.attrs, op.weak, "T", *sorted((a, bt))), []).append(mm)
    return {mm for group in seen.values() if len(group) > 1 for mm in group}


@dataclass(frozen=True)
class Factor:
    """A factor of a matmul operand constant along K: `mul` drops it, and the product is
    multiplied by it (`value`; transposed first when `swapped`: a factor of B's rows found
    through the transpose forming B, `w * ws` with `ws: [N, 1]` in `(w * ws).T`). `slot`: 0
    for A, 1 for B."""
    mul: int
    value: Edge
    slot: int = 0
    swapped: bool = False


def _row_factors(graph: Graph, mm: int, refused: list[Edge], scalars: bool = False) -> list[Factor]:
    """The factors of A constant along K: of shape [..., M, 1], found through the ops that
    form A (muls and float casts, each read only by the next). Values are edges: A and the
    factors may be results of kernels an earlier pass formed. A 0-d factor is one off a
    softmax, or, with `scalars`, off any A (a product another shares unscaled).

    Not below a cast that narrows to f16: the unscaled values would be rounded to f16's
    range and precision (a large activation overflows, a small one loses bits), where the
    scaled ones fitted; such factors go to `refused`. bf16 has f32's range."""
    rows = graph.op(mm).shape[:-1]

    def constant_along_k(shape, other: Edge, swapped: bool) -> bool:
        return broadcasts_to(shape, (*rows, 1)) and (shape != () or scalars or _is_softmax(graph, other))
    return _factors(graph, mm, 0, constant_along_k, refused)


def _column_factors(graph: Graph, mm: int, refused: list[Edge]) -> list[Factor]:
    """The factors of B constant along K: of shape [..., 1, N] in B's layout, or [..., N, 1]
    through a transpose of its last two dims (a weight's per-channel scale `ws: [N, 1]` in
    `(cast(w, f32) * ws).T`), found as `_row_factors` finds A's."""
    *batch, _, n = graph.op(mm).shape

    def constant_along_k(shape, other: Edge, swapped: bool) -> bool:
        along = (*batch, n, 1) if swapped else (*batch, 1, n)
        return len(shape) >= 1 + swapped and broadcasts_to(shape, along) and any(d != 1 for d in shape)
    return _factors(graph, mm, 1, constant_along_k, refused)


def _factors(graph: Graph, mm: int, slot: int, constant_along_k, refused: list[Edge]) -> list[Factor]:
    """The factors `constant_along_k(shape, other operand, swapped)` accepts among the muls
    forming operand `slot` of `mm` (through float casts and, for B, transposes of the last two
    dims), each op read only by the next."""
    start = graph.operands(mm)[slot]
    found: list[Factor] = []
    stack, reader, narrowed, swapped = [start], {start: mm}, {start: False}, {start: False}
    while stack:
        n = stack.pop()
        op = graph.op(n)
        if not isinstance(op, Op) or [u for u, _ in graph.users(n)] != [reader[n]]:
            continue
        last_two = (op.type.rank - 2, op.type.rank - 1)
        if op.kind == "cast" and op.dtype.is_float and _float(graph, graph.operand_edges(n)[0]) or \
                slot == 1 and op.kind == "transpose" and op.attr("dims") == last_two:
            (src,) = graph.operand_edges(n)
            reader[src[0]] = n
            narrowed[src[0]] = narrowed[n] or (op.kind == "cast" and op.dtype is DType.F16
                                               and graph.result_type(*src).dtype is not DType.F16)
            swapped[src[0]] = swapped[n] != (op.kind == "transpose")
            stack.append(src[0])
        elif op.kind == "mul":
            x, y = graph.operand_edges(n)
            for factor, other in ((y, x), (x, y)):
                ft = graph.result_type(*factor)
                if factor != other and ft.dtype.is_float and graph.result_type(*other) == op.type \
                        and constant_along_k(ft.shape, other, swapped[n]):
                    if narrowed[n]:
                        refused.append(factor)
                    else:
                        found.append(Factor(n, factor, slot, swapped[n]))
                    break
            else:
                for o, _ in (x, y):
                    if o not in reader:
                        reader[o] = n
                        narrowed[o] = narrowed[n]
                        swapped[o] = swapped[n]
                        stack.append(o)
    return found


def _float(graph: Graph, value: Edge) -> bool:
    return graph.result_type(*value).dtype.is_float


def _is_softmax(graph: Graph, value: Edge) -> bool:
    """A softmax, through float casts: a scalar factor is hoisted only off one (a scaled
    softmax is not attention; a scaled tensor is already a cheap prologue)."""
    node = value[0]
    op = graph.op(node)
    while isinstance(op, Op) and op.kind == "cast":
        node = graph.operands(node)[0]
        op = graph.op(node)
    return isinstance(op, Op) and op.kind == "softmax"


def _hoist(graph: Graph, mm: int, pairs: list[Factor]) -> None:
    """Drop each factor from its `mul` and multiply the product by them all, in f32."""
    op = graph.op(mm)
    spans = [graph.op(f.mul).span for f in pairs]
    for f in pairs:
        (other,) = [e for e in graph.operand_edges(f.mul) if e != f.value]
        graph.replace_uses(f.mul, other[0], new_res=other[1])
        graph.remove(f.mul)
    users = graph.users(mm)
    b = Builder(graph)

    def f32(value: Edge, span) -> Edge:
        if graph.result_type(*value).dtype is DType.F32:
            return value
        return b.op("cast", [value], span, dtype=DType.F32), 0

    product = f32((mm, 0), op.span)
    for f, span in zip(pairs, spans, strict=True):
        value = f32(f.value, _value_op(graph, f.value).span)
        if f.swapped:
            rank = graph.result_type(*value).rank
            value = b.op("transpose", [value], span, dims=(rank - 2, rank - 1)), 0
        product = b.op("mul", [product, value], span), 0
    if op.dtype is not DType.F32:
        product = b.op("cast", [product], op.span, dtype=op.dtype), 0
    for user, slot in users:
        edges = graph.operand_edges(user)
        edges[slot] = product
        graph.set_operands(user, edges)
