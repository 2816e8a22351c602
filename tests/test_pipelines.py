"""Custom pipelines (issue 26): every pipeline the registry accepts compiles, and what it
compiles meets the numerics contract (`tiledsl.testing.check`: within 2x the eager error +
1e-5 of float64) on small awkward sizes.

The programs are the examples and programs written as model code writes them; the
pipelines are each registered pass alone, the default with one pass dropped, and ordered
pairs. No pass depends on another to be correct: each one works on whatever graph it is
given (ops, or kernels an earlier pass formed). The default run gives every pipeline two
programs in rotation, and `hoist-row-scale` alone every program (it is the one pass whose
accuracy rests on a later one); `-m slow` runs every program with every pipeline.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import testing
from tiledsl.api import DEFAULT_PIPELINE
from tiledsl.passes.registry import REGISTRY, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent

# as model code writes them (HF LLaMA's apply_rotary_pos_emb: cos and sin unsqueezed at the
# head axis, rotate_half by slices), and issue 26's attention -> row statistic -> matmul
MODEL_PROGRAMS = {
    "rope_model": """
kernel rope(q: bf16[B, H, S, D], k: bf16[B, KH, S, D], cos: bf16[B, S, D],
            sin: bf16[B, S, D]) -> (bf16[B, H, S, D], bf16[B, KH, S, D]) {
    c = cos[:, None]
    s = sin[:, None]
    q_rot = concat(-q[..., D // 2:], q[..., :D // 2], axis=-1)
    k_rot = concat(-k[..., D // 2:], k[..., :D // 2], axis=-1)
    return q * c + q_rot * s, k * c + k_rot * s
}""",
    "attention_row_stat_matmul": """
kernel f(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D], w: f32[D, E]) -> f32[B, M, E] {
    o = softmax(q @ k.T) @ v
    return (o * sum(o, keepdims=true)) @ w
}""",
}
PROGRAMS = {p.stem: p.read_text() for p in sorted((ROOT / "examples").glob("*.tdsl"))} | MODEL_PROGRAMS

# awkward sizes: primes, an odd head dim, GQA's 4 heads over 2
DIMS = dict(B=2, H=4, KH=2, M=17, N=33, S=17, D=17, K=19, F=23, V=37, L=13, NB=6, E=24, T=19, C=2, P=7, W=11,
            KP=3, G=1)
SCALARS = dict(scale=0.3, cap=5.0, eps=1e-5, temperature=0.7, lam=0.4, width=3, radius=1)

parse_pipeline("canonicalize")  # registers every built-in pass
PASSES = sorted(REGISTRY)
DEFAULT = DEFAULT_PIPELINE.split(",")
SINGLES = [[name] for name in PASSES]
DROP_ONE = [[p for p in DEFAULT if p != dropped] for dropped in DEFAULT if dropped != "lower-kernels"]
# the issue's, rewrites after the fusions that feed them kernels, fusions after lower-kernels
# or after another fusion
PAIRS = [["fuse-elementwise"], ["fuse-epilogue", "online-softmax"], ["fuse-attention", "hoist-row-scale"],
         ["fuse-epilogue", "canonicalize"], ["fuse-rows", "sink-reshape"], ["lower-kernels", "fuse-horizontal"],
         ["fuse-attention", "distribute-matmul"], ["fuse-epilogue", "recompute"], ["fuse-rows", "fuse-attention"]]
PAIRS += [list(p) for p in random.Random(26).sample(list(itertools.permutations(PASSES, 2)), 8)]
PIPELINES = [",".join(p) for p in SINGLES + DROP_ONE + PAIRS]


def arguments(fn: tiledsl.Program, seed: int = 0) -> dict:
    """Random arguments; labels with ignored positions (-100), sorted document ids, decays
    below 1 (retention's log_gamma, a state space model's gate: their powers overflow f16
    otherwise, in the reference too)."""
    g = torch.Generator().manual_seed(seed)
    args = testing.random_inputs(fn, {d: DIMS[d] for d in testing.needed_dims(fn)}, generator=g,
                                 scalars=SCALARS)
    if "labels" in args:
        labels = torch.randint(0, DIMS["V"], args["labels"].shape, generator=g)
        args["labels"] = labels.where(torch.rand(labels.shape, generator=g) > 0.2, -100).to(args["labels"].dtype)
    if "doc" in args:
        args["doc"] = torch.randint(0, 3, args["doc"].shape, generator=g).sort().values.to(torch.int32)
    for name in ("log_gamma", "a"):
        if name in args and args[name].dtype in (torch.float32, torch.float16, torch.bfloat16):
            args[name] = -args[name].abs()
    return args


def check_pipeline(program: str, pipeline: str) -> tiledsl.Program:
    fn = tiledsl.compile(PROGRAMS[program], pipeline=pipeline, verify=True)
    report = testing.check(fn, **arguments(fn))
    assert report.ok, f"{program} with pipeline {pipeline!r}: {report}"
    return fn


def rotation(i: int, count: int = 2) -> list[str]:
    names = list(PROGRAMS)
    return [names[(i * count + j) % len(names)] for j in range(count)]


@pytest.mark.parametrize("i, pipeline", list(enumerate(PIPELINES)), ids=[p for p in PIPELINES])
def test_every_pipeline_compiles_and_meets_the_oracle(i, pipeline):
    for program in rotation(i):
        check_pipeline(program, pipeline)


@pytest.mark.parametrize("program", PROGRAMS)
def test_hoist_row_scale_alone_keeps_the_accuracy_rule(program):
    check_pipeline(program, "hoist-row-scale")


@pytest.mark.slow
def test_every_program_with_every_pipeline():
    """Every program with every pipeline (about 100 s; run with -m slow)."""
    failures = []
    for pipeline, program in itertools.product(PIPELINES, PROGRAMS):
        try:
            check_pipeline(program, pipeline)
        except AssertionError as err:  # (its message names the program and the pipeline)
            failures.append(str(err))
        except tiledsl.TileDSLError as err:
            failures.append(f"{program} with pipeline {pipeline!r}: {err}")
    assert not failures, "\n".join(failures)


# --- the defects the sweep found, one test each -------------------------------------------------

def test_sink_reshape_after_fuse_rows_leaves_an_op_of_a_kernel_result_where_it_is():
    """Switch Transformer's gate, a row program's result, scales a slice of the expert GEMM's
    output: sink-reshape asked the kernel for its shape ('KernelOp' object has no attribute
    'shape', an internal error)."""
    check_pipeline("switch_moe", "fuse-rows,sink-reshape")


def test_a_prologue_reading_a_row_sum_leaves_the_sum_to_a_row_program():
    """`(o * sum(o, keepdims=true)) @ w` with fuse-epilogue alone (no hoist-row-scale): the
    A prologue reads the row sum, which the GEMM then also took as a statistic of its own K
    loop, known only after it (KeyError 'sum' in the template, an internal error)."""
    fn = check_pipeline("attention_row_stat_matmul", "fuse-epilogue")
    assert [kn.template for kn in fn.kernels][-2:] == ["rows", "matmul"]
    assert ("[fuse-epilogue] refused: sum (line 4) -> mul (line 4): a prologue reads it at every step of "
            "the K loop, which sums it: it is known only after the loop [rule: tile]") in fn.explain()


def test_recompute_after_fuse_epilogue_reads_a_view_of_a_kernel_result():
    """A view of a GEMM kernel's result (`h[:, None, :]`) is no leaf a clone reads as it is:
    recompute asked the registry for the kind 'kernel' (KeyError, an internal error)."""
    check_pipeline("switch_moe", "fuse-epilogue,recompute")



def test_sink_reshape_after_fuse_rows_leaves_a_kernels_result_alone():
    """With fuse-rows first, a slice of the qk-norm row program's result has a kernel as its
    producer, which sink-reshape read as an op (an internal error: KernelOp has no shape):
    a kernel's result is no value it sinks an op before."""
    check_pipeline("qk_norm_rope_attention", "fuse-rows,sink-reshape")


def test_fuse_elementwise_alone_forms_no_kernel_without_results():
    """Without dce, RoPE's `-q[..., D // 2:]` (read through the rewritten concat, not by
    itself) is dead: fuse-elementwise made it a kernel of no results, an internal error in
    the backend (zip() argument 2 is longer than argument 1). A dead group is removed."""
    fn = check_pipeline("rope", "fuse-elementwise")
    assert [k.template for k in fn.kernels] == ["pointwise", "pointwise"]
    assert all(k.region.outputs for k in (op for _, op in fn.graph.nodes(data="op")
                                          if isinstance(op, tiledsl.ir.KernelOp)))


def test_a_dead_scalar_in_a_pipeline_without_dce_is_dropped():
    """A scalar nothing reads stayed outside every kernel ('const' reached the Triton
    backend outside a kernel, an internal error): lower-kernels drops it."""
    fn = tiledsl.compile("kernel f(x: f32[N], s: f32) -> f32[N] {\n    t = s * 2.0\n    return x + s\n}",
                         pipeline="cse")
    x = torch.randn(17, generator=torch.Generator().manual_seed(0))
    assert testing.check(fn, x, 0.3).ok
    assert [k.ops[0].kind for k in fn.kernels] == ["add"]


def test_online_softmax_after_fuse_epilogue_reads_the_kernel_results_around_a_softmax():
    """gpt-oss's sink softmax of scores a GEMM kernel computed: the pattern read the kernel
    as an op ('KernelOp' object has no attribute 'type', an internal error); its row input
    and sink are (node, result) values now. (Run first, fuse-epilogue takes the normalization
    `e / (sum(e) + exp(sink - m))` into `p @ v`'s A prologue, a per-row divisor read once a
    row, so what online-softmax finds are the statistics of the scores kernel's result.)"""
    fn = check_pipeline("attention_sinks", "fuse-epilogue,online-softmax")
    kinds = [(k.template, k.ops[0].kind) for k in fn.kernels]
    assert kinds[:2] == [("matmul", "matmul"), ("rows", "max")] and kinds[-1] == ("matmul", "div")


def test_hoist_row_scale_after_fuse_attention_reads_a_kernel_result():
    """The row statistic's operand is the attention kernel's result: hoist-row-scale read it
    as an op ('KernelOp' object has no attribute 'type', an internal error)."""
    fn = check_pipeline("attention_row_stat_matmul", "fuse-attention,hoist-row-scale")
    hoisted = [str(r) for r in fn.remarks if r.pass_name == "hoist-row-scale"]
    assert hoisted == ["[hoist-row-scale] fused: sum (line 4) -> matmul (line 4): the row scale sum (line 4) "
                       "[B, M, 1] is applied to the product, not to the A operand ((r * A) @ B = r * (A @ B)): "
                       "the scaled [B, M, D] operand need not be stored (modelled saving: 8·B·D·M B)"]


@pytest.mark.parametrize("k", [1, 19])
def test_hoist_row_scale_without_fuse_epilogue_keeps_a_half_precision_scale_on_a(k):
    """Hoisted with no fuse-epilogue after it, an RMSNorm's scale multiplied the bf16
    product after it was stored: rounded unscaled, the result missed the oracle at K = 1
    (error 0.00156 against a tolerance of 0.00129), where the scaled operand is exactly
    +-1. In a compiled pipeline without fuse-epilogue, the scale stays on A."""
    fn = tiledsl.compile(PROGRAMS["rmsnorm_projection"], pipeline="hoist-row-scale")
    g = torch.Generator().manual_seed(0)
    for m, n in ((1, 1), (17, 5)):
        args = [torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, generator=g).bfloat16(),
                torch.randn(n, k, generator=g).bfloat16(), 1e-6]
        report = testing.check(fn, *args)
        assert report.ok, report
    assert [str(r) for r in fn.remarks if r.pass_name == "hoist-row-scale"] == [
        "[hoist-row-scale] refused: rsqrt (line 7) -> matmul (line 8): no fuse-epilogue follows in this "
        "pipeline to apply rsqrt (line 7) to the f32 accumulator: the bf16 product would be rounded before "
        "the scale, so the scale stays on A [rule: op]"]
    # with fuse-epilogue after it (the default), norm and projection are one GEMM
    assert [k.template for k in tiledsl.compile(PROGRAMS["rmsnorm_projection"]).kernels] == ["matmul"]


def test_an_attention_backward_epilogue_loads_no_tensor():
    """Without cse, the written-out sink softmax is not recognised and fuse-attention-backward
    took this forward's `p @ wb` as a product summed over the keys; its epilogue took
    `where(y > t, ., t)`, whose comparison every reader recomputes from the tensor y, but
    the kernel's epilogue loads no tensor (KeyError: 6, an internal error). Found by
    sweeping pipelines over generated programs (seed ps3, program 60)."""
    c = "where(((index(y, 0) * 0.01) < rsqrt(N)), (x @ wb.T * 0.125), -inf)"
    m = f"maximum(max({c}, axis=-1, keepdims=true), z)"  # each written out, as the fuzzer does
    src = f"""kernel f(x: f16[M, N], y: f16[N], z: f16[M, 1], wb: f16[H, N, N], s: f32) -> f16[H, M, N] {{
    t = (s * 2.0) * 1.0
    return where(y > t, ((exp({c} - {m}) / (sum(exp({c} - {m}), axis=-1, keepdims=true) + exp(z - {m}))) @ wb), t)
}}"""
    no_cse = ",".join(p for p in DEFAULT if p != "cse")
    fn = tiledsl.compile(src, pipeline=no_cse)
    g = torch.Generator().manual_seed(0)
    for h, m, n in ((1, 1, 1), (3, 17, 33)):
        args = [torch.randn(m, n, generator=g).half(), torch.randn(n, generator=g).half(),
                torch.randn(m, 1, generator=g).half(), (torch.randn(h, n, n, generator=g) / n ** 0.5).half(), 0.1]
        report = testing.check(fn, *args)
        assert report.ok, report
    chain = fn.kernels[-1]
    kinds = [op.kind for op in chain.ops]
    assert chain.template == "attention" and kinds[-3:] == ["mul", "gt", "where"]


@pytest.mark.parametrize("pipeline", ["canonicalize", None], ids=["unfused", "default"])
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_a_half_precision_value_stored_between_kernels_compares_as_torch_does(dt, pipeline):
    """Pipeline sweep program ps4/14: `minimum(z, 1e-3) == 1e-3` with the minimum stored in
    f16 by one kernel was compared in f32 against the unrounded literal by the next (False
    where torch, comparing in f16, says True); fused, it was True. Both sides of a comparison
    whose promoted dtype is f16 or bf16 are rounded to it, as torch compares them."""
    torch_dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dt]
    fn = tiledsl.compile(f"""kernel f(z: {dt}[N], x: {dt}[N]) -> {dt}[N] {{
        t = minimum(z, 1e-3)
        return where(t == 1e-3, x, 7.0) + where(t < 1e-3, 2.0, 0.0)
    }}""", pipeline=pipeline)
    z = torch.cat([torch.rand(100) * 2e-3, torch.full((13,), 1e-3)]).to(torch_dt)
    x = randn(113, dtype=torch_dt)
    report = testing.check(fn, z, x)
    assert report.ok, report
    torch.testing.assert_close(fn(z, x), fn.reference(z, x), rtol=0, atol=0)


@pytest.mark.parametrize("pipeline", ["canonicalize", None], ids=["unfused", "default"])
@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_a_half_precision_value_an_f32_op_promotes_is_read_as_torch_reads_it(dt, pipeline):
    """Fuzz finding 0:3754, minimized: the sum of a softmax's probabilities is N; torch's f16 or
    bf16 sum rounds to it exactly, however the probabilities rounded. Stored by a kernel of
    its own (unfused), the sum was rounded so; summed in the kernel of the f32 add that
    promotes it (the default pipeline), it was not, and the result kept the probabilities'
    roundings (bf16: 9.6e-4 off, the oracle's tolerance 1.4e-5 with eager exact). A computed
    16-bit value an op reads in a wider type is read at its dtype, through a cast sema puts
    there, so both pipelines agree with torch."""
    torch_dt = {"f16": torch.float16, "bf16": torch.bfloat16}[dt]
    fn = tiledsl.compile(f"""kernel f(x: {dt}[M, N], y: f32[M, N]) -> f32[M, N] {{
        return y + sum(softmax(x, axis=0), axis=(0, 1))
    }}""", pipeline=pipeline)
    for m, n in ((1, 1), (17, 33), (113, 17)):
        run_checked(fn, randn(m, n, dtype=torch_dt), randn(m, n), sm90=False)
    if pipeline is None:  # the softmax along the columns; the sum split over programs (its cast
        # in the combine); the add, which reads it and a value of the rows
        assert [k.template for k in fn.kernels] == ["rows", "rows", "pointwise"]


def test_a_sinks_factor_left_on_the_probabilities_is_not_a_probability_modification():
    """Without fuse-epilogue after it, hoist-row-scale leaves gpt-oss's sink factor
    sigmoid(logsumexp(s) - sink) on the bf16 probabilities, and fuse-attention took the
    product for a probability modification, which the kernel applies to each key block's p
    before the row's logsumexp exists (an internal error in the template: 'NoneType' object
    is not iterable). It is refused (cycle): the softmax and the two matmuls are kernels of
    their own."""
    pipeline = ",".join(p for p in DEFAULT if p != "fuse-epilogue")
    fn = check_pipeline("attention_sinks", pipeline)
    assert [k.template for k in fn.kernels] == ["matmul", "rows", "matmul"]
    assert any(r.pass_name == "fuse-attention" and "a row statistic such as their logsumexp" in str(r)
               for r in fn.remarks)


def test_attention_backward_refuses_a_space_whose_op_reads_its_own_row_sum():
    """With no fuse-attention before it, `o = softmax(q @ k.T) @ v` is a score dot to
    fuse-attention-backward (linear attention's form), and `o * sum(o)` a score op reading
    the dot's row sum. The analysis took that sum for one the kernels accumulate per tile
    and add into a result, which a score op cannot read before the walk ends: the plan found
    no result for it (KeyError: 4 in attention_backward_plan, an internal error; also with
    fuse-rows or hoist-row-scale after it). The space is refused (cycle)."""
    fn = check_pipeline("attention_row_stat_matmul", "fuse-attention-backward")
    assert [k.template for k in fn.kernels] == ["matmul", "rows", "matmul", "rows", "pointwise", "matmul"]
    assert [str(r) for r in fn.remarks if r.pass_name == "fuse-attention-backward"] == [
        "[fuse-attention-backward] refused: sum (line 4) -> mul (line 4): mul (line 4) reads sum (line 4), a "
        "sum of the attention backward's scores that the kernels add their tiles into, complete only after "
        "them [rule: cycle]"]


def test_canonicalize_after_fuse_epilogue_reads_a_kernel_result_as_a_value():
    """gpt-oss's row max of scores a GEMM kernel computed: canonicalize's patterns read an
    operand's type from its node ('KernelOp' object has no attribute 'shape', an internal
    error; attention_row_stat_matmul's row sum too). They read it through the edge, as the
    kernel types each result, and match an operand's kind only when it is an op: a sum
    along a size-1 axis of a kernel's result is a view of it, the kernel left as it is."""
    fn = check_pipeline("attention_sinks", "fuse-epilogue,canonicalize")
    assert [k.template for k in fn.kernels][:2] == ["matmul", "rows"]
    fn = tiledsl.compile("kernel f(x: f32[M, K], w: f32[K, 1]) -> f32[M] {\n    return sum(x @ w, axis=1)\n}",
                         pipeline="fuse-epilogue,canonicalize", verify=True)
    g = torch.Generator().manual_seed(0)
    assert testing.check(fn, torch.randn(17, 19, generator=g), torch.randn(19, 1, generator=g)).ok
    assert [k.template for k in fn.kernels] == ["matmul"]
    assert sorted(op.kind for _, op in fn.graph.nodes(data="op") if not isinstance(op, tiledsl.ir.KernelOp)) == [
        "param", "param", "return", "slice"]


def test_recompute_after_fuse_epilogue_moves_no_slice_of_a_kernel_result():
    """paged_decode's `(softmax(s) @ v)[:, :, 0, :]` slices a GEMM kernel's result, which
    recompute read as an elementwise op to move the slice through ('KernelOp' object has no
    attribute 'shape', an internal error). A kernel's result is stored, its slice a view:
    the slice stays, and a chain reading a kernel's result (`h * sum(h)` of a GEMM's h) is
    not moved either, a kernel's result being no value a clone can read as it is."""
    fn = check_pipeline("paged_decode", "fuse-epilogue,recompute")
    assert [k.template for k in fn.kernels] == ["pointwise", "matmul", "pointwise", "rows", "matmul"]
    src = """kernel f(x: f32[M, K], w: f32[K, N]) -> f32[M, 3] {
    h = x @ w
    return (h * sum(h, axis=1, keepdims=true))[:, :3]
}"""
    fn = tiledsl.compile(src, pipeline="fuse-epilogue,recompute", verify=True)
    g = torch.Generator().manual_seed(0)
    assert testing.check(fn, torch.randn(17, 19, generator=g), torch.randn(19, 5, generator=g)).ok
    assert not [r for r in fn.remarks if r.pass_name == "recompute"]
    # (the returned slice is copied out by a kernel of its own)
    assert [k.template for k in fn.kernels] == ["matmul", "rows", "pointwise", "pointwise"]


def test_fuse_attention_after_fuse_rows_finds_no_scores_in_a_kernel():
    """Every attention program after fuse-rows (or fuse-elementwise): the row kernel took
    the softmax and the score modification, and fuse-attention, looking for a score chain
    `f(q @ k.T) @ v` behind p @ v, read the kernel as the op computing p ('KernelOp' object
    has no attribute 'shape', an internal error; found by running every fusion pass before
    every other pass, compiling only). A kernel's result computes no scores: p @ v stays a
    GEMM reading it."""
    fn = check_pipeline("attention", "fuse-rows,fuse-attention")
    assert [(k.template, k.ops[0].kind) for k in fn.kernels] == [
        ("matmul", "matmul"), ("rows", "mul"), ("matmul", "matmul")]
