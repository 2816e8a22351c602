"""The builder (`tiledsl/builder.py`) is the one place graph-IR ops are made, each typed by
`ops.infer`; every op of every example's pipeline passes the verifier's re-inference."""

import re
from pathlib import Path

import pytest

from tiledsl import autodiff
from tiledsl import diagnostics as diag
from tiledsl.api import compile_graph, compile_text
from tiledsl.builder import Builder, IllTypedOp
from tiledsl.ir import Graph
from tiledsl.parser import parse
from tiledsl.sema import analyze
from tiledsl.source import Source
from tiledsl.types import DType, TensorType

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.tdsl"))
# examples whose gradient autodiff refuses, and why (none: a view that takes part of an axis,
# paged decode's one query row, rope's halves, differentiates as an index map)
REFUSED: dict[str, str] = {}


def test_ops_are_constructed_only_in_the_builder():
    """No module but the builder (and ir.py, which defines the payload) writes `Op(...)`:
    a pass cannot give an op a type its rule does not."""
    construct = re.compile(r"(?<![\w.])Op\(")
    found = []
    for folder in ("tiledsl", "passes", "backends"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("tiledsl/ir.py", "tiledsl/builder.py"):
                continue
            found += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if construct.search(line)]
    assert found == []
    assert construct.search((ROOT / "tiledsl/builder.py").read_text())  # the scan sees one


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_op_of_the_examples_pipelines_reinfers(path):
    """Each example, its check_bounds variant, and its training forward and backward are
    compiled with the verifier after sema and after every pass: it re-infers every op
    (`verifier._verify_op`), those inside kernel regions too, and raises on any whose type
    is not what its rule gives (`tests/test_ir.py` shows it does)."""
    text = path.read_text()
    for kernel in parse(text, path.name).kernels:
        for check_bounds in (False, True):
            compile_text(text, path.name, kernel.name, verify=True, check_bounds=check_bounds)
        graph = analyze(kernel)
        if path.stem in REFUSED:
            with pytest.raises(diag.GradientError, match=REFUSED[path.stem]):
                autodiff.derive(graph)
            continue
        d = autodiff.derive(graph)
        compile_graph(d.forward, verify=True)
        compile_graph(d.backward, verify=True)


def test_passes_build_through_the_builder(monkeypatch):
    """The rewrites of online-softmax (a softmax with a sink), hoist-row-scale (an RMSNorm
    before a projection) and canonicalize (a folded constant) make their ops here."""
    made: list[str] = []
    add = Builder._add

    def recording(self, kind, t, operands, span, attrs):
        made.append(kind)
        return add(self, kind, t, operands, span, attrs)

    for name in ("attention_sinks", "rmsnorm_projection"):
        graph = analyze(parse((ROOT / "examples" / f"{name}.tdsl").read_text(), name).kernels[0])
        monkeypatch.setattr(Builder, "_add", recording)
        compile_graph(graph, verify=True)
        monkeypatch.setattr(Builder, "_add", add)
    assert {"softmax", "logsumexp", "sigmoid", "cast", "mul"} <= set(made)


def _graph_with(*types: TensorType) -> tuple[Graph, Builder, list[int]]:
    g = Graph("g")
    b = Builder(g)
    return g, b, [b.param(t, None, name=f"p{i}", index=i, scalar=False) for i, t in enumerate(types)]


def test_op_types_from_the_operands():
    g, b, (x, s) = _graph_with(TensorType(DType.F16, ("M", 17)), TensorType(DType.F32, ()))
    c = b.const(2, DType.I32, None)
    assert g.op(c).type == TensorType(DType.I32, (), True)
    y = b.op("mul", [x, c], None)
    assert g.op(y).type == TensorType(DType.F16, ("M", 17))  # a weak scalar takes x's dtype
    z = b.op("add", [y, s], None)
    assert g.op(z).type == TensorType(DType.F16, ("M", 17))  # a 0-d f32 does not widen it
    r = b.op("sum", [z], None, axis=1, keepdims=True)
    assert g.op(r).type == TensorType(DType.F16, ("M", 1))
    assert g.op(r).attrs == (("axis", 1), ("keepdims", True))


def test_an_ill_typed_op_in_a_pass_is_a_compiler_bug():
    _, b, (x, m) = _graph_with(TensorType(DType.F32, ("M", 3)), TensorType(DType.BOOL, ("M", 3)))
    with pytest.raises(IllTypedOp) as info:
        b.op("matmul", [x, b.op("transpose", [m], None, dims=(0, 1))], None)
    assert isinstance(info.value, diag.InternalError)
    assert str(info.value).startswith(
        "error: internal compiler error: an ill-typed 'matmul' was built from (f32[M, 3], bool[3, M]): ")


def test_an_ill_typed_op_in_sema_is_the_users_error():
    src = Source("kernel f(x: f32[N], m: bool[N]) -> f32[N] {\n    return x + (m & x)\n}\n", "f.tdsl")
    g, b, (x, m) = _graph_with(TensorType(DType.F32, ("N",)), TensorType(DType.BOOL, ("N",)))
    x_span, m_span = src.span(src.text.index("x)"), src.text.index("x)") + 1), src.span(
        src.text.index("m &"), src.text.index("m &") + 1)
    with pytest.raises(diag.DTypeError) as info:
        b.user_op("and", [(m, m_span), (x, x_span)], src.span(src.text.index("m &"), src.text.index("x)") + 1))
    with pytest.raises(diag.DTypeError) as sema:
        compile_text(src.text, "f.tdsl")
    assert str(info.value) == str(sema.value)
    assert "note: this operand is f32[N]" in str(info.value)


def test_retype_follows_a_changed_operand():
    g, b, (x, w) = _graph_with(TensorType(DType.F16, (5, 7)), TensorType(DType.F32, (5, 7)))
    e = b.op("exp", [x], None)
    g.set_operands(e, [w])
    b.retype(e)
    assert g.op(e).type == TensorType(DType.F32, (5, 7))
