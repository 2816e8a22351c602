"""distribute-matmul: a matmul of a sum or difference of softmaxes is the sum or difference of
their matmuls: (p1 - lam * p2) @ v = p1 @ v - (lam * p2) @ v.

Before: the Diff Transformer's attention, `(softmax(s1) - lam * softmax(s2)) @ v`. The
operand of `@ v` is not a softmax, so fuse-attention finds no attention: both score
matrices and both probability matrices are stored ([H, M, N] each), four kernels.
After: one `@ v` per softmax, each a flash-attention kernel (`lam`, a factor constant along
the keys, is moved to the product by hoist-row-scale), and the difference an epilogue.

Distributed when the `add` or `sub` is read by the matmul alone, both its operands have its
type, and each is a softmax along the last axis, possibly scaled by a factor constant
along that axis (a scalar, or [..., M, 1]) or cast. Each rewrite is a fused remark with the
traffic it saves (the probabilities no longer stored and read). Runs before
hoist-row-scale and fuse-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl import cost
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op
from tiledsl.passes.fusion.legality import describe_node
from tiledsl.passes.fusion.remarks import FusionRemark
from tiledsl.passes.registry import Pass, PassContext, register

NAME = "distribute-matmul"


@register
@dataclass(frozen=True)
class DistributeMatmul(Pass):
    name = NAME

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for mm in graph.topo_order():
            op = graph.op(mm)
            if not (isinstance(op, Op) and op.kind == "matmul"):
                continue
            a, b = graph.operands(mm)
            a_op = graph.op(a)
            if not (isinstance(a_op, Op) and a_op.kind in ("add", "sub")) or graph.users(a) != [(mm, 0)]:
                continue
            x, y = graph.operands(a)
            if x == y or graph.op(x).type != a_op.type or graph.op(y).type != a_op.type \
                    or not (_softmax_term(graph, x) and _softmax_term(graph, y)):
                continue
            saved = cost.format_poly(cost.add(*[cost.tensor_bytes(a_op.type)] * 4))
            ctx.remarks.append(FusionRemark(
                NAME, True, None, a_op, op,
                f"({describe_node(graph, x)} {'+' if a_op.kind == 'add' else '-'} "
                f"{describe_node(graph, y)}) @ v is computed as two products, one per softmax, so "
                f"each can be a flash-attention kernel (modelled saving: {saved} B of probabilities "
                "stored and read)"))
            build = Builder(graph)
            left, right = build.copy(op, [x, b]), build.copy(op, [y, b])
            combined = build.op(a_op.kind, [left, right], a_op.span)
            graph.replace_uses(mm, combined)
            graph.remove(mm)
            graph.remove(a)


def _softmax_term(graph: Graph, node: int) -> bool:
    """A softmax along the last axis, through casts and factors constant along that axis."""
    while True:
        op = graph.op(node)
        if not isinstance(op, Op):
            return False
        if op.kind == "softmax":
            return op.attr("axis") == len(op.shape) - 1
        if op.kind in ("cast", "neg"):
            (node,) = graph.operands(node)
        elif op.kind == "mul":
            x, y = graph.operands(node)
            if _constant_along_last(graph, y):
                node = x
            elif _constant_along_last(graph, x):
                node = y
            else:
                return False
        else:
            return False


def _constant_along_last(graph: Graph, node: int) -> bool:
    shape = graph.op(node).shape
    return shape == () or shape[-1] == 1
