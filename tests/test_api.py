"""The Python API of design section 4: compile(), the callable and its inspection methods."""

from pathlib import Path

import networkx as nx
import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl.diagnostics import OptionError

EXAMPLES = Path(__file__).parent.parent / "examples"
ATTENTION = EXAMPLES / "attention.tdsl"


@pytest.fixture(scope="module")
def attention():
    return tiledsl.compile(ATTENTION)


def test_compile_from_path_string_or_text():
    a = tiledsl.compile(ATTENTION)
    b = tiledsl.compile(str(ATTENTION))
    c = tiledsl.compile(ATTENTION.read_text())
    assert a.ir() == b.ir() == c.ir()
    with pytest.raises(OptionError, match="cannot read missing.tdsl"):
        tiledsl.compile("missing.tdsl")


def test_arguments_bind_positionally_or_by_name(attention):
    q, k, v = (randn(1, 2, 17, 32, dtype=torch.float16) for _ in range(3))
    by_position = attention(q, k, v, 0.125)
    by_name = attention(v=v, scale=0.125, q=q, k=k)
    assert torch.equal(by_position, by_name)


def test_kernels_in_launch_order(attention):
    assert [(k.name, k.template) for k in attention.kernels] == [("k0", "attention")]
    k0 = attention.kernels[0]
    assert [op.kind for op in k0.ops] == ["matmul", "mul", "index", "index", "ge", "where", "softmax", "matmul"]
    assert "@triton.jit" in k0.source and f"def {k0.fn_name}(" in k0.source
    assert k0.lines == (5, 6, 7, 8)


def test_graph_is_the_fused_networkx_graph(attention):
    g = attention.graph
    assert isinstance(g, nx.DiGraph)
    kinds = [g.nodes[n]["op"].kind for n in nx.topological_sort(g)]
    assert kinds.count("kernel") == 1 and kinds.count("param") == 4


def test_ir_stages(attention):
    assert attention.stages == ["graph", "canonicalize", "sink-reshape", "cse", "dce", "online-softmax", "distribute-matmul",
                                "hoist-row-scale",
                                "sum-precision", "recompute", "fuse-attention", "widen-score-sums", "own-prologues", "sink-transposes",
                                "fuse-attention-backward",
                                "fuse-epilogue", "fuse-rows", "fuse-scatter", "fuse-elementwise", "fuse-horizontal", "lower-kernels",
                                "fused"]
    assert "%7 = neg %6 : weak f32" in attention.ir("graph")
    assert "const -inf" in attention.ir("canonicalize")
    assert "kernel @k? attention(" in attention.ir("fuse-attention")  # named at lower-kernels
    assert attention.ir("fused") == attention.ir("lower-kernels")
    assert "loc(6:9)" in attention.ir("graph", locations=True)
    with pytest.raises(OptionError) as info:
        attention.ir("canonicalise")
    assert info.value.message.startswith("no IR stage 'canonicalise'; did you mean 'canonicalize'? (stages: graph,")


def test_explain_reports_kernels_traffic_and_fusions_not_made(attention):
    text = attention.explain()
    assert text.splitlines()[:5] == [
        "fusion report for @attention",
        "  pipeline: canonicalize,sink-reshape,cse,dce,online-softmax,distribute-matmul,hoist-row-scale,sum-precision,recompute,"
        "fuse-attention,widen-score-sums,own-prologues,sink-transposes,fuse-attention-backward,fuse-epilogue,fuse-rows,fuse-scatter,fuse-elementwise,fuse-horizontal,lower-kernels",
        "  1 kernel for 8 ops",
        "  modeled HBM traffic: 4·B·D·H·M + 4·B·D·H·N B fused; "
        "4·B·D·H·M + 4·B·D·H·N + 34·B·H·M·N B op by op",
        "  saved: 34·B·H·M·N B",
    ]
    assert ("  k0  attention matmul (line 5), mul (line 5), index (line 6), index (line 6), ge (line 6), "
            "where (line 6), softmax (line 7), matmul (line 8)") in text
    assert "        in:  q: f16[B, H, M, D], k.T: f16[B, H, D, N], scale: f32 (by value), v: f16[B, H, N, D]" in text
    assert "        out: f16[B, H, M, D] -> return" in text
    assert ("        structure: q @ k.T: matmul (line 5); score modification: mul (line 5), index (line 6), "
            "index (line 6), ge (line 6), where (line 6); online softmax: softmax (line 7); p @ v: matmul "
            "(line 8); key blocks past the mask's bound are skipped, blocks inside it for every row run "
            "without the mask") in text
    assert text.rstrip().splitlines()[-1] == "fusions not made: none"


def test_explain_shows_fusions_not_made():
    fn = tiledsl.compile(ATTENTION, pipeline="canonicalize,cse,dce,fuse-epilogue,fuse-rows,lower-kernels")
    assert fn.explain().rstrip().splitlines()[-2:] == [
        "  where (line 6) -> softmax (line 7): no fusion pass joins a matmul kernel (k0) to a rows kernel (k1) [rule: op]",
        "  softmax (line 7) -> matmul (line 8): no fusion pass joins a rows kernel (k1) to a matmul kernel (k2) [rule: op]",
    ]


def test_explain_with_dims_gives_bytes():
    fn = tiledsl.compile(EXAMPLES / "gemm_multiply_multiply.tdsl")
    text = fn.explain(dims={"M": 1024, "N": 1024, "K": 512})
    # fused: 2*K*M + 2*K*N + 6*M*N = 8_388_608; op by op adds 8*M*N = 8_388_608
    assert "  modeled HBM traffic: 8.389 MB fused; 16.777 MB op by op" in text
    assert "  saved: 8.389 MB" in text


def test_explain_without_fusion_says_so():
    fn = tiledsl.compile(ATTENTION, pipeline="canonicalize,cse,dce")
    assert "  no fusion pass ran: every op is its own kernel" in fn.explain()


def test_explain_counts_the_fusion_stage_as_fusion_passes():
    # the passes of `pipeline.FUSION`: fuse-horizontal merges the kernels lower-kernels formed
    # (RoPE's q and k rotations), while online-softmax only rewrites ops into `softmax`
    merged = tiledsl.compile(EXAMPLES / "rope.tdsl", pipeline="lower-kernels,fuse-horizontal").explain()
    assert "  5 kernels for 42 ops\n  modeled HBM traffic" in merged
    rewritten = tiledsl.compile(EXAMPLES / "softmax.tdsl", pipeline="online-softmax").explain()
    assert "  2 kernels for 2 ops\n  no fusion pass ran: every op is its own kernel\n" in rewritten


def test_to_dot_has_one_cluster_per_kernel(attention):
    dot = attention.to_dot()
    assert dot.startswith('digraph "attention" {')
    assert dot.count("subgraph cluster_k") == 1
    assert 'label="k0 (attention)"' in dot
    assert 'label="matmul\\nf16[B, H, M, N]"' in dot
    assert 'label="transpose\\nf16[B, H, D, N]", style=dashed' in dot


def test_unknown_backend():
    with pytest.raises(OptionError) as info:
        tiledsl.compile(ATTENTION, backend="trition")
    assert info.value.message == ("unknown backend 'trition'; did you mean 'triton'? "
                                  "(backends: triton, reference)")


def test_reference_backend_has_the_same_interface():
    fn = tiledsl.compile(EXAMPLES / "rmsnorm.tdsl", backend="reference")
    assert fn.kernels[0].source is None and len(fn.kernels) == 1
    x, w = randn(17, 113, dtype=torch.float16), randn(113, dtype=torch.float16)
    out = fn(x, w, 1e-6)
    triton_out = tiledsl.compile(EXAMPLES / "rmsnorm.tdsl")(x, w, 1e-6)
    assert (out.float() - triton_out.float()).abs().max() < 2e-3


def test_multiple_outputs_return_a_tuple():
    fn = tiledsl.compile("kernel f(x: f32[N]) -> (f32[N], f32) { return exp(x), sum(x) }")
    out = fn(randn(7))
    assert isinstance(out, tuple) and len(out) == 2 and out[1].shape == ()


def test_fp32_matmul_is_ieee_unless_tf32_is_allowed():
    src = "kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M, N] { return a @ b }"
    assert 'input_precision="ieee"' in tiledsl.compile(src).kernels[0].source
    assert 'input_precision="tf32"' in tiledsl.compile(src, allow_tf32=True).kernels[0].source


def test_draw_renders_with_graphviz_or_says_how_to_get_it(attention, tmp_path, monkeypatch):
    import shutil

    if shutil.which("dot"):
        out = attention.draw(tmp_path / "g.svg")
        assert out.read_text().lstrip().startswith(("<?xml", "<svg"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no Graphviz on the path
    with pytest.raises(OptionError) as info:
        attention.draw(tmp_path / "g.svg")
    assert info.value.message == (
        "drawing needs Graphviz's 'dot' program, which is not installed (Debian/Ubuntu: apt install "
        "graphviz; macOS: brew install graphviz; conda: conda install graphviz); fn.to_dot() gives the "
        "DOT text without it")
