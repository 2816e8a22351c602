"""The op registry: every op declares every part, and the parts agree with each other.

An op is one `define(...)` in `tiledsl/ops`. These tests fail when a new op
misses a part (a fold, a torch reference, a Triton rendering, a template, a
way to write it in the DSL), when its constant fold and its torch reference
disagree, or when the end-to-end op tests would not cover it.
"""

import ast
import math
from pathlib import Path

import pytest
import test_e2e_ops
import torch

import tiledsl
from tiledsl import ops
from tiledsl.backends.interface import BACKENDS, missing_renderings
from tiledsl.builtins import BUILTINS
from tiledsl.ops import OPS, Category, Reads
from tiledsl.passes.lower_kernels import LOWERED
from tiledsl.types import DType

ELEMENTWISE = sorted(k for k, d in OPS.items() if d.category is Category.ELEMENTWISE)
COMPUTING = sorted(k for k, d in OPS.items()
                   if d.category not in (Category.SOURCE, Category.RETURN))
# ops whose builtin does more than bind operands and attributes (sema's special handlers)
SPECIAL_BUILTINS = {"index", "transpose", "sum", "max", "min", "mean", "logsumexp", "prod",
                    "argmax", "argmin", "softmax",
                    "cumsum", "reshape", "expand", "topk"}
# ops whose results are never differentiated: bool or integer results, index positions
NO_DERIVATIVE = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "shl", "shr", "not", "isnan", "isinf", "index",
                 "argmax", "argmin", "argtopk"}
# ops built by subscripts (x[i, a:b], gather, concat) and scatters (scatter_add, index_add:
# `put`; scatter, index_copy and an f32 x's adds: `put_into`, canonicalize's) rather than
# called by name
SUBSCRIPT_OPS = {"take": -1, "slice": 1, "put": -1, "put_into": -1}
# ops only sema's builtins build: rand, randn and dropout are `random` at each position
BUILT_BY_SEMA = {"random", "argtopk"}  # argtopk: the indices of topk, sort and argsort


@pytest.mark.parametrize("kind", sorted(OPS))
def test_every_op_is_declared_whole(kind):
    d = OPS[kind]
    assert d.kind == kind
    assert isinstance(d.category, Category) and isinstance(d.reads, Reads)
    assert callable(d.infer)
    assert d.arity >= 0 or kind == "return" or SUBSCRIPT_OPS.get(kind) == -1
    if d.category in (Category.SOURCE, Category.RETURN):
        assert d.params is None and d.symbol is None, "sources and return are not written by users"
        return
    assert d.reference is not None, f"{kind} has no torch reference"
    assert d.params is not None or d.symbol is not None or kind in SUBSCRIPT_OPS or kind in BUILT_BY_SEMA, \
        f"{kind} cannot be written in the DSL"
    if kind == "take":
        assert d.gathers == 0
    if d.category is Category.ELEMENTWISE and d.arity > 0:
        assert d.fold is not None, f"{kind} has no constant fold"
    elif d.category is not Category.ELEMENTWISE:
        assert d.fold is None
        assert d.category is Category.LAYOUT or d.category in LOWERED, \
            f"no template computes {d.category} ops"


@pytest.mark.parametrize("kind", sorted(k for k, d in OPS.items() if d.params is not None))
def test_builtin_signatures_bind_operands_then_attributes(kind):
    d = OPS[kind]
    assert BUILTINS[kind].params == d.params
    values = [p for p in d.params if p.kind == "value"]
    assert [p.kind for p in d.params[:len(values)]] == ["value"] * len(values), \
        "value parameters come first"
    if kind not in SPECIAL_BUILTINS:
        assert len(values) == d.arity, "sema's generic handler makes each value an operand"


@pytest.mark.parametrize("kind", COMPUTING)
def test_every_op_with_a_float_result_has_a_derivative_rule(kind):
    """`tiledsl.autodiff` reads each op's `vjp`; the ops without one are exactly those that
    never produce a floating-point value."""
    assert (OPS[kind].vjp is None) == (kind in NO_DERIVATIVE), kind


def test_operators_map_to_ops():
    assert ops.BINARY_KINDS == {"+": "add", "-": "sub", "*": "mul", "/": "div", "&": "and",
                                "|": "or", "^": "xor", "<<": "shl", ">>": "shr", "//": "floordiv",
                                "%": "mod", "**": "pow"}
    assert ops.COMPARE_KINDS == {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq",
                                 "!=": "ne"}
    assert OPS["neg"].symbol == "-" and OPS["matmul"].symbol == "@" and OPS["not"].symbol == "~"


def test_every_elementwise_builtin_and_operator_is_tested_end_to_end():
    tested = set(test_e2e_ops.UNARY + test_e2e_ops.UNARY_POSITIVE)
    tested |= {ops.BINARY_KINDS.get(o, o) for o in test_e2e_ops.BINARY}
    tested |= {ops.COMPARE_KINDS[o] for o in test_e2e_ops.COMPARISONS}
    tested |= set(test_e2e_ops.OWN_TESTS)
    assert set(ELEMENTWISE) <= tested, f"untested: {sorted(set(ELEMENTWISE) - tested)}"


# --- a fold and a reference are two statements of one meaning ----------------------------------

POINTS = (-1.75, -0.5, 0.37, 1.0, 2.25)


def _attr_choices(kind):
    """Every combination of an op's constant parameters worth checking."""
    d = OPS[kind]
    if kind == "random":
        return [{"dist": "uniform"}, {"dist": "normal"}]
    constants = [p for p in (d.params or ()) if p.kind != "value"]
    if not constants:
        return [{}]
    if all(p.kind == "float" for p in constants):  # the defaults, and all of them halved
        return [{p.name: p.default for p in constants}, {p.name: p.default / 2 for p in constants}]
    (p,) = constants
    if p.kind == "dtype":
        return [{p.name: DType.F32}]
    if p.kind == "shape":  # expand: a scalar to a 0-d shape is itself
        return [{p.name: ()}]
    return [{p.name: c} for c in p.choices]


def _operand_sets(kind):
    d = OPS[kind]
    if d.reads is Reads.SELECT:
        return [(c, a, b) for c in (True, False) for a, b in ((2.5, -1.0), (0.37, 7.0))]
    if d.arity == 3:  # clamp
        return [(x, lo, hi) for x in POINTS for lo, hi in ((-1.0, 1.0), (0.5, 3.0), (2, 1))]
    if kind == "random":  # (position, seed)
        return [(p, seed) for p in (0, 1, 5, 2**33 + 1) for seed in (0, -3, 2**40 + 5)]
    if d.arity == 2:
        if kind in ("and", "or", "xor"):
            return [(a, b) for a in (0, 1, 6, -7) for b in (0, 3, -2)] + [(True, False), (True, True)]
        if kind in ("shl", "shr"):
            return [(a, b) for a in (-100, -7, 0, 1, 5, 100) for b in (0, 1, 3, 7)]
        integers = [(a, b) for a in (-7, 0, 1, 5, -1) for b in (-3, -1, 0, 2, 3)]
        if kind in ("floordiv", "mod", "pow"):  # integer semantics (x // 0, 2 ** -1) too
            return integers + [(a, b) for a in POINTS for b in (-1.25, 0.37, 2.0, 3.0)]
        return [(a, b) for a in POINTS for b in (-1.25, 0.37, 2.25)]
    if kind == "not":
        return [(True,), (False,), (0,), (5,), (-3,)]
    return [(x,) for x in POINTS]


def _torch_value(v):
    dtype = torch.bool if isinstance(v, bool) else (torch.int64 if isinstance(v, int) else torch.float64)
    return torch.tensor(v, dtype=dtype)


@pytest.mark.parametrize("kind", [k for k in ELEMENTWISE if OPS[k].fold is not None])
def test_fold_agrees_with_reference(kind):
    d = OPS[kind]
    checked = 0
    for attrs in _attr_choices(kind):
        for args in _operand_sets(kind):
            try:
                folded = d.fold(*args, **attrs)
            except (ArithmeticError, ValueError):
                continue  # outside the domain: the folder leaves it for run time
            expected = d.reference(*(_torch_value(a) for a in args), **attrs)
            if isinstance(folded, bool):
                assert bool(expected) is folded, (args, attrs)
            elif isinstance(folded, int):
                assert not expected.is_floating_point() and int(expected) == folded, (args, folded, expected)
            elif math.isnan(folded):
                assert math.isnan(float(expected)), (args, attrs, float(expected))
            else:
                assert math.isclose(float(folded), float(expected), rel_tol=1e-12, abs_tol=1e-15), \
                    (args, attrs, folded, float(expected))
            checked += 1
    assert checked >= 3, "the fold refused nearly every sample"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_has_a_rendering_in_every_backend(backend):
    """The registry declares what an op computes; each backend says how (Triton's renderings,
    reductions and scans live in backends/triton/renderings.py, keyed by op, and no Triton
    source is left in tiledsl/ops)."""
    assert missing_renderings(backend) == []


def test_the_op_registry_holds_no_triton_source():
    """No string in tiledsl/ops but docstrings names a Triton function (`tl.`)."""
    ops_dir = Path(tiledsl.__file__).parent / "ops"
    for path in sorted(ops_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and id(n) not in docstrings]
        assert not [t for t in strings if "tl." in t], f"{path.name} holds Triton source"
