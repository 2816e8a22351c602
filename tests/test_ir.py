"""Graph IR: construction, the deterministic printer, and the verifier catching broken graphs."""

import networkx as nx
import pytest

import tiledsl
from tiledsl.ir import KernelOp, Op, Region, RegionInput, RegionOp, make_attrs
from tiledsl.parser import parse
from tiledsl.printer import print_graph
from tiledsl.sema import analyze
from tiledsl.types import DType, TensorType
from tiledsl.verifier import VerificationError, verify

SRC = """
kernel f(x: f32[M, N], w: f32[N]) -> f32[M, N] {
    y = x * w
    z = y * y
    return exp(z) + y
}
"""


def graph(src: str = SRC):
    return analyze(parse(src, "f.tdsl").kernels[0])


def test_payloads_are_frozen_and_slotted():
    g = graph()
    op = g.op(g.topo_order()[2])
    with pytest.raises(AttributeError):
        op.kind = "add"
    assert not hasattr(op, "__dict__")
    assert isinstance(g.nx, nx.DiGraph)  # a MultiDiGraph is a DiGraph


def test_repeated_operand_has_two_edges():
    g = graph()
    (square,) = [n for n in g.nodes() if g.op(n).kind == "mul" and len(set(g.operands(n))) == 1]
    first = g.operands(square)[0]
    assert g.operands(square) == [first, first]
    assert g.nx.number_of_edges(first, square) == 2


def test_printer_is_deterministic_and_names_at_print_time():
    text = print_graph(graph())
    assert text == print_graph(graph())
    assert text == (
        "func @f(%x: f32[M, N], %w: f32[N]) -> (f32[M, N]) {\n"
        "  %0 = mul %x, %w : f32[M, N]\n"
        "  %1 = mul %0, %0 : f32[M, N]\n"
        "  %2 = exp %1 : f32[M, N]\n"
        "  %3 = add %2, %0 : f32[M, N]\n"
        "  return %3\n"
        "}\n")


def test_printer_locations():
    text = print_graph(graph(), locations=True)
    assert "%0 = mul %x, %w : f32[M, N]  loc(3:9)" in text


def test_names_stable_after_passes_renumber_nodes():
    fn = tiledsl.compile(SRC)
    # node ids change across passes; printed names do not depend on them
    assert fn.ir("dce") == fn.ir("graph")


def test_verifier_accepts_sema_output():
    verify(graph())


def test_verifier_rejects_wrong_types():
    g = graph()
    node = next(n for n in g.nodes() if g.op(n).kind == "exp")
    g.set_op(node, g.op(node).replace(dtype=DType.F16))
    with pytest.raises(VerificationError) as info:
        verify(g, "my-pass")
    assert "after pass 'my-pass'" in str(info.value)
    assert "has type f16[M, N], but its operands give f32[M, N]" in str(info.value)


def test_verifier_rejects_cycles_and_bad_arity():
    g = graph()
    exp = next(n for n in g.nodes() if g.op(n).kind == "exp")
    add = next(n for n in g.nodes() if g.op(n).kind == "add")
    bad = g.copy()
    bad.set_operands(exp, [add])
    with pytest.raises(VerificationError, match="cycle"):
        verify(bad)
    bad = g.copy()
    bad.set_operands(exp, [])
    with pytest.raises(VerificationError, match=r"\(exp\) has 0 operands, expected 1"):
        verify(bad)


def test_verifier_checks_kernel_regions():
    g = graph("kernel f(x: f32[N]) -> f32[N] { return exp(x) }")
    exp = next(n for n in g.nodes() if g.op(n).kind == "exp")
    t = TensorType(DType.F32, ("N",))
    bad_region = Region((RegionInput(TensorType(DType.F16, ("N",))),),
                        (RegionOp(Op("exp", DType.F32, ("N",)), (0,)),), (1,))
    g.set_op(exp, KernelOp("k0", "pointwise", bad_region))
    with pytest.raises(VerificationError, match="input 0 is f16\\[N\\] but its operand is f32\\[N\\]"):
        verify(g)
    use_before_def = Region((RegionInput(t),), (RegionOp(Op("exp", DType.F32, ("N",)), (1,)),), (1,))
    g.set_op(exp, KernelOp("k0", "pointwise", use_before_def))
    with pytest.raises(VerificationError, match="uses value 1 before it is defined"):
        verify(g)


def test_op_attrs_are_sorted_and_hashable():
    a = Op("sum", DType.F32, ("M",), make_attrs(keepdims=False, axis=1))
    b = Op("sum", DType.F32, ("M",), make_attrs(axis=1, keepdims=False))
    assert a == b and hash(a) == hash(b) and a.attr("axis") == 1


def test_verifier_checks_kernel_plans():
    """A kernel carries the plan its template consumes, and the plan matches its region."""
    from tiledsl.api import compile as compile_program
    from tiledsl.plans import GemmPlan, PointwisePlan

    fn = compile_program("kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M, N] { return relu(a @ b) }")
    g = fn.fused_graph().copy()
    (k,) = g.kernels()
    kernel = g.op(k)
    assert isinstance(kernel.plan, GemmPlan) and kernel.plan.epilogue == (3,)
    g.set_op(k, kernel.replace(plan=None))
    with pytest.raises(VerificationError, match=r"kernel @k0 \(matmul\) carries NoneType, expected GemmPlan"):
        verify(g)
    g.set_op(k, kernel.replace(plan=PointwisePlan(("M", "N"))))
    with pytest.raises(VerificationError, match="carries PointwisePlan, expected GemmPlan"):
        verify(g)
    swapped = GemmPlan(2, 1, 0, 1, 0, frozenset({1}), frozenset({0}), frozenset(), (3,))
    g.set_op(k, kernel.replace(plan=swapped))
    with pytest.raises(VerificationError, match="kernel @k0: its plan's operands are not the matmul's"):
        verify(g)
    g.set_op(k, kernel.replace(plan=GemmPlan(2, 0, 1, 0, 1, frozenset({0}), frozenset({1}),
                                              frozenset(), (9,))))
    with pytest.raises(VerificationError, match="its plan names value 9, which the region does not define"):
        verify(g)
