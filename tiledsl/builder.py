"""The one place graph-IR ops are made.

Every op sema, autodiff and the passes add to a graph is built here: its kind,
operands, span and attributes are given, and its dtype, shape and weakness are
what `ops.infer` says of its operands (a source op, `param`, `const` or `dim`,
is typed by its `type` attribute, like any other op by its rule). So a graph
built by any of them is well typed by construction; the verifier's re-check
after each pass (`TILEDSL_VERIFY=1`) guards the rest: an op whose operands a
pass rewired without `retype`.

A rule that refuses its operands is the user's error in sema (`user_op`: a
located diagnostic, notes at the operands it blames) and a compiler bug
anywhere else (`op`: `IllTypedOp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiledsl import diagnostics as diag
from tiledsl import ops
from tiledsl.dims import Lin, sizes_decide
from tiledsl.dims import build as build_dim
from tiledsl.ir import Edge, Graph, Op, make_attrs
from tiledsl.ops.core import read_types
from tiledsl.source import Span
from tiledsl.types import DType, TensorType

if TYPE_CHECKING:
    from tiledsl.passes.rewrite import Rewriter

Value = int | Edge  # a node (its result 0) or (node, result index) of a kernel


# the float types a kernel holds in f32 and rounds only where it stores them, or casts
HALF = (DType.F16, DType.BF16)


def _read_as(kind: str, types: Sequence[TensorType], t: TensorType) -> tuple[DType | None, ...]:
    """The dtype an op of type `t` reads each operand in (None: as it is); an explicit cast
    reads its operand as it is too, and rounds to its own type."""
    if kind == "cast":
        return (None,) * len(types)
    return tuple(None if r is None else r.dtype for r in read_types(kind, types, t))


class IllTypedOp(diag.InternalError):
    template = "internal compiler error: an ill-typed '{kind}' was built from ({types}): {message}"


class Builder:
    """Adds typed ops to `graph`; with a `rewriter`, each new node is also queued for its
    patterns (`passes/rewrite.py`)."""

    def __init__(self, graph: Graph, rewriter: Rewriter | None = None) -> None:
        self.graph = graph
        self.rewriter = rewriter

    def types(self, operands: Sequence[Value]) -> tuple[TensorType, ...]:
        return tuple(self.graph.result_type(*o) if isinstance(o, tuple) else self.graph.op(o).type
                     for o in operands)

    def type_of(self, kind: str, operands: Sequence[Value], **attrs: Any) -> TensorType | None:
        """The type `op(kind, operands, **attrs)` would have, or None where its rule refuses:
        for a pass that rewrites only when the new op keeps a type."""
        try:
            return ops.infer(kind, self.types(operands), attrs)
        except ops.RuleError:
            return None

    def op(self, kind: str, operands: Sequence[Value], span: Span | None, **attrs: Any) -> int:
        """Add `kind(*operands)` with `attrs`, typed by its rule; a refusal is a compiler bug."""
        types = self.types(operands)
        try:
            t = ops.infer(kind, types, attrs)
        except ops.RuleError as err:
            raise IllTypedOp(span, kind=kind, types=", ".join(map(str, types)), message=str(err)) from None
        return self._add(kind, t, operands, span, attrs)

    def user_op(self, kind: str, operands: Sequence[tuple[int, Span]], span: Span, **attrs: Any) -> int:
        """`op` over operands the user wrote, each with its span: a refusal is the user's
        error, located at `span` with a note at each operand the rule blames."""
        types = self.types([n for n, _ in operands])
        try:
            t = ops.infer(kind, types, attrs)
        except ops.RuleError as err:
            agreed = self._agreed(kind, operands, types, err)
            if agreed is not None:
                return self.user_op(kind, agreed, span, **attrs)
            notes = [diag.Note(f"this operand is {types[i]}", operands[i][1])
                     for i in err.operands if i < len(operands)]
            raise err.cls(span, notes, **err.fields) from None
        return self._add(kind, t, self._promoted(kind, operands, types, t), span, attrs)

    def _promoted(self, kind: str, operands: Sequence[tuple[int, Span]], types: Sequence[TensorType],
                  t: TensorType) -> list[int]:
        """The operands of the user's op, each computed f16 or bf16 value that it reads in a
        wider type (beside an f32 tensor, compared with one) read through a cast to its own
        type: torch promotes the 16-bit value, which a kernel holding it in f32 rounds only
        where it stores it or casts it, so without the cast the result would depend on
        whether the value's kernel stores it (docs/language.md, Numerics). The compiler's own
        ops (`op`) widen the value a kernel holds, as an explicit cast does."""
        return [self.op("cast", [n], s, dtype=ty.dtype) if want not in (None, ty.dtype)
                and ty.dtype in HALF and not ty.weak and not self._holds(n, ty.dtype) else n
                for (n, s), ty, want in zip(operands, types, _read_as(kind, types, t), strict=True)]

    def _holds(self, node: int, dtype: DType, depth: int = 8) -> bool:
        """Does `node` hold a value of `dtype` exactly, as kernels read it: a parameter, a
        cast to `dtype` (where a kernel rounds), or elements moved from one (a view, a
        gather, a `where` of two)?"""
        op = self.graph.op(node)
        if op.kind == "param" or op.kind == "cast" and op.dtype is dtype:
            return True
        moved = ops.category(op.kind) is ops.Category.LAYOUT or op.kind in ("expand", "take", "where")
        if not moved or depth == 0:
            return False
        sources = self.graph.operands(node)[1:] if op.kind == "where" else self.graph.operands(node)[:1]
        return all(self._holds(s, dtype, depth - 1) for s in sources)

    def _agreed(self, kind: str, operands: Sequence[tuple[int, Span]], types: Sequence[TensorType],
                err: ops.RuleError) -> list[tuple[int, Span]] | None:
        """The operands of a refused op read so that dims only the sizes decide agree (a
        broadcast's, a matmul's inner ones), or None where the refusal stands."""
        if err.cls is diag.BroadcastError:
            return self._agree_dim(operands, types, err.fields)
        if kind == "matmul" and err.cls is diag.MatmulShapeError and min(t.rank for t in types) >= 2:
            (a, aspan), (b, bspan) = operands
            k, kb = types[0].shape[-1], types[1].shape[-2]
            if not sizes_decide(k, kb):
                return None
            shape = types[1].shape[:-2] + (k,) + types[1].shape[-1:]
            agreed = self.agree_shape(b, bspan, shape, f"matmul inner dims must agree: {k} and {kb}")
            return None if agreed is None else [(a, aspan), (agreed, bspan)]
        return None

    def _agree_dim(self, operands: Sequence[tuple[int, Span]], types: Sequence[TensorType],
                   fields: dict[str, Any]) -> list[tuple[int, Span]] | None:
        """Operands that disagree in one dim of a broadcast, `a` in some and `b` in others,
        where only the sizes decide: those with `b` read as `a`, checked at every call."""
        a, b = fields["a"], fields["b"]
        if not sizes_decide(a, b):
            return None
        rank = max(t.rank for t in types)
        message = (f"shapes {fields['lhs']} and {fields['rhs']} must agree in dim {fields['dim']} "
                   f"({a} in one, {b} in the other)")
        out = []
        for (node, span), t in zip(operands, types, strict=True):
            at = fields["dim"] - (rank - t.rank)
            if at >= 0 and t.shape[at] == b:
                node = self.agree_shape(node, span, t.shape[:at] + (a,) + t.shape[at + 1:], message)
            out.append((node, span))
        return out

    def agree_shape(self, node: int, span: Span | None, shape: tuple, message: str) -> int | None:
        """`node` read at `shape`, which differs from its own only in dims the sizes of a call
        decide (`sizes_decide`): a reshape, each such pair checked equal at every call
        (`Graph.requires`: both differences at least 0). None where a dim is never equal."""
        t = self.graph.op(node).type
        if t.rank != len(shape):
            return None
        pairs = [(want, got) for want, got in zip(shape, t.shape, strict=True) if want != got]
        if not all(sizes_decide(want, got) for want, got in pairs):
            return None
        for want, got in pairs:
            diff = Lin.of(want) - Lin.of(got)
            self.graph.requires += ((diff.dim(), span, message), ((-diff).dim(), span, message))
        return self.user_op("reshape", [(node, span)], span, shape=tuple(shape), copy=False)

    def copy(self, op: Op, operands: Sequence[Value]) -> int:
        """`op` again (kind, attributes, span) over `operands`, typed by them."""
        return self.op(op.kind, operands, op.span, **op.attr_map)

    def retype(self, node: int) -> None:
        """Type `node` again from its operands, after a pass changed them."""
        op = self.graph.op(node)
        t = self.types(self.graph.operand_edges(node))
        try:
            new = ops.infer(op.kind, t, op.attr_map)
        except ops.RuleError as err:
            raise IllTypedOp(op.span, kind=op.kind, types=", ".join(map(str, t)), message=str(err)) from None
        self.graph.set_op(node, op.replace(dtype=new.dtype, shape=new.shape, weak=new.weak))

    def const(self, value: object, dtype: DType, span: Span | None) -> int:
        """A literal: weak, like a Python scalar."""
        return self.op("const", [], span, value=value, type=TensorType(dtype, (), True))

    def dim(self, symbol: str, span: Span | None) -> int:
        """The size a dim symbol is bound to at the call, a weak i32."""
        return self.op("dim", [], span, symbol=symbol, type=TensorType(DType.I32, (), True))

    def size(self, dim: object, span: Span | None) -> int:
        """A dim (an int or a dim expression) as a weak i32 value, computed from dims."""
        return build_dim(dim, lambda name: self.dim(name, span),
                         lambda k: self.const(k, DType.I32, span),
                         lambda kind, *args: self.op(kind, args, span))

    def param(self, t: TensorType, span: Span | None, **attrs: Any) -> int:
        """A parameter of type `t` (`attrs`: its name, index, whether it is scalar)."""
        return self.op("param", [], span, type=t, **attrs)

    def ret(self, operands: Sequence[Value], span: Span | None) -> int:
        return self.op("return", operands, span)

    def _add(self, kind: str, t: TensorType, operands: Sequence[Value], span: Span | None,
             attrs: dict[str, Any]) -> int:
        node = self.graph.add(Op(kind, t.dtype, t.shape, make_attrs(**attrs), span, t.weak), operands)
        if self.rewriter is not None:
            self.rewriter.created(node)
        return node
