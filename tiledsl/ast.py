"""The abstract syntax tree: frozen nodes, each with the span it was parsed from.

Expressions also record their nesting `depth`, which the parser bounds so that
the recursive passes over the tree (semantic analysis) can never exhaust the
Python stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.source import Source, Span


@dataclass(frozen=True, slots=True)
class Expr:
    span: Span


@dataclass(frozen=True, slots=True)
class Name(Expr):
    id: str


@dataclass(frozen=True, slots=True)
class IntLit(Expr):
    value: int


@dataclass(frozen=True, slots=True)
class FloatLit(Expr):
    value: float


@dataclass(frozen=True, slots=True)
class BoolLit(Expr):
    value: bool


@dataclass(frozen=True, slots=True)
class NoneLit(Expr):
    """`None`: axis=None (every axis)."""


@dataclass(frozen=True, slots=True)
class TupleLit(Expr):
    """`(a, b, ...)`: a tuple of axes, e.g. sum(x, axis=(0, 1))."""

    items: tuple[Expr, ...]
    depth: int


@dataclass(frozen=True, slots=True)
class ListLit(Expr):
    """`[a, b, ...]`: a shape, e.g. reshape(x, [B, H // 2, 2])."""

    items: tuple[Expr, ...]
    depth: int


@dataclass(frozen=True, slots=True)
class Slice(Expr):
    """`start:stop:step` inside a subscript (a missing part is None)."""

    start: Expr | None
    stop: Expr | None
    step: Expr | None


@dataclass(frozen=True, slots=True)
class EllipsisLit(Expr):
    """`...` inside a subscript."""


@dataclass(frozen=True, slots=True)
class Subscript(Expr):
    """`value[item, item, ...]`: items are expressions, `Slice`s, `EllipsisLit` or `NoneLit`."""

    value: Expr
    items: tuple[Expr, ...]
    depth: int


@dataclass(frozen=True, slots=True)
class StrLit(Expr):
    """Only valid as a keyword value, e.g. gelu(x, approximate="tanh")."""

    value: str


@dataclass(frozen=True, slots=True)
class Unary(Expr):
    op: str  # "-", "+" or "~"
    operand: Expr
    depth: int


@dataclass(frozen=True, slots=True)
class Binary(Expr):
    op: str  # "+", "-", "*", "/", "//", "%", "**", "@", "&", "|", "^", "<<", ">>"
    lhs: Expr
    rhs: Expr
    op_span: Span
    depth: int


@dataclass(frozen=True, slots=True)
class Compare(Expr):
    """`a < b`; a chain `a < b < c` parses (so it can be rejected with a clear error)."""

    ops: tuple[str, ...]
    operands: tuple[Expr, ...]
    depth: int


@dataclass(frozen=True, slots=True)
class Keyword:
    name: str
    value: Expr
    span: Span  # the whole `name=value`


@dataclass(frozen=True, slots=True)
class Call(Expr):
    func: str
    func_span: Span
    args: tuple[Expr, ...]
    keywords: tuple[Keyword, ...]
    depth: int


@dataclass(frozen=True, slots=True)
class Attribute(Expr):
    value: Expr
    name: str
    name_span: Span
    depth: int


@dataclass(frozen=True, slots=True)
class Assign:
    target: str
    target_span: Span
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class AssignItem:
    """`name[items] = value`: the name bound to its value with `value` written at the
    elements `name[items]` reads (`target` holds the subscript as an expression)."""

    target: Subscript
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Unpack:
    """`v, i = max(x, -1)` (a builtin with several results) or `a, b = b, a` (a tuple)."""
    targets: tuple[str, ...]
    target_spans: tuple[Span, ...]
    values: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Return:
    values: tuple[Expr, ...]
    span: Span


Stmt = Assign | Unpack | Return


@dataclass(frozen=True, slots=True)
class DimExpr:
    """One dim of a declared shape: a symbol (`M`), an integer literal, or "..." (a generic
    kernel's batch dims, `tiledsl.generic`)."""

    value: str | int
    span: Span


@dataclass(frozen=True, slots=True)
class TypeExpr:
    """`f16[B, M]` (dims is a tuple) or a scalar `f32` (dims is None)."""

    dtype: str
    dtype_span: Span
    dims: tuple[DimExpr, ...] | None
    span: Span


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    type: TypeExpr
    span: Span
    name_span: Span


@dataclass(frozen=True, slots=True)
class Hint:
    name: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Decorator:
    name: str
    hints: tuple[Hint, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class TypeParam:
    """`T: f16 | bf16`: a dtype variable of a generic kernel and the dtypes it may bind."""

    name: str
    dtypes: tuple[str, ...]
    dtype_spans: tuple[Span, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    name_span: Span
    decorators: tuple[Decorator, ...]
    params: tuple[Param, ...]
    returns: tuple[TypeExpr, ...]
    returns_span: Span
    body: tuple[Stmt, ...]
    span: Span
    type_params: tuple[TypeParam, ...] = ()  # a generic kernel's dtype variables


@dataclass(frozen=True, slots=True)
class Program:
    source: Source
    kernels: tuple[Kernel, ...]


def depth(expr: Expr) -> int:
    """Nesting depth of an expression (leaves are 1)."""
    return getattr(expr, "depth", 1)
