"""Parser: the whole surface syntax of design section 3, spans and precedence."""

import pytest

from tiledsl import ast
from tiledsl.diagnostics import TileDSLError
from tiledsl.parser import parse


def body(src: str):
    return parse(src).kernels[0].body


def ret(expr: str, params: str = "a: f32[N], b: f32[N], c: f32[N]"):
    (stmt,) = body(f"kernel f({params}) -> f32[N] {{ return {expr} }}")
    return stmt.values[0]


def shape(e) -> str:
    """A fully parenthesised rendering of an expression tree."""
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.IntLit | ast.FloatLit | ast.BoolLit):
        return repr(e.value)
    if isinstance(e, ast.Binary):
        return f"({shape(e.lhs)} {e.op} {shape(e.rhs)})"
    if isinstance(e, ast.Unary):
        return f"({e.op}{shape(e.operand)})"
    if isinstance(e, ast.Compare):
        parts = [shape(e.operands[0])]
        for op, x in zip(e.ops, e.operands[1:], strict=True):
            parts += [op, shape(x)]
        return "(" + " ".join(parts) + ")"
    if isinstance(e, ast.Attribute):
        return f"{shape(e.value)}.{e.name}"
    if isinstance(e, ast.Call):
        args = [shape(a) for a in e.args] + [f"{k.name}={shape(k.value)}" for k in e.keywords]
        return f"{e.func}({', '.join(args)})"
    if isinstance(e, ast.StrLit):
        return repr(e.value)
    if isinstance(e, ast.NoneLit):
        return "None"
    if isinstance(e, ast.TupleLit):
        return "(" + ", ".join(shape(i) for i in e.items) + ("," if len(e.items) == 1 else "") + ")"
    raise AssertionError(e)


@pytest.mark.parametrize("expr, expected", [
    ("a + b * c", "(a + (b * c))"),
    ("a - b - c", "((a - b) - c)"),
    ("a / b * c", "((a / b) * c)"),
    ("a @ b.T * c", "((a @ b.T) * c)"),
    ("-a @ b", "((-a) @ b)"),
    ("-a * -b", "((-a) * (-b))"),
    ("+a", "(+a)"),
    ("a < b & b < c", "(a < (b & b) < c)"),  # a chain, as in Python
    ("(a < b) & (b < c)", "((a < b) & (b < c))"),
    ("a | b & c", "(a | (b & c))"),
    ("a + b == c", "((a + b) == c)"),
    ("a.T.T", "a.T.T"),
    ("exp(-a) * 2", "(exp((-a)) * 2)"),
    ("softmax(a, axis=-1)", "softmax(a, axis=(-1))"),
    ('gelu(a, approximate="tanh")', "gelu(a, approximate='tanh')"),
    ("where(a > 0, a, -inf)", "where((a > 0), a, (-inf))"),
    ("1e-6 + .5 + 3. + 2", "(((1e-06 + 0.5) + 3.0) + 2)"),
    ("true | false", "(True | False)"),
    ("a // b * c % d", "(((a // b) * c) % d)"),
    ("a + b % c", "(a + (b % c))"),
    ("-a ** 2", "(-(a ** 2))"),
    ("a ** b ** c", "(a ** (b ** c))"),
    ("a ** -b", "(a ** (-b))"),
    ("2 * a ** 2", "(2 * (a ** 2))"),
    ("a.T ** 2", "(a.T ** 2)"),
    ("~a & b", "((~a) & b)"),
    ("~(a < b)", "(~(a < b))"),
    ("sum(a, axis=(0, -1))", "sum(a, axis=(0, (-1)))"),
    ("sum(a, axis=(1,))", "sum(a, axis=(1,))"),
    ("mean(a, axis=None)", "mean(a, axis=None)"),
])
def test_precedence_follows_python(expr, expected):
    assert shape(ret(expr)) == expected


def test_signature_parts():
    src = """
    @tile(BLOCK_M=64, num_warps=4)
    kernel k(x: f16[B, 16, N], s: f32, m: bool[N]) -> (f16[B, 16, N], f32) {
        return x, s
    }
    """
    k = parse(src, "sig.tdsl").kernels[0]
    assert k.name == "k"
    assert [h.name for h in k.decorators[0].hints] == ["BLOCK_M", "num_warps"]
    assert [p.name for p in k.params] == ["x", "s", "m"]
    assert [d.value for d in k.params[0].type.dims] == ["B", 16, "N"]
    assert k.params[1].type.dims is None  # a scalar parameter
    assert [t.dtype for t in k.returns] == ["f16", "f32"]


def test_statements_end_at_newlines_or_semicolons_and_wrap_inside_parens():
    stmts = body("""
    kernel f(x: f32[N],
             y: f32[N]) -> f32[N] {
        a = x + y; b = a * 2
        c = where(a > 0,
                  b,
                  a)   # a call may wrap

        ;;
        return c
    }
    """)
    assert [type(s).__name__ for s in stmts] == ["Assign", "Assign", "Assign", "Return"]
    assert [s.target for s in stmts[:3]] == ["a", "b", "c"]


def test_comments_and_blank_lines_anywhere():
    src = """# leading comment
# another

kernel f(x: f32[N]) -> f32[N] {   # trailing comment
    # comment line

    return x   # the end
}
# after

kernel g(x: f32[N]) -> f32[N] { return x }
"""
    assert [k.name for k in parse(src).kernels] == ["f", "g"]


def test_spans_point_at_source():
    src = "kernel f(x: f32[N]) -> f32[N] {\n    y = exp(x) * 2\n    return y\n}\n"
    assign = parse(src, "s.tdsl").kernels[0].body[0]
    assert (assign.span.line, assign.span.column) == (2, 5)
    assert assign.value.span.text == "exp(x) * 2"
    assert assign.value.op_span.text == "*"
    call = assign.value.lhs
    assert (call.func_span.line, call.func_span.column) == (2, 9)
    assert assign.value.span.location() == "s.tdsl:2:9"


def test_crlf_line_endings():
    src = "kernel f(x: f32[N]) -> f32[N] {\r\n    y = x\r\n    return y\r\n}\r\n"
    assert len(body(src)) == 2


BAD_LINE_2 = ["kernel f(x: f32[N]) -> f32[N] {", "    y = x $ 2.5", "    return y", "}", ""]
DOLLAR = "p.tdsl:2:11: error: unexpected character '$'; expected one of: '(', ';', '[', '}', a newline, an operator"


def syntax_error(src: str):
    with pytest.raises(TileDSLError) as info:
        parse(src, "p.tdsl")
    return info.value


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_cr_only_and_crlf_line_endings_give_lines_and_columns(newline):
    """Old Mac files end lines with a lone CR (Python reads them as newlines); CRLF lines
    are shown without their CR."""
    assert len(body(newline.join(BAD_LINE_2).replace("$", "*"))) == 2
    err = syntax_error(newline.join(BAD_LINE_2))
    assert (err.line, err.column) == (2, 11)
    assert str(err).splitlines() == [DOLLAR, "        y = x $ 2.5", "              ^"]


def test_utf8_bom_is_accepted_and_not_counted_in_columns():
    assert len(body("\ufeff" + "\n".join(BAD_LINE_2).replace("$", "*"))) == 2
    err = syntax_error("\ufeff" + "\r\n".join(BAD_LINE_2))
    assert str(err).splitlines() == [DOLLAR, "        y = x $ 2.5", "              ^"]
    err = syntax_error("\ufeffkernel f(x: f32[N]) -> f32[N] { return x $ 1 }")
    assert (err.line, err.column) == (1, 42)
    assert str(err).splitlines()[1] == "    kernel f(x: f32[N]) -> f32[N] { return x $ 1 }"


def test_python_and_triton_names_are_ordinary_identifiers():
    stmts = body("""
    kernel f(tl: f32[N], triton: f32[N]) -> f32[N] {
        torch = tl + triton
        range = torch * 2; float = range; pid = float
        return pid
    }""")
    assert [s.target for s in stmts[:-1]] == ["torch", "range", "float", "pid"]


def test_keywords_are_not_names():
    # 'kernelx' and 'returned' are names, not keywords
    stmts = body("kernel f(kernelx: f32[N]) -> f32[N] { returned = kernelx; return returned }")
    assert stmts[0].target == "returned"


def test_chained_comparison_parses_for_a_later_error():
    e = ret("a < b < c")
    assert isinstance(e, ast.Compare) and e.ops == ("<", "<")


def test_depth_is_recorded():
    e = ret("((a + b) * c) - a")
    assert e.depth == 4


BIDI_NOTE = ("note: this codepoint changes the order in which text is shown, so the program a reader "
             "sees can differ from the one compiled (Trojan Source, CVE-2021-42574); if its presence "
             "wasn't intentional, remove it")


@pytest.mark.parametrize("codepoint", [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))])
@pytest.mark.parametrize("line, where, column", [
    ("    return x  # admin: {c} }} return x * 0.0 {c}", "comment", 24),
    ('    return gelu(x, approximate="tanh{c}")', "string", 37),
    ("    return x{c}", "code", 13),
])
def test_bidi_overrides_and_isolates_are_refused_where_they_stand(codepoint, line, where, column):
    """Trojan Source (CVE-2021-42574): a bidi control reorders what an editor shows, so a
    comment or string can show code that is not the code compiled. rustc refuses them in
    comments and literals; so does tiledsl, and anywhere else. The shown line escapes it."""
    src = "kernel f(x: f32[N]) -> f32[N] {\n" + line.format(c=codepoint) + "\n}\n"
    err = syntax_error(src)
    name = {0x202A: "LEFT-TO-RIGHT EMBEDDING", 0x202B: "RIGHT-TO-LEFT EMBEDDING",
            0x202C: "POP DIRECTIONAL FORMATTING", 0x202D: "LEFT-TO-RIGHT OVERRIDE",
            0x202E: "RIGHT-TO-LEFT OVERRIDE", 0x2066: "LEFT-TO-RIGHT ISOLATE",
            0x2067: "RIGHT-TO-LEFT ISOLATE", 0x2068: "FIRST STRONG ISOLATE",
            0x2069: "POP DIRECTIONAL ISOLATE"}[ord(codepoint)]
    lines = str(err).splitlines()
    assert lines[0] == (f"p.tdsl:2:{column}: error: unicode codepoint changing visible direction of text "
                        f"present in {where}: U+{ord(codepoint):04X} {name}")
    assert lines[1] == "    " + line.format(c=f"\\u{ord(codepoint):04x}")
    assert lines[3] == BIDI_NOTE
    assert all(codepoint not in text for text in lines)


def test_other_unicode_in_comments_and_strings_is_fine():
    """Only the bidi controls are refused: an accented comment, or a right-to-left script
    without controls (its order is the text's own), parses."""
    src = "kernel f(x: f32[N]) -> f32[N] {  # café, \u05e9\u05dc\u05d5\u05dd\n    return x\n}\n"
    assert len(body(src)) == 1


def test_a_signature_may_break_before_its_return_type():
    """Model code wraps long signatures: the return type may start the next line."""
    import torch

    import tiledsl

    fn = tiledsl.compile("""kernel f(x: f32[N], y: f32[N])
            -> (f32[N], f32[]) {
        return x + y, sum(x * y, axis=0)
    }""")
    x, y = torch.arange(5.0) + 1, torch.arange(5.0) * 2 - 3
    s, d = fn(x, y)
    assert torch.equal(s, x + y) and d.item() == float((x * y).sum())
