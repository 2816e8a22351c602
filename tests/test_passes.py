"""Pass infrastructure: registry, pipeline strings, the manager, and each pass's contract."""

import io
from dataclasses import dataclass

import pytest
import torch

import tiledsl
from tiledsl.diagnostics import OptionError
from tiledsl.ir import KernelOp, Op
from tiledsl.parser import parse
from tiledsl.passes.manager import PassManager, print_ir_to
from tiledsl.passes.registry import REGISTRY, Pass, PassContext, parse_pipeline, register
from tiledsl.sema import analyze
from tiledsl.verifier import VerificationError


def graph(src: str):
    return analyze(parse(src).kernels[0])


def kinds(g) -> list[str]:
    return [g.op(n).kind for n in g.topo_order() if g.op(n).kind not in ("param", "return")]


def test_pipeline_strings_round_trip():
    passes = parse_pipeline("canonicalize{max-iterations=3}, cse ,dce,lower-kernels")
    assert [p.name for p in passes] == ["canonicalize", "cse", "dce", "lower-kernels"]
    assert passes[0].max_iterations == 3
    assert PassManager(passes).pipeline == "canonicalize{max-iterations=3},cse,dce,lower-kernels"


@pytest.mark.parametrize("text, message", [
    ("canonicalise", "unknown pass 'canonicalise'; did you mean 'canonicalize'? (passes: canonicalize, "
                     "cse, dce, distribute-matmul, fuse-attention, fuse-attention-backward, fuse-elementwise, fuse-epilogue, fuse-horizontal, fuse-rows, fuse-scatter, "
                     "hoist-row-scale, lower-kernels, online-softmax, own-prologues, recompute, sink-reshape, "
                     "sink-transposes, sum-precision, widen-score-sums)"),
    ("cse{foo=1}", "pass 'cse' has no option 'foo' (options: none)"),
    ("canonicalize{max-iterations=many}", "option 'max-iterations' of pass 'canonicalize' expects a int, got 'many'"),
    ("cse,,dce", "cannot parse the pipeline 'cse,,dce' at ',dce'; expected 'pass' or "
                 "'pass{option=value}' separated by commas"),
])
def test_pipeline_errors(text, message):
    with pytest.raises(OptionError) as info:
        parse_pipeline(text)
    assert info.value.message == message


def test_manager_snapshots_every_stage_and_times_passes():
    g = graph("kernel f(x: f32[N]) -> f32[N] { return x * 1 }")
    result = PassManager("canonicalize,cse,cse,lower-kernels").run(g)
    assert list(result.stages) == ["graph", "canonicalize", "cse", "cse.2", "lower-kernels"]
    assert [s for s, _ in result.timings] == ["canonicalize", "cse", "cse.2", "lower-kernels"]
    assert all(t >= 0 for _, t in result.timings)
    assert kinds(result.stages["graph"]) == ["const", "mul"]
    assert kinds(result.stages["canonicalize"]) == []


def test_print_ir_after_all():
    out = io.StringIO()
    PassManager("canonicalize", print_after=print_ir_to(out)).run(
        graph("kernel f(x: f32[N]) -> f32[N] { return x + 0 }"))
    text = out.getvalue()
    assert text.count("// -----// IR Dump After") == 2
    assert "// -----// IR Dump After canonicalize //----- //\nfunc @f(%x: f32[N]) -> (f32[N]) {\n  return %x\n}" in text


def test_verification_names_the_pass_that_broke_the_graph():
    @dataclass(frozen=True)
    class Breaker(Pass):
        name = "test-breaker"

        def run(self, graph, ctx):
            node = next(n for n in graph.nodes() if graph.op(n).kind == "exp")
            graph.set_op(node, graph.op(node).replace(shape=("M",)))

    with pytest.raises(VerificationError) as info:
        PassManager([Breaker()], verify=True).run(graph("kernel f(x: f32[N]) -> f32[N] { return exp(x) }"))
    assert "IR verification failed after pass 'test-breaker'" in str(info.value)


def test_register_rejects_duplicates():
    with pytest.raises(AssertionError):
        register(type("Dup", (Pass,), {"name": "cse"}))
    assert "cse" in REGISTRY


def test_canonicalize_folds_to_a_fixpoint():
    g = graph("kernel f(x: f32[N]) -> f32[N] { return x * (1.0 / (2.0 + 2.0) * 4) + -(-(-inf) * 0 + 0) }")
    PassManager("canonicalize").run(g)
    # x * (1.0 / 4 * 4) folds to x * 1.0, which is x; in -(-(-inf) * 0 + 0), inf * 0 is
    # NaN and is left for run time, the + 0 goes.
    assert kinds(g) == ["const", "const", "mul", "neg", "add"]


def test_canonicalize_keeps_identities_that_change_types():
    g = graph("kernel f(x: f16[N], s: f32) -> f32[N] { return cast(x, f32) * 1 + x * s }")
    PassManager("canonicalize").run(g)
    # the f16 x * s, promoted by the add, is read through its rounding cast, which stays
    assert kinds(g) == ["cast", "mul", "cast", "add"]


def test_cse_merges_across_lines_and_dce_removes_the_rest():
    g = graph("""
    kernel f(x: f32[N]) -> f32[N] {
        a = exp(x)
        b = exp(x)
        unused = log(x)
        return a + b
    }""")
    PassManager("cse,dce").run(g)
    assert kinds(g) == ["exp", "add"]


def test_lower_kernels_leaves_only_kernels_views_dims_and_params():
    fn = tiledsl.compile(pipeline="canonicalize,cse,dce", source="""
    kernel f(x: f32[M, N], w: f32[K, N]) -> f32[M, K] {
        return softmax(x @ w.T * rsqrt(N)) + sum(x, keepdims=true)
    }""")
    g = fn.fused_graph()
    payload_kinds = {g.op(n).kind for n in g.nodes()}
    assert payload_kinds == {"param", "kernel", "transpose", "dim", "return"}
    names = [g.op(n).name for n in g.kernels()]
    assert names == [f"k{i}" for i in range(len(names))]
    templates = [g.op(n).template for n in g.kernels()]
    # rsqrt(N) is a scalar expression: cloned into its reader, never a 0-d kernel
    assert sorted(templates) == ["matmul", "pointwise", "pointwise", "rows", "rows"]
    assert "rsqrt" in [op.kind for k in fn.kernels for op in k.ops]


def test_lower_kernels_appended_when_missing():
    fn = tiledsl.compile("kernel f(x: f32[N]) -> f32[N] { return exp(x) }", pipeline="cse")
    assert fn.pipeline == "cse,lower-kernels"
    assert fn.stages == ["graph", "cse", "lower-kernels", "fused"]


def test_kernel_ops_report_the_dsl_ops_they_cover():
    fn = tiledsl.compile("kernel f(x: f32[N]) -> f32[N] {\n  y = exp(x)\n  return y * 2\n}",
                         pipeline="canonicalize,cse,dce")
    assert [(k.name, [op.kind for op in k.ops], k.lines) for k in fn.kernels] == [
        ("k0", ["exp"], (2,)), ("k1", ["mul"], (3,))]
    assert all(isinstance(op, Op) for k in fn.kernels for op in k.ops)
    assert all(isinstance(k, KernelOp) for k in fn.kernel_ops())


def test_pass_context_carries_remarks():
    ctx = PassContext()
    ctx.remarks.append("x")
    assert PassManager("cse").run(graph("kernel f(x: f32[N]) -> f32[N] { return x }"), ctx).context.remarks == ["x"]


TRANSPOSED_PRODUCTS = [
    # a product written twice beside its transpose (review: cse pointed the second at the
    # product it had replaced by a view, KeyError)
    ("kernel f(a: f32[M, K], b: f32[N, K]) -> (f32[M, N], f32[N, M], f32[N, M]) {\n"
     "    return a @ b.T, b @ a.T, b @ a.T\n}", lambda a, b: (a @ b.T, b @ a.T, b @ a.T)),
    ("kernel f(a: f32[M, K], b: f32[N, K]) -> (f32[M, N], f32[N, M]) {\n"
     "    return a @ b.T, exp(b @ a.T * 0.2) + (b @ a.T)\n}",
     lambda a, b: (a @ b.T, torch.exp(b @ a.T * 0.2) + b @ a.T)),
    # the scaled product first, its unscaled transpose after it: merged once the scale is hoisted
    ("kernel f(a: f32[M, K], b: f32[N, K]) -> (f32[M, N], f32[N, M]) {\n"
     "    return (a * 1.5) @ b.T, b @ a.T\n}", lambda a, b: ((a * 1.5) @ b.T, b @ a.T)),
]


@pytest.mark.parametrize("index", range(len(TRANSPOSED_PRODUCTS)))
def test_a_product_and_its_transpose_are_one_matmul(index):
    from helpers import randn

    src, ref = TRANSPOSED_PRODUCTS[index]
    fn = tiledsl.compile(src)
    assert [k.template for k in fn.kernels].count("matmul") == 1, fn.explain()
    a, b = randn(17, 33, seed=1), randn(13, 33, seed=2)
    for got, want in zip(fn(a, b), ref(a.double(), b.double()), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
