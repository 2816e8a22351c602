"""Diagnostics: the exact rendered text of every kind of user error, and nothing crashes."""

import string
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiledsl
from tiledsl import TileDSLError
from tiledsl import diagnostics as diag

K = "kernel f(x: f32[M, N], y: f32[N, K]) -> f32[M, N] {\n    %s\n}\n"


def error(src: str, **kw) -> TileDSLError:
    with pytest.raises(TileDSLError) as info:
        tiledsl.compile(src, **kw)
    return info.value


def rendered(src: str, **kw) -> str:
    return str(error(src, **kw))


def expect(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


# --- syntax ----------------------------------------------------------------------------


def test_empty_program():
    err = error("")
    assert isinstance(err, diag.EmptySourceError)
    assert str(err).splitlines()[0] == \
        "<string>:1:1: error: the program is empty: expected at least one 'kernel'"


def test_only_comments_is_empty():
    assert isinstance(error("# nothing here\n\n# at all\n"), diag.EmptySourceError)


def test_truncated_program():
    assert rendered("kernel f(x: f32[N]) -> f32[N] {\n    return x") == expect("""
        <string>:2:13: error: unexpected end of file; expected one of: '(', ',', ';', '[', '}', a newline, an operator
                return x
                        ^
    """)


def test_unknown_character():
    assert rendered("kernel f(x: f32[N]) -> f32[N] {\n    return x ? 2\n}") == expect("""
        <string>:2:14: error: unexpected character '?'; expected one of: '(', ',', ';', '[', '}', a newline, an operator
                return x ? 2
                         ^
    """)


def test_unexpected_token_lists_what_fits():
    assert rendered("kernel f(x: f32[N]) f32[N] {\n    return x\n}") == expect("""
        <string>:1:21: error: unexpected name 'f32'; expected one of: '->', a newline
            kernel f(x: f32[N]) f32[N] {
                                ^~~
    """)


def test_control_characters_are_escaped():
    text = rendered("kernel f(x: f32[N]) -> f32[N] {\n    return x\x1b[31m\n}")
    assert "\x1b" not in text
    assert text.splitlines()[0].startswith("<string>:2:13: error: unexpected character '\\x1b'")
    assert text.splitlines()[1] == "        return x\\x1b[31m"


def test_file_name_with_control_characters_is_escaped(tmp_path):
    path = tmp_path / "bad\x07name.tdsl"
    path.write_text("kernel f(x: f32[N]) -> f32[N] {\n    return y\n}\n")
    text = rendered(path)
    assert "\x07" not in text and "bad\\x07name.tdsl:2:12: error: undefined name 'y'" in text


# --- names and calls ---------------------------------------------------------------------


def test_unknown_function_suggests():
    assert rendered(K % "return sofmax(x)") == expect("""
        <string>:2:12: error: unknown function 'sofmax'; did you mean 'softmax'?
                return sofmax(x)
                       ^~~~~~
    """)


def test_wrong_number_of_arguments():
    assert rendered(K % "return exp(x, y)").splitlines()[0] == \
        "<string>:2:12: error: 'exp' takes 1 argument, got 2"
    assert rendered(K % "return where(x > 0, x)").splitlines()[0] == \
        "<string>:2:12: error: 'where' takes 3 arguments, got 2"
    assert rendered(K % "return sum(x, 1, true, 3)").splitlines()[0] == \
        "<string>:2:12: error: 'sum' takes 1 to 3 arguments, got 4"


def test_undefined_name_and_near_miss():
    assert rendered(K % "return x + z") == expect("""
        <string>:2:16: error: undefined name 'z'
                return x + z
                           ^
    """)
    assert rendered(K % "return xx + 1").splitlines()[0] == \
        "<string>:2:12: error: undefined name 'xx'; did you mean 'x'?"
    assert rendered(K % "return exp + x").splitlines()[0] == \
        "<string>:2:12: error: undefined name 'exp'; 'exp' is a function, call it as exp(...)"


def test_keyword_errors():
    assert rendered(K % "return softmax(x, dim=1)") == expect("""
        <string>:2:23: error: 'softmax' has no parameter 'dim' (parameters: x, axis)
                return softmax(x, dim=1)
                                  ^~~~~
    """)
    assert rendered(K % "return softmax(x, -1, axis=1)").splitlines()[0] == \
        "<string>:2:27: error: 'softmax' got two values for 'axis'"
    assert rendered(K % "return sum(x, axis=y)").splitlines()[0] == \
        "<string>:2:24: error: 'axis' of 'sum' must be an integer constant"
    assert rendered(K % 'return gelu(x, approximate="fast")').splitlines()[0] == \
        "<string>:2:32: error: 'approximate' must be \"none\" or \"tanh\""


def test_parameter_declared_twice_points_at_both():
    assert rendered("kernel f(x: f32[N], x: f32[N]) -> f32[N] {\n    return x\n}") == expect("""
        <string>:1:21: error: parameter 'x' is declared twice
            kernel f(x: f32[N], x: f32[N]) -> f32[N] {
                                ^
        <string>:1:10: note: first declared here
            kernel f(x: f32[N], x: f32[N]) -> f32[N] {
                     ^
    """)


def test_parameter_that_is_also_a_dim():
    assert rendered("kernel f(N: f32[N]) -> f32[N] {\n    return N\n}").splitlines()[0] == \
        "<string>:1:10: error: 'N' names both a parameter and a dimension"


def test_misc_name_errors():
    assert rendered(K % "return x(1)").splitlines()[0] == \
        "<string>:2:12: error: 'x' is a variable, not a function"
    assert rendered(K % "return x.shape").splitlines()[0] == \
        "<string>:2:14: error: unknown attribute '.shape': only '.T' (swap the last two dims) is supported"
    assert rendered(K % "return cast(x, f61)").splitlines()[0] == \
        "<string>:2:20: error: unknown dtype 'f61'; did you mean 'f16'?"
    assert rendered("kernel f(x: f23[N]) -> f32[N] {\n    return x\n}").splitlines()[0] == \
        "<string>:1:13: error: unknown dtype 'f23'; did you mean 'f32'?"
    assert rendered(K % "return where(0 < x < 1, x, 0.0)").splitlines()[0] == \
        "<string>:2:18: error: comparisons cannot be chained; write '(a < b) & (b < c)'"
    assert rendered(K % "return x * 3000000000").splitlines()[0] == (
        "<string>:2:16: error: integer literal 3000000000 must be at most 2147483647 "
        "(it must fit in i32)")


# --- Python and torch habits: a note names the tiledsl spelling --------------------------------

HABITS = {
    "return max(x, 0.0)": (
        "<string>:2:19: error: 'axis' of 'max' must be an integer constant",
        "note: 'max' reduces along an axis; the elementwise maximum of two values is maximum(a, b)"),
    "return x / max(x[0, 0], 1e-5)": (  # gpt-fast's `logits / max(temperature, 1e-5)`
        "<string>:2:16: error: 'max' needs a value of rank 1 or more",
        "note: 'max' reduces along an axis; the elementwise maximum of two values is maximum(a, b)"),
    "return min(x, 2)": (
        "<string>:2:19: error: axis 2 is out of range for a value of rank 2 (valid: -2 to 1)",
        "note: 'min' reduces along an axis; the elementwise minimum of two values is minimum(a, b)"),
    "return cast(x, float32)": (
        "<string>:2:20: error: unknown dtype 'float32'; did you mean 'f32'?",
        "note: the dtypes are f16, bf16, f32, i8, u8, i16, i32, i64, bool, f8e4m3, f8e5m2"),
    "return not x": (
        "<string>:2:16: error: unexpected name 'x'; expected one of: '(', ',', ';', '[', '}', a newline, an operator",
        "note: tiledsl has no 'not' keyword: write ~x for logical not (on bools)"),
    "return where((x > 0) and (x < 1), x, 0.0)": (
        "<string>:2:26: error: unexpected name 'and'; expected one of: ')', ',', '[', an operator",
        "note: tiledsl has no 'and' keyword: write a & b for logical and (on bools)"),
    "return x if x > 0 else 0.0": (
        "<string>:2:14: error: unexpected name 'if'; expected one of: '(', ',', ';', '[', '}', a newline, an operator",
        "note: a conditional value is where(cond, a, b)"),
    "return torch.clamp(x, 0, 1)": (
        "<string>:2:23: error: unexpected '('; expected one of: ',', ';', '[', '}', a newline, an operator",
        "note: builtins are called by their bare names: clamp(...)"),
    "return sum(x, axis=(1, -1))": (
        "<string>:2:28: error: axis -1 appears twice in the axes of 'sum'", ""),
    "return x * (1, 2)": (
        "<string>:2:16: error: a tuple is only allowed as the axes of a reduction, e.g. sum(x, axis=(0, 1))", ""),
    "return x * None": (
        "<string>:2:16: error: None is only allowed as axis=None (every axis)", ""),
    "return cast(cast(x, f8e4m3), f32) + cast(x, f8e4m3)": (
        "<string>:2:12: error: '+' cannot compute on f8e4m3 values: f8 is for storage and matmul operands; "
        "cast(x, f32) first", "<string>:2:41: note: this operand is f8e4m3[M, N]"),
    "return cast(x, f8e5m2) @ y": (
        "<string>:2:12: error: an f8 matmul needs both operands in f8, got f8e5m2 @ f32; cast the f32 operand",
        "<string>:2:30: note: this operand is f32[N, K]"),
    "return ~x": (
        "<string>:2:12: error: '~' needs a bool or integer operand, got f32; compare first, e.g. ~(x > 0)",
        "<string>:2:13: note: this operand is f32[M, N]"),
    "return x.reshape([-1])": (
        "<string>:2:21: error: unexpected '('; expected one of: ',', ';', '[', '}', a newline, an operator",
        "note: tiledsl values have no methods: write reshape(x, [...])"),
    "return x.unsqueeze(0)": (
        "<string>:2:23: error: unexpected '('; expected one of: ',', ';', '[', '}', a newline, an operator",
        "note: tiledsl values have no methods: write x[:, None] (None adds an axis where it stands)"),
    "return cat(x, x, axis=0)": (
        "<string>:2:12: error: unknown function 'cat'; tiledsl writes concat(a, b, axis=...)", ""),
    "return torch.view(x, [-1])": (
        "<string>:2:22: error: unexpected '('; expected one of: ',', ';', '[', '}', a newline, an operator",
        "note: tiledsl writes reshape(x, [...])"),
    "return x.masked_fill(x > 0, 0.0)": (
        "<string>:2:25: error: unexpected '('; expected one of: ',', ';', '[', '}', a newline, an operator",
        "note: tiledsl values have no methods: write where(mask, value, x), or x[mask] = value"),
    "return (x > 0) // 2": (
        "<string>:2:12: error: '//' is not defined for bool values",
        "<string>:2:13: note: this operand is bool[M, N]"),
}


@pytest.mark.parametrize("body", list(HABITS))
def test_python_and_torch_habits_get_a_note(body):
    lines = rendered(K % body).splitlines()
    first, note = HABITS[body]
    assert lines[0] == first
    assert note in lines or not note


# --- types and shapes -----------------------------------------------------------------------


def test_matmul_of_incompatible_dims_notes_both_operands():
    assert rendered(K % "return x @ x") == expect("""
        <string>:2:12: error: matmul inner dims differ: [M, N] @ [M, N] contracts N with M; did you mean to transpose the right operand with .T?
                return x @ x
                       ^~~~~
        <string>:2:12: note: this operand is f32[M, N]
                return x @ x
                       ^
        <string>:2:16: note: this operand is f32[M, N]
                return x @ x
                           ^
    """)


def test_non_broadcastable_shapes():
    assert rendered(K % "return x + y").splitlines()[0] == (
        "<string>:2:12: error: shapes [M, N] and [N, K] cannot be broadcast: "
        "dim 0 is M in one and N in the other")


def test_softmax_axis_out_of_range():
    assert rendered(K % "return softmax(x, axis=5)") == expect("""
        <string>:2:28: error: axis 5 is out of range for a value of rank 2 (valid: -2 to 1)
                return softmax(x, axis=5)
                                       ^
    """)


def test_dtype_rules():
    assert rendered(K % "return where(x, x, 0.0)").splitlines()[0] == \
        "<string>:2:12: error: the condition of 'where' must be bool, got f32"
    assert rendered("kernel f(x: i32[N]) -> f32 {\n    return mean(x)\n}").splitlines()[0] == \
        "<string>:2:12: error: 'mean' needs a floating-point input, got i32; use cast(x, f32) first"
    assert rendered(K % "return (x > 0) & x").splitlines()[0] == \
        "<string>:2:12: error: '&' needs bool or integer operands, got f32; compare first, e.g. (x > 0)"
    assert rendered("kernel f(x: f32[N]) -> f32[N] {\n    return x.T\n}").splitlines()[0] == \
        "<string>:2:12: error: '.T' needs a value of rank 2 or more, got rank 1"
    assert rendered("kernel f(x: bool[N]) -> bool[N] {\n    return -x\n}").splitlines()[0] == \
        "<string>:2:12: error: '-' is not defined for bool values"


def test_declared_return_shape_that_cannot_be_produced():
    assert rendered(K % "return x @ y") == expect("""
        <string>:2:12: error: the returned value has shape [M, K] but the kernel declares [M, N]
                return x @ y
                       ^~~~~
        <string>:1:41: note: declared here
            kernel f(x: f32[M, N], y: f32[N, K]) -> f32[M, N] {
                                                    ^~~~~~~~~
    """)
    assert rendered("kernel f(x: f32[N]) -> f32[P] {\n    return x\n}").splitlines()[0] == \
        "<string>:1:24: error: the declared return type uses dim 'P', which no parameter defines"


def test_declared_return_dtype_that_cannot_be_produced():
    assert rendered(K % "return x > 0").splitlines()[0] == (
        "<string>:2:12: error: the returned value is bool but the kernel declares f32; "
        "convert it explicitly with cast(..., f32)")


def test_return_statement_rules():
    assert rendered("kernel f(x: f32[N]) -> f32[N] {\n    y = x\n}").splitlines()[0] == \
        "<string>:1:8: error: kernel 'f' has no 'return' statement"
    assert rendered("kernel f(x: f32[N]) -> f32[N] {\n    return x\n    y = x\n}").splitlines()[0] == \
        "<string>:3:5: error: statement after 'return' is unreachable"
    assert rendered(K % "return x, x").splitlines()[0] == \
        "<string>:2:5: error: kernel 'f' declares 1 return value(s) but returns 2"
    assert rendered(K % "return (x, x)").splitlines()[0] == \
        "<string>:2:5: error: kernel 'f' declares 1 return value(s) but returns 2"


def test_zero_sized_dim_in_a_declaration():
    assert rendered("kernel f(x: f32[0]) -> f32[0] {\n    return x\n}").splitlines()[0] == \
        "<string>:1:17: error: dim sizes must be at least 1, got 0"


# --- @tile ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hint, col, shown", [
    ("BLOCK_M=0", 7, "got 0"), ("BLOCK_N=-16", 7, "got -16"), ("BLOCK_M=48", 7, "got 48"),
])
def test_tile_hints_must_be_positive_powers_of_two(hint, col, shown):
    name = hint.split("=")[0]
    text = rendered(f"@tile({hint})\n" + K % "return x")
    assert text.splitlines()[0] == \
        f"<string>:1:{col}: error: tile hint {name} must be a positive power of two, {shown}"


def test_tile_hint_errors():
    assert rendered("@tile(BLOK_M=64)\n" + K % "return x").splitlines()[0] == (
        "<string>:1:7: error: unknown tile hint 'BLOK_M'; did you mean 'BLOCK_M'? "
        "(known: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLITS, num_warps, num_stages)")
    assert rendered("@tile(num_warps=3)\n" + K % "return x").splitlines()[0] == \
        "<string>:1:7: error: tile hint num_warps must be one of 1, 2, 4, 8, 16, 32, got 3"
    assert rendered("@tiles(BLOCK_M=64)\n" + K % "return x").splitlines()[0] == (
        "<string>:1:1: error: unknown decorator '@tiles'; did you mean '@tile'?")
    assert rendered("@jit\n" + K % "return x").splitlines()[0] == \
        "<string>:1:5: error: unexpected newline; expected '('"
    assert rendered("@jit()\n" + K % "return x").splitlines()[0] == \
        "<string>:1:1: error: unknown decorator '@jit'; the only decorator is @tile(...)"
    assert rendered("@tile(BLOCK_M=64, BLOCK_M=32)\n" + K % "return x").splitlines()[0] == \
        "<string>:1:19: error: tile hint 'BLOCK_M' is given twice"


def test_matmul_tile_hints_below_the_dot_minimum():
    src = "@tile(BLOCK_K=8)\nkernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] {\n    return a @ b\n}\n"
    assert rendered(src).splitlines()[0] == (
        "<string>:1:7: error: tile hint BLOCK_K must be at least 16 for a matmul kernel "
        "(tl.dot's smallest tile), got 8")


# --- kernel selection and calls ------------------------------------------------------------------

TWO = "kernel a(x: f32[N]) -> f32[N] { return x }\nkernel b(x: f32[N]) -> f32[N] { return x }\n"


def test_several_kernels_and_no_choice():
    assert rendered(TWO).splitlines()[0] == \
        "<string>:1:8: error: the program defines 2 kernels (a, b); choose one with kernel=..."
    assert rendered(TWO, kernel="aa").splitlines()[0] == \
        "<string>:1:8: error: no kernel named 'aa'; did you mean 'a'? (kernels: a, b)"
    assert tiledsl.compile(TWO, kernel="b").name == "b"


ATT = "kernel att(q: f16[B, M, D], k: f16[B, N, D], scale: f32) -> f16[B, M, N] {\n    return q @ k.T * scale\n}\n"


@pytest.fixture(scope="module")
def att():
    return tiledsl.compile(ATT)


def call_error(fn, *args, **kwargs) -> str:
    with pytest.raises(diag.ArgumentError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_call_with_missing_or_extra_arguments(att):
    q, k = torch.randn(2, 5, 8).half(), torch.randn(2, 7, 8).half()
    assert call_error(att, q, k) == expect("""
        <string>:1:46: error: missing argument 'scale' (f32)
            kernel att(q: f16[B, M, D], k: f16[B, N, D], scale: f32) -> f16[B, M, N] {
                                                         ^~~~~~~~~~
    """)
    assert call_error(att, q, k, 1.0, 2).splitlines()[0] == \
        "<string>:1:1: error: 'att' takes 3 argument(s) (q, k, scale), got 4"
    assert call_error(att, q, k, scal=1.0).splitlines()[0] == \
        "<string>:1:1: error: 'att' has no parameter 'scal'; did you mean 'scale'? (parameters: q, k, scale)"
    assert call_error(att, q, k, 1.0, scale=2.0).splitlines()[0] == \
        "<string>:1:46: error: got two values for argument 'scale'"


def test_call_with_misshapen_arguments_names_parameter_and_sizes(att):
    q, k = torch.randn(2, 5, 8).half(), torch.randn(2, 7, 8).half()
    assert call_error(att, q, torch.randn(2, 7, 9).half(), 1.0) == expect("""
        <string>:1:29: error: argument 'k' has size 9 in dim 2 (D), but D is 8 from argument 'q'
            kernel att(q: f16[B, M, D], k: f16[B, N, D], scale: f32) -> f16[B, M, N] {
                                        ^~~~~~~~~~~~~~~
    """)
    assert call_error(att, q[0], k, 1.0).splitlines()[0] == (
        "<string>:1:12: error: argument 'q' has 2 dimension(s) [5, 8], but parameter 'q' is "
        "declared f16[B, M, D] (3 dimension(s))")
    assert call_error(att, q.float(), k, 1.0).splitlines()[0] == (
        "<string>:1:12: error: argument 'q' has dtype torch.float32, but parameter 'q' is "
        "declared f16 (torch.float16)")
    assert call_error(att, [1, 2], k, 1.0).splitlines()[0] == \
        "<string>:1:12: error: argument 'q' must be a torch.Tensor of f16[B, M, D], got list"
    assert call_error(att, q, k, "1").splitlines()[0] == \
        "<string>:1:46: error: argument 'scale' must be a number (f32), got str"
    assert call_error(att, q.to("meta"), k, 1.0).splitlines()[0] == (
        "<string>:1:12: error: argument 'q' is on meta; tiledsl runs on CPU (through Triton's "
        "interpreter) and on CUDA devices")


def test_literal_dim_mismatch():
    fn = tiledsl.compile("kernel f(x: f32[N, 16]) -> f32[N, 16] {\n    return x\n}")
    assert call_error(fn, torch.randn(3, 17)).splitlines()[0] == \
        "<string>:1:10: error: argument 'x' has size 17 in dim 1, but parameter 'x' declares 16 ([N, 16])"


def test_error_attributes():
    err = error(K % "return sofmax(x)")
    assert (err.filename, err.line, err.column) == ("<string>", 2, 12)
    assert err.message == "unknown function 'sofmax'; did you mean 'softmax'?"
    assert isinstance(err, diag.UnknownFunctionError) and isinstance(err, TileDSLError)


# --- limits: nothing reaches a Python traceback ------------------------------------------------------


def test_expression_nesting_limit():
    err = error("kernel f(x: f32[N]) -> f32[N] {\n    return " + "-" * 300 + "x\n}")
    assert isinstance(err, diag.LimitError)
    assert err.message == "expression nesting depth exceeds the limit of 200"


def test_very_long_sums_and_deep_parentheses_do_not_recurse():
    err = error("kernel f(x: f32[N]) -> f32[N] {\n    return " + "+".join(["x"] * 20000) + "\n}")
    assert isinstance(err, diag.LimitError)
    # parentheses alone add no depth
    fn = tiledsl.compile("kernel f(x: f32[N]) -> f32[N] {\n    return " + "(" * 5000 + "x" + ")" * 5000 + "\n}")
    assert fn.name == "f"


def test_program_size_limit(monkeypatch):
    from tiledsl import parser

    monkeypatch.setattr(parser, "MAX_SOURCE_CHARS", 100)
    err = error(K % ("return x" + " " * 200))
    assert err.message == "program size in characters exceeds the limit of 100"


PIECES = ["kernel", "f", "(", ")", "x", ":", "f32", "[", "]", "N", ",", "->", "{", "}", "return",
          "=", "+", "*", "@", ".T", "softmax", "axis", "-1", "1e3", "\n", ";", "#", "\"s\"", "inf",
          "where", "<", "&", "@tile", "BLOCK_M", "cast", "f16", "sum", " "]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=40) | st.text(string.printable, max_size=80))
def test_fuzz_any_text_compiles_or_raises_a_located_error(parts):
    src = " ".join(parts) if isinstance(parts, list) else parts
    try:
        tiledsl.compile(src)
    except TileDSLError as err:
        assert err.line >= 1 and err.column >= 1 or isinstance(err, diag.OptionError), str(err)
        str(err)  # renders
