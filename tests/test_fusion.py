"""Fusion (issue 3): kernel counts and what each kernel covers, numerics of every fused
kernel against the design section 5 oracle on tail sizes, refusals as records, and the
GEMM template's PTX on sm_90.
"""

import re

import pytest
import torch

import tiledsl
from helpers import compile_for_sm90, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot
from tiledsl.passes.fusion.remarks import FusionRemark, Rule
from tiledsl.testing import needed_dims

DT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def structure(fn: tiledsl.Program) -> list[tuple[str, list[str]]]:
    return [(k.template, [op.kind for op in k.ops]) for k in fn.kernels]


# --- the programs of the issue, with their kernel counts ----------------------------------------

PROGRAMS = {
    "multiply_multiply": (
        "kernel f(a: {dt}[M, K], b: {dt}[K, N], d: {dt}[M, N], e: {dt}[M, N]) -> {dt}[M, N] {{\n"
        "    return (a @ b) * d * e\n}}",
        [("matmul", ["matmul", "mul", "mul"])],
        lambda dt, m, k, n: [randn(m, k, dtype=dt), randn(k, n, dtype=dt), randn(m, n, dtype=dt),
                             randn(m, n, dtype=dt)]),
    "row_col_scales": (
        "kernel f(a: {dt}[M, K], b: {dt}[K, N], rs: f32[M, 1], cs: f32[1, N]) -> {dt}[M, N] {{\n"
        "    return (a @ b) * rs * cs\n}}",
        [("matmul", ["matmul", "cast", "mul", "mul", "cast"])],
        lambda dt, m, k, n: [randn(m, k, dtype=dt), randn(k, n, dtype=dt), randn(m, 1), randn(1, n)]),
    "gelu_linear": (
        "kernel f(x: {dt}[M, K], w: {dt}[N, K], bias: {dt}[N]) -> {dt}[M, N] {{\n"
        "    return gelu(x @ w.T + bias)\n}}",
        [("matmul", ["matmul", "add", "gelu"])],
        lambda dt, m, k, n: [randn(m, k, dtype=dt), randn(n, k, dtype=dt), randn(n, dtype=dt)]),
    "batched_relu_f32_out": (
        "kernel f(a: {dt}[B, M, K], b: {dt}[B, K, N], r: {dt}[B, M, N]) -> f32[B, M, N] {{\n"
        "    return relu(a @ b + r)\n}}",
        [("matmul", ["matmul", "add", "relu", "cast"])],
        lambda dt, m, k, n: [randn(2, m, k, dtype=dt), randn(2, k, n, dtype=dt), randn(2, m, n, dtype=dt)]),
    "broadcast_chain": (
        "kernel f(x: {dt}[M, N], y: {dt}[N], z: {dt}[M, 1], s: f32) -> {dt}[M, N] {{\n"
        "    return relu((x * y + z) * s - x) / (1.0 + exp(-x))\n}}",
        [("pointwise", ["mul", "add", "mul", "sub", "relu", "neg", "exp", "add", "div"])],
        lambda dt, m, k, n: [randn(m, n, dtype=dt), randn(n, dtype=dt), randn(m, 1, dtype=dt), 0.5]),
    "rmsnorm": (
        "kernel f(x: {dt}[M, N], w: {dt}[N], eps: f32) -> {dt}[M, N] {{\n"
        "    xf = cast(x, f32)\n"
        "    return xf * rsqrt(mean(xf * xf, keepdims=true) + eps) * w\n}}",
        [("rows", ["cast", "mul", "mean", "add", "rsqrt", "mul", "mul", "cast"])],
        lambda dt, m, k, n: [randn(m, n, dtype=dt), randn(n, dtype=dt), 1e-6]),
    "layernorm": (
        "kernel f(x: {dt}[M, N], w: {dt}[N], b: {dt}[N], eps: f32) -> {dt}[M, N] {{\n"
        "    mu = mean(x, keepdims=true)\n"
        "    xc = x - mu\n"
        "    var = mean(xc * xc, keepdims=true)\n"
        "    return xc * rsqrt(var + eps) * w + b\n}}",
        [("rows", ["mean", "sub", "mul", "mean", "add", "rsqrt", "mul", "mul", "add"])],
        lambda dt, m, k, n: [randn(m, n, dtype=dt), randn(n, dtype=dt), randn(n, dtype=dt), 1e-5]),
    "softmax_with_epilogue": (
        "kernel f(x: {dt}[M, N], t: f32) -> ({dt}[M, N], f32[M]) {{\n"
        "    s = x / t\n"
        "    return softmax(s) * 2.0 - 1.0, logsumexp(s)\n}}",
        [("rows", ["div", "softmax", "mul", "sub", "logsumexp", "cast"])],
        lambda dt, m, k, n: [randn(m, n, dtype=dt, scale=3), 0.7]),
    "stored_intermediate": (
        "kernel f(a: {dt}[M, K], b: {dt}[K, N]) -> ({dt}[M, N], {dt}[M, N]) {{\n"
        "    c = a @ b\n"
        "    return c, relu(c)\n}}",
        [("matmul", ["matmul", "relu"])],
        lambda dt, m, k, n: [randn(m, k, dtype=dt), randn(k, n, dtype=dt)]),
    "operand_prologue": (
        "kernel f(x: f32[M, K], w: {dt}[K, N]) -> {dt}[M, N] {{\n"
        "    return cast(x * 0.5, {dt}) @ w\n}}",
        [("matmul", ["mul", "cast", "matmul"])],
        lambda dt, m, k, n: [randn(m, k), randn(k, n, dtype=dt)]),
}

SIZES = [(1, 1, 1), (17, 33, 113), (113, 64, 17)]


@pytest.mark.parametrize("name", PROGRAMS)
def test_kernel_count_and_coverage(name):
    src, expected, _ = PROGRAMS[name]
    fn = tiledsl.compile(src.format(dt="f16"))
    assert structure(fn) == expected
    assert not [r for r in fn.remarks if isinstance(r, FusionRemark) and not r.fused]


@pytest.mark.parametrize("dt", DT)
@pytest.mark.parametrize("mkn", SIZES, ids=str)
@pytest.mark.parametrize("name", PROGRAMS)
def test_fused_numerics(name, mkn, dt):
    src, _, make = PROGRAMS[name]
    fn = tiledsl.compile(src.format(dt=dt))
    args = make(DT[dt], *mkn)
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    run_checked(fn, *tensors, *scalars)


@pytest.mark.parametrize("n", [4999, 20000])
def test_long_row_programs_loop(n):
    src, _, make = PROGRAMS["layernorm"]
    fn = tiledsl.compile(src.format(dt="f32"))
    run_checked(fn, *make(torch.float32, 3, 0, n)[:3], 1e-5)
    src, _, make = PROGRAMS["softmax_with_epilogue"]
    run_checked(tiledsl.compile(src.format(dt="bf16")), *make(torch.bfloat16, 2, 0, n))


def test_c_plus_c_transposed_is_refused_and_recorded():
    fn, _ = run_checked("kernel f(a: f32[N, K], b: f32[K, N]) -> f32[N, N] {\n    c = a @ b\n    return c + c.T\n}",
                        randn(17, 33), randn(33, 17))
    assert structure(fn) == [("matmul", ["matmul"]), ("pointwise", ["add"])]
    (remark,) = fn.remarks
    assert (remark.pass_name, remark.fused, remark.rule) == ("fuse-epilogue", False, Rule.OTHER_INDEX)
    assert (remark.producer.kind, remark.producer.span.line) == ("matmul", 2)
    assert (remark.consumer.kind, remark.consumer.span.line) == ("add", 3)
    assert str(remark) == ("[fuse-epilogue] refused: matmul (line 2) -> add (line 3): it reads matmul "
                           "(line 2) transposed [rule: other-index]")
    assert str(remark) in fn.explain()


def test_an_operand_depending_on_the_product_is_a_cycle():
    fn, _ = run_checked("kernel f(a: f32[M, K], b: f32[K, N]) -> f32[M, N] {\n    c = a @ b\n"
                        "    return c * sum(c, keepdims=true)\n}", randn(17, 33), randn(33, 19))
    rules = {(r.producer.kind, r.consumer.kind, r.rule) for r in fn.remarks}
    assert ("matmul", "mul", "cycle") in rules


def test_a_cheap_broadcast_producer_is_recomputed_by_its_reader():
    fn, _ = run_checked("kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] { return x + exp(y) }",
                        randn(17, 113), randn(113))
    assert structure(fn) == [("pointwise", ["exp", "add"])]
    assert [(r.pass_name, r.fused, r.detail) for r in fn.remarks] == [
        ("recompute", True, "computed again at each [M, N] element of its reader (4 operation units "
                            "per element, within 16) instead of stored as [N] by a kernel of its own")]


def test_a_costly_broadcast_producer_is_refused_not_recomputed():
    fn, _ = run_checked("kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] { return x + exp(exp(exp(exp(exp(y))))) }",
                        randn(17, 113), randn(113, scale=0.1))
    assert structure(fn) == [("pointwise", ["exp"] * 5), ("pointwise", ["add"])]
    assert [(r.rule, r.detail) for r in fn.remarks] == [
        ("profit", "recomputing it costs 20 operation units per element, more than the 16 a "
                   "memory-bound reader hides"),
        ("other-index", "add (line 1) reads the group's values broadcast from [N] to [M, N]")]


def test_a_reduced_row_read_along_the_row_is_refused():
    fn, _ = run_checked("kernel f(x: f32[N, N]) -> f32[N, N] { m = max(x, axis=-1); return x - m }",
                        randn(17, 17))
    assert structure(fn) == [("rows", ["max"]), ("pointwise", ["sub"])]
    assert [(r.pass_name, r.rule) for r in fn.remarks] == [("fuse-rows", "other-index")]


@pytest.mark.parametrize("operand", ["a", "b"])
def test_a_gemm_prologue_reads_a_0d_tensor_another_kernel_stored(operand):
    # the mean is a 0-d tensor a row kernel stores, not a by-value argument: the GEMM's
    # prologue read it as one and failed (an internal error, KeyError; fuzz finding 0:3740)
    prologue = {"a": "minimum(x, mean(y)) @ w", "b": "x @ minimum(w, mean(y))"}[operand]
    fn, _ = run_checked(f"kernel f(x: f32[M, N], y: f32[N], w: f32[N, N]) -> f32[M, N] {{ return {prologue} }}",
                        randn(17, 33), randn(33), randn(33, 33, scale=0.2))
    assert structure(fn) == [("rows", ["mean"]), ("matmul", ["minimum", "matmul"])]


def test_attention_operand_prologues_read_a_0d_tensor_another_kernel_stored():
    fn, _ = run_checked("""kernel f(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], y: f32[D]) -> f32[B, H, M, D] {
    t = mean(y)
    return softmax(minimum(q, t) @ minimum(k, t).T, axis=-1) @ v
}""", randn(2, 3, 17, 16), randn(2, 3, 33, 16), randn(2, 3, 33, 16), randn(16))
    assert structure(fn) == [("rows", ["mean"]),
                             ("attention", ["minimum", "minimum", "matmul", "softmax", "matmul"])]


def test_fusion_never_changes_results_against_the_unfused_program():
    src = PROGRAMS["layernorm"][0].format(dt="f32")
    x, w, b = randn(17, 113), randn(113), randn(113)
    fused = tiledsl.compile(src)(x, w, b, 1e-5)
    unfused = tiledsl.compile(src, pipeline="canonicalize,cse,dce")(x, w, b, 1e-5)
    assert (fused - unfused).abs().max() < 1e-5


# --- sm_90 ------------------------------------------------------------------------------------------

GPU_DIMS = {"B": 2, "M": 8192, "N": 8192, "K": 4096}  # the GEMM benchmark's shape


def wgmma_n(report) -> list[int]:
    return [int(re.fullmatch(r"m64n(\d+)k16", s).group(1)) for s in report.wgmma]


def gpu_reports(name: str, dt: str, every_candidate: bool = False):
    """The program's GEMM kernel as it would run on an H100 (aot.inspect_program)."""
    fn = tiledsl.compile(PROGRAMS[name][0].format(dt=dt))
    return aot.inspect_program(fn, {d: GPU_DIMS[d] for d in needed_dims(fn)},
                               every_candidate=every_candidate)


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("name", ["multiply_multiply", "gelu_linear", "row_col_scales",
                                  "batched_relu_f32_out", "stored_intermediate", "operand_prologue"])
def test_gemm_epilogue_default_uses_wide_wgmma_and_does_not_spill(name, dt):
    (r,) = gpu_reports(name, dt)
    assert r.spill_bytes == 0, r
    # 128 x 256 (Triton's tutorial's tile) where the epilogue is cheap ops only; gelu, and
    # a prologue's tile held through the K loop, start at 128 x 128
    wide = name not in ("gelu_linear", "operand_prologue")
    assert (r.config["BLOCK_M"], r.config["BLOCK_N"]) == ((128, 256) if wide else (128, 128)), r
    assert r.wgmma and min(wgmma_n(r)) >= 128, r
    assert r.tma > 0, r  # operands read as they are come through TMA, batched ones too


@pytest.mark.parametrize("name", ["gelu_linear", "multiply_multiply", "operand_prologue"])
def test_every_autotune_candidate_compiles_without_spills(name):
    reports = gpu_reports(name, "bf16", every_candidate=True)
    assert len(reports) >= 4
    for r in reports:
        assert r.spill_bytes == 0, r
        assert r.wgmma and min(wgmma_n(r)) >= 64, r


def test_wide_gemm_tiles_beside_any_epilogue_but_not_a_prologue():
    """With the epilogue on one column half at a time, 128 x 256 and 256 x 128 tiles are
    candidates (and do not spill) beside loaded tiles, gelu or two outputs; an operand
    prologue keeps its tile in registers through the K loop, so it stays at 128 x 128."""
    def tiles(name):
        return {(r.config["BLOCK_M"], r.config["BLOCK_N"]): r
                for r in gpu_reports(name, "f16", every_candidate=True)}

    for name in ("row_col_scales", "multiply_multiply", "gelu_linear", "stored_intermediate"):
        found = tiles(name)
        assert {(128, 256), (256, 128)} <= set(found), name
        assert found[(128, 256)].wgmma == ["m64n256k16"] and found[(128, 256)].spill_bytes == 0, name
    assert max(m * n for m, n in tiles("operand_prologue")) == 128 * 128


def test_every_fused_kernel_compiles_for_sm90():
    for name, (src, _, make) in PROGRAMS.items():
        fn = tiledsl.compile(src.format(dt="bf16"))
        args = make(torch.bfloat16, 113, 64, 17)
        fn(*[a for a in args if isinstance(a, torch.Tensor)], *[a for a in args if not isinstance(a, torch.Tensor)])
        assert all(ck.asm["cubin"] for _, ck in compile_for_sm90(fn)), name


def centered(n: int) -> str:
    return "kernel k(x: f32[M, N]) -> f32[M, N] {\n" + "    x = x - mean(x, keepdims=true)\n" * n + \
        "    return x\n}\n"


def test_row_programs_stop_at_eight_dependent_reductions():
    fn, _ = run_checked(centered(20), randn(17, 113))
    assert [(k.template, [op.kind for op in k.ops].count("mean")) for k in fn.kernels] == [
        ("rows", 8), ("rows", 8), ("rows", 4)]
    refused = [str(r) for r in fn.remarks if r.rule == "profit"]
    assert refused == [
        f"[fuse-rows] refused: sub (line {line}) -> mean (line {line + 1}): a row program reads its rows at "
        "most 9 times (8 dependent reductions); storing an intermediate costs less [rule: profit]"
        for line in (9, 17)]


def test_generated_source_grows_linearly():
    # a program n statements long: each row kernel is bounded, so bytes per statement stay flat
    per_statement = [sum(len(k.source) for k in tiledsl.compile(centered(n)).kernels) / n for n in (40, 320)]
    assert per_statement[1] < 1.05 * per_statement[0]


def test_row_programs_stop_at_256_ops():
    src = ("kernel k(x: f32[M, N]) -> f32[M, N] {\n    x = x - max(x, keepdims=true)\n"
           + "    x = exp(x) * 0.5\n" * 200 + "    return sum(x, keepdims=true) + x\n}\n")
    fn = tiledsl.compile(src)
    assert all(len(k.ops) <= 256 for k in fn.kernels)
    assert any(r.rule == "profit" and "at most 256 ops" in str(r) for r in fn.remarks)
    run_checked(fn, randn(17, 33))


@pytest.mark.parametrize("head, operands", [
    ("a: f32[M, K], b: f32[K, N]", "a @ b"),
    ("q: f32[M, K], k: f32[N, K], v: f32[N, N]", "softmax(q @ k.T) @ v"),
])
def test_gemm_and_attention_epilogues_share_one_input_limit(head, operands):
    """One admission module: both kernels take 8 extra tensors and refuse the 9th alike."""
    ds = [f"d{i}" for i in range(10)]
    src = (f"kernel f({head}, {', '.join(d + ': f32[M, N]' for d in ds)}) -> f32[M, N] {{\n"
           f"    return {operands} + {' + '.join(ds)}\n}}")
    fn = tiledsl.compile(src)
    sizes = {"M": 17, "N": 33, "K": 5}
    args = testing.random_inputs(fn, sizes, generator=torch.Generator().manual_seed(3))
    run_checked(fn, **args, sm90=False)
    (fused, rest) = structure(fn)
    assert fused[1].count("add") == 8 and rest == ("pointwise", ["add", "add"])
    refusals = [r for r in fn.remarks if not r.fused]
    assert [(r.rule, r.detail) for r in refusals] == [
        (Rule.PROFIT, "the epilogue would read more than 8 extra tensors")]


@pytest.mark.parametrize("name", ["multiply_multiply", "batched_relu_f32_out", "gelu_linear"])
def test_a_persistent_grid_covers_every_tile(name):
    """Three programs walk all the tiles (batch elements included) of a GEMM in grouped order."""
    import dataclasses

    from tiledsl.backends.triton.launch import KernelStep

    src, _, make = PROGRAMS[name]
    fn = tiledsl.compile(src.format(dt="f16"))
    (step,) = fn.runtime.steps
    emitted = step.emitted

    def persistent(dims, device):
        cfg = dataclasses.replace(emitted.configure(dims, device), persistent=True)
        cfg = dataclasses.replace(cfg, grid=(3,), constexprs={**cfg.constexprs, "BLOCK_M": 32,
                                                               "BLOCK_N": 16, "GROUP_M": 2})
        return cfg

    fn.runtime.steps = (KernelStep(dataclasses.replace(emitted, configure=persistent), step.reads, step.slot),)
    args = make(torch.float16, 113, 64, 77)  # 4 x 5 tiles (x 2 batch elements): several per program
    run_checked(fn, *args, sm90=False)
    assert fn.launches[0].kernel.launch_config(dict(fn.launches[0].dims), "interpreter").grid == (3,)


def test_a_path_back_through_a_planned_group_that_ends_later_is_a_cycle():
    """Gradient fuzzer, seed 2801, program 237: in the backward, one row program needs
    `maximum(logsumexp(t), c)` and later reads a sum of another row program's output,
    which reads that maximum. The path out of the second group ran past its last member
    (through reshapes and two sums) before re-entering the first group at a late member;
    the cycle check stopped there, and fuse-rows formed two kernels reading each other (an
    internal error: the graph contains a cycle). A planned group reaches back to its first
    member (`GroupPlan.reach_back`)."""
    src = """kernel f(x: f32[M, N], z: f32[M, 1], q: f32[B, H, M, N], w: f32[N, N]) -> f32[B, H, M, N] {
    t = transpose(logsumexp(z, axis=0, keepdims=true), 0, 1)
    p = softmax((x * q) @ w.T * 0.125, axis=-1) @ w
    return maximum(logsumexp(t, axis=-1, keepdims=false), sqrt(2.0) - 1.0 / N) / (abs(silu(p)) + 1.0)
}"""
    fn = tiledsl.compile(src)
    for b, h, m, n in ((1, 1, 1, 1), (2, 3, 17, 33)):
        report = testing.check_grads(fn, randn(m, n), randn(m, 1), randn(b, h, m, n), randn(n, n, scale=n ** -0.5),
                                     generator=torch.Generator().manual_seed(0))
        assert report.ok, report
    # 16 before: two independent kernels over different spaces share a launch, and sums over
    # several axes are one row program each; 13 before the GEMM summing w's gradient over the
    # batch in its K loop (`GemmPlan.batch_sums`); 12 before gathers' gradients at index
    # maps were read back (`index_maps.gather_adjoint`) instead of scattered; 10 before the
    # forward's row statistics were saved for it (`autodiff._row_statistic`)
    assert len(fn.backward.kernels) == 9
