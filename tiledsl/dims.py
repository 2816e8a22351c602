"""Dim expressions: sizes computed from the dims a call binds (`D // 2`, `D - D // 2`, `H * M`).

A dim in a shape is an int, a symbol ("D") or the canonical text of an integer
expression of symbols ("D - (D // 2)"). Canonical means linear combinations are
normalised (terms sorted, like terms added, zero terms dropped; every `//` a
parenthesised atom), so shapes still compare structurally:
`concat(x[..., D // 2:], x[..., :D // 2])` has the dim `D - (D // 2) + (D // 2)`,
which is "D". Expressions are built with `Lin` arithmetic in sema and read back
with `parse` (a walk over Python's own expression syntax that accepts only
names, integers, +, -, *, // and %), so evaluating one at call time never runs text.

Work is bounded by the size of the expression as written: a product of sums is
multiplied out only while the result stays small (`EXPAND_LIMIT` characters), else it
is kept as a product of parenthesised sums (`(A + B) * (C + D)`), and a `%` whose
expansion `a - (a // b) * b` would be large stays one atom (`(a % b)`). Either form has
the same value at every size; only the structural comparison of two such dims is less
complete, and dims it cannot prove equal are checked equal at the call.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tiledsl.types import Dim


@dataclass(frozen=True)
class Lin:
    """const + sum(coeff * atom): atoms are symbols, products of atoms ("H * M") and
    parenthesised floor divisions ("(D // 2)")."""

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def of(dim: Dim) -> Lin:
        if isinstance(dim, int):
            return Lin((), dim)
        return parse(dim)

    @staticmethod
    def _make(terms: Mapping[str, int], const: int) -> Lin:
        return Lin(tuple(sorted(((a, c) for a, c in terms.items() if c != 0),
                              key=lambda t: (not t[0].isidentifier(), t[0]))), const)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __add__(self, other: Lin) -> Lin:
        terms = dict(self.terms)
        for a, c in other.terms:
            terms[a] = terms.get(a, 0) + c
        return Lin._make(terms, self.const + other.const)

    def __neg__(self) -> Lin:
        return Lin(tuple((a, -c) for a, c in self.terms), -self.const)

    def __sub__(self, other: Lin) -> Lin:
        return self + (-other)

    def scale(self, k: int) -> Lin:
        return Lin._make({a: c * k for a, c in self.terms}, self.const * k)

    def __mul__(self, other: Lin) -> Lin:
        if other.is_const:
            return self.scale(other.const)
        if self.is_const:
            return other.scale(self.const)
        if _expanded_size(self, other) > EXPAND_LIMIT:
            return _factored(self, other)
        out: dict[str, int] = {}
        const = 0
        for a, c in (*self.terms, ("", self.const)):
            for b, d in (*other.terms, ("", other.const)):
                if c * d == 0:
                    continue
                atom = " * ".join(sorted((*factors(a), *factors(b))))
                if atom:
                    out[atom] = out.get(atom, 0) + c * d
                else:
                    const += c * d
        return Lin._make(out, const)

    def __floordiv__(self, other: Lin) -> Lin:
        if other.is_const:
            k = other.const
            if k == 0:
                raise ZeroDivisionError("a dim divided by 0")
            if all(c % k == 0 for _, c in self.terms) and self.const % k == 0:
                return Lin._make({a: c // k for a, c in self.terms}, self.const // k)
            if self.is_const:
                return Lin((), self.const // k)
        return Lin(((f"({_operand(self)} // {_operand(other)})", 1),), 0)

    def __mod__(self, other: Lin) -> Lin:
        out = self - (self // other) * other
        if not out.is_const and _size(out) > EXPAND_LIMIT:  # nested `%` would double each time
            return Lin(((f"({_operand(self)} % {_operand(other)})", 1),), 0)
        return out

    def dim(self) -> Dim:
        """The shape entry: an int, a symbol, or the canonical text."""
        if self.is_const:
            return self.const
        if len(self.terms) == 1 and self.terms[0][1] == 1 and not self.const \
                and self.terms[0][0].startswith("(") and len(factors(self.terms[0][0])) == 1:
            return self.terms[0][0][1:-1]  # one floor division or kept `%`: "D // 2"
        return text(self)


# The most characters a product of sums is multiplied out to (a few dozen terms): past it the
# product stays factored, so a program's dims grow with its text, never exponentially.
EXPAND_LIMIT = 512


def _size(x: Lin) -> int:
    """About the length of `text(x)`."""
    return sum(len(a) + 6 for a, _ in x.terms) + (6 if x.const else 0)


def _expanded_size(x: Lin, y: Lin) -> int:
    """About the length of `text(x * y)` multiplied out, without multiplying it out."""
    nx, ny = len(x.terms) + (x.const != 0), len(y.terms) + (y.const != 0)
    return ny * _size(x) + nx * _size(y)


def _content(x: Lin) -> tuple[int, list[str]]:
    """x as `g * product of factors`: g the signed gcd of its coefficients (the first term's
    sign), the factors those of its atom when it is one term, else the parenthesised sum."""
    g = math.gcd(*(c for _, c in x.terms), x.const)
    if x.terms[0][1] < 0:
        g = -g
    if len(x.terms) == 1 and not x.const:
        return g, factors(x.terms[0][0])
    return g, [f"({text(Lin(tuple((a, c // g) for a, c in x.terms), x.const // g))})"]


def _factored(x: Lin, y: Lin) -> Lin:
    """x * y kept as one product atom whose sums stay in parentheses (`(A + B) * (C + D)`)."""
    gx, fx = _content(x)
    gy, fy = _content(y)
    return Lin(((" * ".join(sorted((*fx, *fy))), gx * gy),), 0)


def factors(atom: str) -> list[str]:
    """The factors of a product atom ("(C * W // G) * H" -> ["(C * W // G)", "H"]): split at
    the top-level " * " only."""
    out, depth, start = [], 0, 0
    for k, ch in enumerate(atom):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and atom.startswith(" * ", k):
            out.append(atom[start:k])
            start = k + 3
    out.append(atom[start:])
    return [f for f in out if f]


def floor_divisions(x: Lin) -> list[tuple[str, Lin, Lin]]:
    """The floor divisions among x's factors, as (atom, numerator, divisor): `B_ // W` in
    `(B_ // W) * H` is ("(B_ // W)", B_, W)."""
    out = []
    for atom, _ in x.terms:
        for f in factors(atom):
            node = _tree(f[1:-1]) if f.startswith("(") and f.endswith(")") else None
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) \
                    and all(o[0] != f for o in out):
                out.append((f, parse(ast.unparse(node.left)), parse(ast.unparse(node.right))))
    return out


def exact(x: Lin, divisions: list[tuple[str, Lin, Lin]]) -> Lin:
    """x with `(n // k) * k` written `n` for each (atom, n, k) of `divisions`, floor
    divisions a call has been checked to divide exactly (a reshape to `[B // W, W, ...]`
    checks that its element count is the source's: W divides B)."""
    out = Lin((), x.const)
    for atom, c in x.terms:
        term = Lin(((atom, c),), 0)
        for q, n, k in divisions:
            left = factors(term.terms[0][0]) if term.terms else []
            if q not in left:
                continue
            left.remove(q)
            if k.is_const and c % k.const == 0:
                c = c // k.const
            elif len(k.terms) == 1 and k.terms[0][1] == 1 and not k.const \
                    and all(left.count(f) >= factors(k.terms[0][0]).count(f) for f in factors(k.terms[0][0])):
                for f in factors(k.terms[0][0]):
                    left.remove(f)
            else:
                continue
            rest = Lin(((" * ".join(sorted(left)), c),), 0) if left else Lin((), c)
            term = rest * n
            break
        out = out + term
    return out


def _operand(x: Lin) -> str:
    """`x` as an operand of `//`: bare when it is one atom or a number."""
    t = text(x)
    if x.is_const or (len(x.terms) == 1 and x.terms[0][1] == 1 and x.const == 0):
        return t
    return f"({t})"


def text(x: Lin) -> str:
    out = ""
    for atom, c in x.terms:
        mag = atom if abs(c) == 1 else f"{abs(c)} * {atom}"
        if not out:
            out = mag if c > 0 else f"-{mag}"
        else:
            out += f" + {mag}" if c > 0 else f" - {mag}"
    if not out:
        return str(x.const)
    if x.const:
        out += f" + {x.const}" if x.const > 0 else f" - {-x.const}"
    return out


def never_zero(x: Lin) -> bool:
    """Is a difference of element counts nonzero at every size? Its atoms are products of
    dims, each at least 1 at any call, so terms of one sign never cancel. An atom with a
    factor that can be 0 or negative (a kept `%`, a kept sum of mixed signs) decides nothing."""
    if not all(_positive(a) for a, _ in x.terms):
        return False
    signs = {c > 0 for _, c in x.terms} | ({x.const > 0} if x.const else set())
    return len(signs) == 1


def nonnegative(x: Lin) -> bool:
    """Is x at least 0 at every size? Its atoms are products of dims (each at least 1) and
    floor divisions of such products by positive constants (at least 0), so a sum of them
    with positive coefficients is at least its constant plus those of the products; a floor
    division subtracted, `-(E // k)`, is at least `-E` (`D - D // 2` is at least 0)."""
    if all(c > 0 and _never_negative(a) for a, c in x.terms):
        # a product of dims is at least 1 (`N - 1` is at least 0); a floor division at least 0
        least = x.const + sum(c for a, c in x.terms if all(not f.startswith("(") for f in factors(a)))
        if least >= 0:
            return True
    bounded = Lin()
    for atom, c in x.terms:
        tree = _tree(atom) if atom.startswith("(") else None
        if c < 0 and isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.FloorDiv) \
                and isinstance(tree.right, ast.Constant) and tree.right.value > 0:
            inner = parse(ast.unparse(tree.left))
            if nonnegative(inner) and inner != x:
                bounded = bounded + inner.scale(c)
                continue
        bounded = bounded + Lin(((atom, c),))
    bounded = bounded + Lin((), x.const)
    return bounded != x and nonnegative(bounded)


def _never_negative(atom: str) -> bool:
    for f in factors(atom):
        if not f.startswith("("):
            continue
        tree = _tree(f)
        if not (isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.FloorDiv)
                and isinstance(tree.right, ast.Constant) and tree.right.value > 0):
            return False
        if not nonnegative(parse(ast.unparse(tree.left))):
            return False
    return True


def _positive(atom: str) -> bool:
    """Is a product atom at least 1 at any size (as `never_zero` counts its factors: symbols
    are; a kept sum is when its terms are; a floor division (`D // 2` at D = 1) and a `%`
    may be 0)?"""
    for f in factors(atom):
        if not f.startswith("("):
            continue
        tree = _tree(f)
        if isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.FloorDiv | ast.Mod):
            return False
        inner = parse(f[1:-1])
        if inner.const < 0 or not all(c > 0 and _positive(a) for a, c in inner.terms):
            return False
    return True


def is_symbol(dim: Dim) -> bool:
    """A dim a parameter binds (not an expression of them)."""
    return isinstance(dim, str) and dim.isidentifier()


def sizes_decide(a: Dim, b: Dim) -> bool:
    """Are two dims that differ as written equal at some sizes and not at others, an
    expression among them (`(R + 1) // 2` and `R // 2`; `4` and `D // 2`)? Then a call checks
    them. Two symbols or numbers are refused where they meet: a typo more often than not."""
    plain = (is_symbol(a) or isinstance(a, int)) and (is_symbol(b) or isinstance(b, int))
    return not plain and not never_zero(Lin.of(a) - Lin.of(b))


@functools.lru_cache(maxsize=4096)
def parse(dim: str) -> Lin:
    """The `Lin` of a canonical dim text (or a plain symbol)."""
    return _fold(_tree(dim), lambda name: Lin(((name, 1),), 0), lambda k: Lin((), k))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=4096)
def _tree(dim: str) -> ast.AST:
    """The expression tree of a dim text. Symbols may be any DSL identifier, Python keywords
    included (`in // 2`): each is parsed as `_d_<name>`, then named back."""
    tree = ast.parse(_NAME.sub(lambda m: "_d_" + m.group(0), dim), mode="eval").body
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            node.id = node.id[3:]
    return tree


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _fold(node: ast.AST, name: Callable[[str], Any], number: Callable[[int], Any]) -> Any:
    """Evaluate a dim expression's tree with `name` for symbols and `number` for integers
    (only names, integers, unary minus, +, -, *, // and % are accepted)."""
    if isinstance(node, ast.Name):
        return name(node.id)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_fold(node.operand, name, number)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_fold(node.left, name, number), _fold(node.right, name, number))
    raise ValueError(f"not a dim expression: {ast.unparse(node)!r}")


_KINDS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.FloorDiv: "floordiv",
          ast.Mod: "mod"}


def build(dim: Dim, name: Callable[[str], Any], number: Callable[[int], Any],
          op: Callable[..., Any]) -> Any:
    """Build a dim expression out of graph values: `name` for a symbol, `number` for an
    integer, `op(kind, *operands)` for "neg", "add", "sub", "mul", "floordiv" and "mod"."""
    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return name(node.id)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return number(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return op("neg", walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _KINDS:
            return op(_KINDS[type(node.op)], walk(node.left), walk(node.right))
        raise ValueError(f"not a dim expression: {ast.unparse(node)!r}")

    return walk(_tree(str(dim)))


@functools.lru_cache(maxsize=4096)
def symbols(dim: str) -> tuple[str, ...]:
    """The symbols a dim expression reads."""
    return tuple(sorted({n.id for n in ast.walk(_tree(dim)) if isinstance(n, ast.Name)}))


def evaluate(dim: Dim, dims: Mapping[str, int]) -> int:
    """The size of `dim` at the bound `dims` (which hold the symbols)."""
    if isinstance(dim, int):
        return dim
    if dim in dims:
        return dims[dim]
    return _fold(_tree(dim), dims.__getitem__, int)


def derived(shapes) -> tuple[str, ...]:
    """The dim expressions (not plain symbols) that occur in `shapes`, sorted."""
    return tuple(sorted({d for shape in shapes for d in shape
                         if isinstance(d, str) and not d.isidentifier()}))
