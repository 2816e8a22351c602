"""Text -> AST.

One LALR parser, built once per process. It builds a Lark parse tree, which a
non-recursive transformer turns into the AST (so deep nesting never reaches
Python's recursion limit). Every Lark exception is translated into a located
`TileDSLError`; size limits are checked while streaming tokens, before any
tree is built.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterator
from importlib import resources

import lark
import lark.visitors
from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from tiledsl import ast
from tiledsl.builtins import BUILTINS, TORCH_SPELLINGS
from tiledsl.diagnostics import (
    BidiCodepointError,
    EmptySourceError,
    LimitError,
    Note,
    RankError,
    TileDSLError,
    UnexpectedCharacterError,
    UnexpectedEndError,
    UnexpectedTokenError,
)
from tiledsl.dims import Lin
from tiledsl.source import Source, Span

# Checked before parsing (size) or while the tokens stream in (the others), so that
# an oversized input is refused in well under a second, not after a long parse.
MAX_SOURCE_CHARS = 1_000_000
MAX_STATEMENTS = 5_000  # in a program, all kernels together
MAX_STATEMENT_TOKENS = 20_000
MAX_EXPR_DEPTH = 200
MAX_INT_DIGITS = 18  # longer integers fit no i32 value, dim or hint (and Python refuses > 4300)

# How terminals are named in "expected one of ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "COMP_OP": "a comparison",
    "_NL": "a newline",
    "$END": "end of file",
}


# the grammar's word literals (`atom` in grammar.lark): in an expression these words are
# always the literal, so sema refuses them as names of parameters and dims
LITERAL_WORDS = {"inf": "the float literal inf", "true": "the bool literal true",
                 "false": "the bool literal false", "None": "None (axis=None, x[:, None])"}


class _TooLarge(Exception):
    """Raised from the token stream; `parse` turns it into a located `LimitError`."""

    def __init__(self, tok: Token, what: str, limit: int) -> None:
        super().__init__(what)
        self.tok, self.what, self.limit = tok, what, limit


class _Newlines:
    """Post-lexer: a newline inside (...) or [...] does not end a statement. It also
    counts statements and tokens as they stream in, so the parser stops at a limit."""

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = statements = tokens = 0  # tokens: since the last statement boundary
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            if tok.type in ("_NL", "SEMICOLON", "LBRACE", "RBRACE"):
                statements += tokens > 0 and tok.type != "LBRACE"  # not the kernel's header
                tokens = 0
                if statements > MAX_STATEMENTS:
                    raise _TooLarge(tok, "the number of statements in a program", MAX_STATEMENTS)
            else:
                tokens += 1
                if tokens > MAX_STATEMENT_TOKENS:
                    raise _TooLarge(tok, "the number of tokens in a statement", MAX_STATEMENT_TOKENS)
            yield tok


class _Builder(lark.visitors.Transformer_NonRecursive):
    """Builds `tiledsl.ast` nodes from the parse tree, without recursion."""

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.src = source

    # helpers ------------------------------------------------------------------

    def _span(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return Span(self.src, 0, 0)
        return Span(self.src, meta.start_pos, meta.end_pos)

    def _tok(self, tok: Token) -> Span:
        return Span(self.src, tok.start_pos, tok.end_pos)

    def _int(self, tok: Token) -> int:
        text = str(tok)
        hexadecimal = text[:2] in ("0x", "0X")
        digits = len(text[2:].lstrip("0") if hexadecimal else text.lstrip("0"))
        if digits > MAX_INT_DIGITS:
            raise LimitError(self._tok(tok), what=f"the length of an integer literal ({digits} digits)",
                             limit=f"{MAX_INT_DIGITS} digits")
        return int(text, 16) if hexadecimal else int(text)

    def _nested(self, span: Span, *children: ast.Expr) -> int:
        d = 1 + max((ast.depth(c) for c in children), default=0)
        if d > MAX_EXPR_DEPTH:
            raise LimitError(span, what="expression nesting depth", limit=MAX_EXPR_DEPTH)
        return d

    def _binary(self, meta, children, op: str) -> ast.Binary:
        lhs, rhs = children
        span = self._span(meta)
        between = self.src.text.find(op, lhs.span.end, rhs.span.start)
        op_span = Span(self.src, between, between + len(op)) if between >= 0 else span
        return ast.Binary(span, op, lhs, rhs, op_span, self._nested(span, lhs, rhs))

    # program structure --------------------------------------------------------

    @lark.v_args(meta=True)
    def start(self, meta, kernels):
        return ast.Program(self.src, tuple(kernels))

    @lark.v_args(meta=True)
    def kernel(self, meta, children):
        decorators = tuple(c for c in children if isinstance(c, ast.Decorator))
        name = next(c for c in children if isinstance(c, Token))
        params = tuple(c for c in children if isinstance(c, ast.Param))
        returns, returns_span = next(c for c in children if isinstance(c, _Returns))
        type_params = next((c for c in children if isinstance(c, _TypeParams)), ())
        body = children[-1]
        return ast.Kernel(
            str(name), self._tok(name), decorators, params, returns, returns_span, body,
            self._span(meta), tuple(type_params),
        )

    def type_params(self, children):
        return _TypeParams(children)

    @lark.v_args(meta=True)
    def type_param(self, meta, children):
        name, *dtypes = children
        return ast.TypeParam(str(name), tuple(str(d) for d in dtypes), tuple(self._tok(d) for d in dtypes),
                             self._span(meta))

    @lark.v_args(meta=True)
    def decorator(self, meta, children):
        name, *hints = children
        return ast.Decorator(str(name), tuple(hints), self._span(meta))

    @lark.v_args(meta=True)
    def hint(self, meta, children):
        name, value = children
        return ast.Hint(str(name), value, self._span(meta))

    @lark.v_args(meta=True)
    def param(self, meta, children):
        name, typ = children
        return ast.Param(str(name), typ, self._span(meta), self._tok(name))

    @lark.v_args(meta=True)
    def scalar_type(self, meta, children):
        (dtype,) = children
        return ast.TypeExpr(str(dtype), self._tok(dtype), None, self._span(meta))

    @lark.v_args(meta=True)
    def tensor_type(self, meta, children):
        dtype, *dims = children
        return ast.TypeExpr(str(dtype), self._tok(dtype), tuple(dims), self._span(meta))

    def dim_symbol(self, children):
        (tok,) = children
        return ast.DimExpr(str(tok), self._tok(tok))

    @lark.v_args(meta=True)
    def dim_ellipsis(self, meta, children):
        return ast.DimExpr("...", self._span(meta))

    def dim_literal(self, children):
        (tok,) = children
        return ast.DimExpr(self._int(tok), self._tok(tok))

    def _dim_op(self, meta, children, op) -> ast.DimExpr:
        for c in children:
            if c.value == "...":
                raise RankError(c.span, message="'...' stands for leading dims: it takes no arithmetic")
        a, b = (Lin.of(c.value) for c in children)
        span = self._span(meta)
        if op == "//" and b.is_const and b.const <= 0:
            raise RankError(children[1].span, message=(
                f"a dim can only be divided by a positive number, got {b.const}"))
        value = {"+": a.__add__, "-": a.__sub__, "*": a.__mul__, "//": a.__floordiv__}[op](b)
        return ast.DimExpr(value.dim(), span)

    @lark.v_args(meta=True)
    def dim_add(self, meta, children):
        return self._dim_op(meta, children, "+")

    @lark.v_args(meta=True)
    def dim_sub(self, meta, children):
        return self._dim_op(meta, children, "-")

    @lark.v_args(meta=True)
    def dim_mul(self, meta, children):
        return self._dim_op(meta, children, "*")

    @lark.v_args(meta=True)
    def dim_floordiv(self, meta, children):
        return self._dim_op(meta, children, "//")

    @lark.v_args(meta=True)
    def ret_single(self, meta, children):
        return _Returns((tuple(children), self._span(meta)))

    @lark.v_args(meta=True)
    def ret_tuple(self, meta, children):
        return _Returns((tuple(children), self._span(meta)))

    @lark.v_args(meta=True)
    def block(self, meta, stmts):
        return tuple(stmts)

    @lark.v_args(meta=True)
    def assign(self, meta, children):
        name, value = children
        return ast.Assign(str(name), self._tok(name), value, self._span(meta))

    @lark.v_args(meta=True)
    def assign_item(self, meta, children):
        name, *items, value = (c for c in children if c is not None)
        target = ast.Name(self._tok(name), str(name))
        end = self.src.text.index("]", items[-1].span.end) + 1  # the subscript's closing bracket
        span = Span(self.src, name.start_pos, end)
        sub = ast.Subscript(span, target, tuple(items), self._nested(span, target, *items))
        return ast.AssignItem(sub, value, self._span(meta))

    @lark.v_args(meta=True)
    def unpack(self, meta, children):
        n = next(i for i, c in enumerate(children) if not isinstance(c, lark.Token))  # NAME, NAME, ... =
        names, values = children[:n], [c for c in children[n:] if c is not None]
        return ast.Unpack(tuple(str(n) for n in names), tuple(self._tok(n) for n in names),
                          tuple(values), self._span(meta))

    @lark.v_args(meta=True)
    def return_(self, meta, values):
        return ast.Return(tuple(values), self._span(meta))

    # expressions ----------------------------------------------------------------

    @lark.v_args(meta=True)
    def compare(self, meta, children):
        operands = tuple(children[0::2])
        ops = tuple(str(t) for t in children[1::2])
        span = self._span(meta)
        return ast.Compare(span, ops, operands, self._nested(span, *operands))

    @lark.v_args(meta=True)
    def or_(self, meta, c):
        return self._binary(meta, c, "|")

    @lark.v_args(meta=True)
    def xor(self, meta, c):
        return self._binary(meta, c, "^")

    @lark.v_args(meta=True)
    def and_(self, meta, c):
        return self._binary(meta, c, "&")

    @lark.v_args(meta=True)
    def shl(self, meta, c):
        return self._binary(meta, c, "<<")

    @lark.v_args(meta=True)
    def shr(self, meta, c):
        return self._binary(meta, c, ">>")

    @lark.v_args(meta=True)
    def add(self, meta, c):
        return self._binary(meta, c, "+")

    @lark.v_args(meta=True)
    def sub(self, meta, c):
        return self._binary(meta, c, "-")

    @lark.v_args(meta=True)
    def mul(self, meta, c):
        return self._binary(meta, c, "*")

    @lark.v_args(meta=True)
    def div(self, meta, c):
        return self._binary(meta, c, "/")

    @lark.v_args(meta=True)
    def matmul(self, meta, c):
        return self._binary(meta, c, "@")

    @lark.v_args(meta=True)
    def floordiv(self, meta, c):
        return self._binary(meta, c, "//")

    @lark.v_args(meta=True)
    def mod(self, meta, c):
        return self._binary(meta, c, "%")

    @lark.v_args(meta=True)
    def pow(self, meta, c):
        return self._binary(meta, c, "**")

    def _unary(self, meta, children, op: str) -> ast.Unary:
        (operand,) = children
        span = self._span(meta)
        return ast.Unary(span, op, operand, self._nested(span, operand))

    @lark.v_args(meta=True)
    def neg(self, meta, children):
        return self._unary(meta, children, "-")

    @lark.v_args(meta=True)
    def pos(self, meta, children):
        return self._unary(meta, children, "+")

    @lark.v_args(meta=True)
    def invert(self, meta, children):
        return self._unary(meta, children, "~")

    @lark.v_args(meta=True)
    def attribute(self, meta, children):
        value, name = children
        span = self._span(meta)
        return ast.Attribute(span, value, str(name), self._tok(name), self._nested(span, value))

    @lark.v_args(meta=True)
    def subscript(self, meta, children):
        value, *items = (c for c in children if c is not None)
        span = self._span(meta)
        return ast.Subscript(span, value, tuple(items), self._nested(span, value, *items))

    @lark.v_args(meta=True)
    def ellipsis(self, meta, children):
        return ast.EllipsisLit(self._span(meta))

    @lark.v_args(meta=True)
    def slice(self, meta, children):
        parts: list[ast.Expr | None] = [None, None, None]
        k = 0
        for c in children:
            if isinstance(c, Token) and c.type == "COLON":
                k += 1
            elif c is not None:
                parts[k] = c
        return ast.Slice(self._span(meta), *parts)

    @lark.v_args(meta=True)
    def call(self, meta, children):
        func, *args = children
        positional = tuple(a for a in args if isinstance(a, ast.Expr))
        keywords = tuple(a for a in args if isinstance(a, ast.Keyword))
        span = self._span(meta)
        depth = self._nested(span, *positional, *(k.value for k in keywords))
        return ast.Call(span, str(func), self._tok(func), positional, keywords, depth)

    @lark.v_args(meta=True)
    def kwarg(self, meta, children):
        name, value = children
        return ast.Keyword(str(name), value, self._span(meta))

    @lark.v_args(meta=True)
    def kwarg_str(self, meta, children):
        name, tok = children
        value = ast.StrLit(self._tok(tok), str(tok)[1:-1])
        return ast.Keyword(str(name), value, self._span(meta))

    def name(self, children):
        (tok,) = children
        return ast.Name(self._tok(tok), str(tok))

    def int_lit(self, children):
        (tok,) = children
        return ast.IntLit(self._tok(tok), self._int(tok))

    def float_lit(self, children):
        (tok,) = children
        return ast.FloatLit(self._tok(tok), float(tok))

    @lark.v_args(meta=True)
    def inf_lit(self, meta, children):
        return ast.FloatLit(self._span(meta), float("inf"))

    @lark.v_args(meta=True)
    def true_lit(self, meta, children):
        return ast.BoolLit(self._span(meta), True)

    @lark.v_args(meta=True)
    def false_lit(self, meta, children):
        return ast.BoolLit(self._span(meta), False)

    @lark.v_args(meta=True)
    def none_lit(self, meta, children):
        return ast.NoneLit(self._span(meta))

    @lark.v_args(meta=True)
    def tuple_lit(self, meta, children):
        items = tuple(c for c in children if c is not None)
        span = self._span(meta)
        return ast.TupleLit(span, items, self._nested(span, *items))

    @lark.v_args(meta=True)
    def list_lit(self, meta, children):
        items = tuple(c for c in children if c is not None)
        span = self._span(meta)
        return ast.ListLit(span, items, self._nested(span, *items))


class _Returns(tuple):
    """(types, span) of a kernel's declared return type(s)."""


class _TypeParams(tuple):
    """A generic kernel's dtype variables (`ast.TypeParam`s)."""


@functools.cache
def _lark() -> lark.Lark:
    grammar = resources.files("tiledsl").joinpath("grammar.lark").read_text()
    return lark.Lark(
        grammar,
        parser="lalr",
        lexer="contextual",
        postlex=_Newlines(),
        propagate_positions=True,
        maybe_placeholders=False,
    )


def normalize_newlines(text: str) -> str:
    """The text as the grammar and `Source` read it: without a leading UTF-8 byte order
    mark (editors on Windows write one), and with CRLF and a lone CR (old Mac files) as
    LF, as Python's own tokenizer reads source, so lines and columns are the editor's."""
    text = text.removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


# Unicode's explicit bidi embeddings, overrides and isolates (LRE RLE PDF LRO RLO, LRI RLI
# FSI PDI): they reorder how a line is shown, so a comment or string can show code that is
# not the code compiled (Trojan Source, CVE-2021-42574). rustc refuses the same set.
BIDI_CODEPOINTS = re.compile("[\u202a-\u202e\u2066-\u2069]")
_BIDI_NOTE = ("this codepoint changes the order in which text is shown, so the program a reader "
              "sees can differ from the one compiled (Trojan Source, CVE-2021-42574); if its "
              "presence wasn't intentional, remove it")


def refuse_bidi(source: Source) -> None:
    """A located error at the first bidi codepoint of the text, naming where it stands: in
    a comment, in a string, or in code."""
    text = source.text
    found = BIDI_CODEPOINTS.search(text)
    if found is None:
        return
    first = found.start()
    where, quote = "code", None
    for i in range(text.rfind("\n", 0, first) + 1, first):
        ch = text[i]
        if quote is not None:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            where = "comment"
            break
    if quote is not None:
        where = "string"
    ch = text[first]
    raise BidiCodepointError(Span(source, first, first + 1), [Note(_BIDI_NOTE)], where=where,
                             codepoint=f"U+{ord(ch):04X} {unicodedata.name(ch)}")


def parse(text: str, name: str = "<string>") -> ast.Program:
    """Parse program text into an AST, raising `TileDSLError` on any problem."""
    if len(text) > MAX_SOURCE_CHARS:
        raise LimitError(Span(Source(text, name), 0, 0), what="program size in characters",
                         limit=MAX_SOURCE_CHARS)
    text = normalize_newlines(text)
    source = Source(text, name)
    refuse_bidi(source)
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as err:
        raise _syntax_error(source, err) from None
    except _TooLarge as err:
        start = err.tok.start_pos or 0
        raise LimitError(Span(source, start, max(start, err.tok.end_pos or start)), what=err.what,
                         limit=err.limit) from None
    try:
        program = _Builder(source).transform(tree)
    except lark.exceptions.VisitError as err:
        if isinstance(err.orig_exc, TileDSLError):
            raise err.orig_exc from None
        raise
    if not program.kernels:
        raise EmptySourceError(Span(source, len(text), len(text)))
    return program


_OPERATOR_TEXTS = {"&", "|", "^", "<<", ">>", "+", "-", "*", "/", "//", "%", "**", "@", "."}


@functools.cache
def _operators() -> frozenset[str]:
    """The names of the binary operator terminals (lark names some of them itself)."""
    return frozenset({"COMP_OP"} | {t.name for t in _lark().terminals
                                    if t.pattern.type == "str" and t.pattern.value in _OPERATOR_TEXTS})


def _expected(err: UnexpectedInput) -> set[str]:
    """The terminals the parser would have accepted where it stopped."""
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        try:
            return set(interactive.accepts())
        except UnexpectedInput:
            pass
    return set(getattr(err, "accepts", None) or getattr(err, "expected", None)
               or getattr(err, "allowed", None) or ())


def _describe_expected(names: set[str]) -> str:
    names = {n for n in names if not n.startswith("__IGNORE")}
    if not names:
        return ""
    shown = set()
    operators = _operators()
    if len(names & operators) >= 3:
        # After a complete operand every binary operator fits; say so once.
        names -= operators - {"MINUS", "PLUS"} if "NAME" in names else operators
        shown.add("an operator")
    shown |= {_terminal_display(n) for n in names}
    ordered = sorted(shown, key=lambda s: (not s.startswith("'"), s))
    if len(ordered) == 1:
        return f"; expected {ordered[0]}"
    return "; expected one of: " + ", ".join(ordered)


@functools.cache
def _terminal_display(name: str) -> str:
    if name in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[name]
    for term in _lark().terminals:
        if term.name == name and term.pattern.type == "str":
            return f"'{term.pattern.value}'"
    return name.lower()


def _token_display(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "newline"
    if tok.type in ("NAME", "INT", "FLOAT", "STRING"):
        return f"{_TERMINAL_NAMES[tok.type].split(' ', 1)[1]} '{tok}'"
    return f"'{tok}'"


# Python and torch spellings that are not tiledsl, and what to write instead.
_PYTHON_WORDS = {"not": "~x for logical not (on bools)", "and": "a & b for logical and (on bools)",
                 "or": "a | b for logical or (on bools)"}
_MODULES = ("np", "numpy", "torch", "tl", "math", "F", "triton")


def _habit_notes(source: Source, start: int, token: str) -> list[Note]:
    """A note naming the tiledsl spelling when the text at `start` is a Python/torch habit."""
    before = source.text[:start].rstrip()
    words = before.split()
    last = words[-1] if words else ""
    word = token if token in _PYTHON_WORDS else last
    if word in _PYTHON_WORDS:
        return [Note(f"tiledsl has no '{word}' keyword: write {_PYTHON_WORDS[word]}")]
    if token == "if":
        return [Note("a conditional value is where(cond, a, b)")]
    module, dot, func = last.rpartition(".")
    if token == "(" and dot and module.split("(")[-1] in _MODULES and func:
        if func in TORCH_SPELLINGS and func not in BUILTINS:
            return [Note(f"tiledsl writes {TORCH_SPELLINGS[func].format(x='x')}")]
        return [Note(f"builtins are called by their bare names: {func}(...)")]
    if token == "(" and dot and module.isidentifier() and func.isidentifier():  # x.reshape(...)
        name = TORCH_SPELLINGS.get(func, f"{func}({{x}}, ...)").format(x=module)
        return [Note(f"tiledsl values have no methods: write {name}")]
    return []


def _syntax_error(source: Source, err: UnexpectedInput) -> TileDSLError:
    end = len(source.text)
    if isinstance(err, UnexpectedCharacters):
        pos = err.pos_in_stream
        return UnexpectedCharacterError(
            Span(source, pos, pos + 1), _habit_notes(source, pos, source.text[pos]),
            char=source.text[pos], expected=_describe_expected(_expected(err))
        )
    if isinstance(err, UnexpectedEOF) or (
        isinstance(err, UnexpectedToken) and err.token.type == "$END"
    ):
        return UnexpectedEndError(Span(source, end, end), expected=_describe_expected(_expected(err)))
    if isinstance(err, UnexpectedToken):
        tok = err.token
        start = tok.start_pos if tok.start_pos is not None else end
        stop = tok.end_pos if tok.end_pos is not None else start
        if tok.type == "_NL":
            stop = start + 1
        return UnexpectedTokenError(
            Span(source, start, stop), _habit_notes(source, start, str(tok)), token=_token_display(tok),
            expected=_describe_expected(_expected(err)),
        )
    return UnexpectedCharacterError(Span(source, 0, 1), char="?", expected="")
